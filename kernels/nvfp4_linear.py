"""
The three GEMMs of a direct-NVFP4 linear layer (paper eqs. 1-2 without the LoRA branch) on the GPU:

    Y  = Q1x16(X) Q16x16(W)^T                          forward.x, forward.w
    dX = Q1x16(dY) Q16x16(W)                           dgrad.dy, W's forward quantization reused
    dW = Q1x16(dY^T H) Q16x1(H^T Q1x16(X))             wgrad.dy, wgrad.x (eq. 2's random Hadamard H)

each operand quantized as its entry of nvfp4.LINEAR (the precision contract) says: rounding,
Hadamard, 4/6.

nvfp4.py's autograd function calls `forward` and `backward`; which route multiplies is decided here:
  * Hopper (no FP4 tensor cores): every quantize pass writes the bf16 grid values q * s_b (exact)
    and cuBLAS multiplies them (nvfp4_gemm.grid_values_mm). The forward keeps W's grid values for
    dX (2 bytes/param until the backward, like autocast's cached bf16 weight copies: no packed W,
    no second decoding pass) and the packed 4-bit X for eq. 2.
  * Blackwell: every quantize pass writes the packed form only, and all three GEMMs run on the
    FP4 tensor cores (nvfp4_gemm's tl.dot_scaled kernel): dX reads the forward's packed
    Q16x16(W) transposed, dW both of its 16x1 operands as stored.
Random draws (SR seeds, H) are made by the caller (nvfp4.backward_draws), the same for either route.
"""

import collections

import torch

from kernels.nvfp4_gemm import grid_values_mm, nvfp4_gemm, use_dot_scaled
from kernels.nvfp4_quant import global_amax_pair, quantize, quantize_dequant

# A packed operand for nvfp4_gemm built here (nvfp4.NVFP4Tensor has the same fields)
Packed = collections.namedtuple("Packed", "codes scales global_scale shape block")


def _check(entry, name, block):
    """The GPU routes quantize every operand in the block shape eqs. 1-2 give it
    (nvfp4.linear_contract checks that too); rounding, Hadamard and 4/6 they take from the entry."""
    if tuple(entry.block) != block:
        raise ValueError(f"kernels/nvfp4_linear: {name} is quantized in {block} blocks here, "
                         f"got {entry.block}")
    return entry


def forward(x, w, ex, ew, seeds=(0, 0)):
    """x (T, in), w (out, in); ex, ew: the contract entries of X and W (nvfp4.LINEAR's forward.x,
    forward.w); seeds: their SR seeds. -> (Y (T, out) in x's dtype, Q1x16(X) as (codes, scales,
    global_scale) for eq. 2, W's quantization as dX multiplies it, three tensors on either route:
    (bf16 grid values (out, in), an empty scales tensor, global scale), on Blackwell the packed
    Q16x16(W) (codes, scales, global scale))."""
    ex, ew = _check(ex, "forward.x", (1, 16)), _check(ew, "forward.w", (16, 16))
    if use_dot_scaled(x.device):  # W's quantization kept packed for dX (Packed, not grid values)
        qx = Packed(*quantize(x, (1, 16), ex.rounding, ex.four_over_six, seeds[0],
                              name="activation X"), x.shape, (1, 16))
        qw = Packed(*quantize(w, (16, 16), ew.rounding, ew.four_over_six, seeds[1],
                              name="weight W"), w.shape, (16, 16))
        return nvfp4_gemm(qx, qw, x.dtype), qx[:3], qw[:3]
    # one pass writes the packed X (kept) and its bf16 grid values (multiplied)
    xv, s_gx, xc, xs = quantize_dequant(x, (1, 16), ex.rounding, ex.four_over_six, seeds[0],
                                        return_tensor=True, name="activation X")
    wv, s_gw = quantize_dequant(w, (16, 16), ew.rounding, ew.four_over_six, seeds[1],
                                name="weight W")
    return (grid_values_mm(xv, wv.t(), s_gx, s_gw, x.dtype), (xc, xs, s_gx),
            (wv, wv.new_empty(0, dtype=torch.float8_e4m3fn), s_gw))


def backward(dy, qx, w_used, c, need, seed_dx, hadamard, seeds_dw, dw_dtype):
    """dy (T, out); qx the forward's packed Q1x16(X) (codes, scales, global_scale, shape, block: an
    nvfp4.NVFP4Tensor); w_used the forward's W as forward returned it (three tensors); c the
    resolved contract (nvfp4.linear_contract); need: (dX, dW) wanted; seed_dx, hadamard, seeds_dw: the draws
    (nvfp4.backward_draws). -> (dX, dW)."""
    edy = _check(c["dgrad.dy"], "dgrad.dy", (1, 16))
    amax_dy = amax_dyh = None
    if all(need) and hadamard is not None:  # one read of dY for both of its global amaxes
        amax_dy, amax_dyh = global_amax_pair(dy, hadamard, name="gradient dY")
    dx = dw = None
    if need[0] and use_dot_scaled(dy.device):  # w_used: the packed Q16x16(W), read transposed
        dyq = Packed(*quantize(dy, (1, 16), edy.rounding, edy.four_over_six, seed=seed_dx,
                               global_amax=amax_dy, name="gradient dY"), dy.shape, (1, 16))
        qw = Packed(*w_used, (w_used[0].shape[0], 2 * w_used[0].shape[1]), (16, 16))
        dx = nvfp4_gemm(dyq, qw, dy.dtype, trans_b=True)
    elif need[0]:
        dyv, s_g = quantize_dequant(dy, (1, 16), edy.rounding, edy.four_over_six, seed=seed_dx,
                                    global_amax=amax_dy, name="gradient dY")
        # Q16x16(W) reused
        dx = grid_values_mm(dyv, w_used[0], s_g, w_used[2], dy.dtype)
    if need[1]:
        dw = wgrad(dy, qx, c, hadamard, seeds_dw, amax_dyh, dw_dtype)
    return dx, dw


def wgrad(dy, qx, c, hadamard, seeds, dy_global_amax=None, out_dtype=torch.float32):
    """Eq. 2, dW = Q(dY^T H) Q(H^T X_hat) (out, in), both operands quantized as stored, (T, out)
    and (T, in) with 16x1 blocks along T (c["wgrad.dy"], c["wgrad.x"]), and read transposed by the
    GEMM. X_hat = the packed qx dequantized in dY's dtype (the precision the activations had),
    decoded inside the 16x1 quantize pass and its amax pre-pass (never written as a tensor).
    hadamard: H, or None without a rotation; seeds: the two SR seeds (dY's, X_hat's);
    dy_global_amax: max |H^T dY| if the caller has it."""
    edy, ex = _check(c["wgrad.dy"], "wgrad.dy", (16, 1)), _check(c["wgrad.x"], "wgrad.x", (16, 1))
    if use_dot_scaled(dy.device):  # both packed as stored (T, .), 16x1, read transposed
        dyq = Packed(*quantize(dy, (16, 1), edy.rounding, edy.four_over_six, seed=seeds[0],
                               hadamard=hadamard, global_amax=dy_global_amax, name="gradient dY"),
                     dy.shape, (16, 1))
        xhq = Packed(*quantize(qx, (16, 1), ex.rounding, ex.four_over_six, seed=seeds[1],
                               hadamard=hadamard, name="activation Q(X)", source_dtype=dy.dtype),
                     qx.shape, (16, 1))
        return nvfp4_gemm(dyq, xhq, out_dtype, trans_a=True, trans_b=True)           # (out, in)
    # (T, out)
    dyv, s_gdy = quantize_dequant(dy, (16, 1), edy.rounding, edy.four_over_six, seed=seeds[0],
                                  hadamard=hadamard, global_amax=dy_global_amax, name="gradient dY")
    xv, s_gx = quantize_dequant(qx, (16, 1), ex.rounding, ex.four_over_six, seed=seeds[1],
                                hadamard=hadamard, name="activation Q(X)",
                                source_dtype=dy.dtype)  # (T, in)
    return grid_values_mm(dyv.t(), xv, s_gdy, s_gx, out_dtype)  # (out, in)
