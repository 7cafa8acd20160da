"""
The three GEMMs of an NVFP4 linear layer (paper eqs. 1-2) on the GPU, with LoRA-SVD's low-rank
branch (§3.2, App. 9) when L1, L2 are given:

    Y  = Q1x16(X) Q16x16(W)^T  [+ (beta X L1^T) L2^T]   forward.x, forward.w
    dX = Q1x16(dY) Q16x16(W)   [+ (beta dY L2) L1]      dgrad.dy, W's forward quantization reused
    dW = Q1x16(dY^T H) Q16x1(H^T Q1x16(X))              wgrad.dy, wgrad.x (H: eq. 2's Hadamard)

each operand quantized as its entry of nvfp4.LINEAR (the precision contract) says: rounding,
Hadamard, 4/6. W is LoRA-SVD's residual W_res where there is a branch; eq. 2's dW is the same for
both (App. 8 takes the LoRA gradients from it later).

nvfp4.py's ops call `weight` (W's quantization, which a layer keeps while W is unchanged:
nvfp4.WeightCache), `activation` (X's, which the layers reading one x share:
nvfp4._SharedInput), `forward` and `backward`; which route multiplies is decided here:
  * Hopper (no FP4 tensor cores): every quantize pass writes the bf16 grid values q * s_b (exact)
    and cuBLAS multiplies them (nvfp4_gemm.grid_values_mm). The forward keeps W's grid values for
    dX (2 bytes/param until the backward, like autocast's cached bf16 weight copies: no packed W,
    no second decoding pass) and the packed 4-bit X for eq. 2. The branch rides on the same GEMMs
    as r extra columns (App. 9), with s_g the product of the two global scales:

        Y  = s_g ([X_hat | beta X L1^T / s_g] [W_hat | L2]^T)
        dX = s_g ([dY_hat | beta dY L2 / s_g] [W_hat ; L1])

    The quantize pass writes X_hat straight into the left columns of the (T, K + r) operand (no
    concatenation, no second copy of an activation), one small GEMM the branch columns beside it;
    W_hat likewise into [W_hat | L2 ; L1 | unused], whose rows the forward and columns dX read;
    one GEMM with K + r columns writes Y once, for ~r/K more FLOPs (docs/nvfp4_kernels.md measures
    the alternatives). The branch is BF16 (lora_svd.BRANCH: bf16 operands, fp32 accumulation,
    beta x L^T / s_g rounded to bf16 once): the reference's branch up to where that intermediate
    is rounded.
  * Blackwell: every quantize pass writes the packed form only, and all three GEMMs run on the
    FP4 tensor cores (nvfp4_gemm's tl.dot_scaled kernel): dX reads the forward's packed
    Q16x16(W) transposed, dW both of its 16x1 operands as stored. The branch is two bf16 GEMMs
    beside the residual, as the reference computes it, added to the residual's fp32 result.
Random draws (SR seeds, H) are made by the caller (nvfp4.backward_draws), the same for either route.
"""

import collections

import torch

from kernels.nvfp4_gemm import grid_values_mm, mm_fp32, nvfp4_gemm, scale_into, use_dot_scaled
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


def _check_branch(L1, branch_dtype):
    if L1 is not None and branch_dtype != torch.bfloat16:
        raise ValueError(f"kernels/nvfp4_linear: the fused branch runs in bf16 "
                         f"(lora_svd.BRANCH 'bf16'), got {branch_dtype}")


def _mm(a, b):
    """a @ b with an fp32 result: cuBLAS's fp32 accumulator for bf16 CUDA operands, else in fp32."""
    out = mm_fp32(a, b) if a.is_cuda and a.dtype == torch.bfloat16 else None
    return a.float() @ b.float() if out is None else out


def _branch(x, A, B):
    """Blackwell's branch (x A^T) B^T beside the FP4 residual: bf16 operands, fp32 accumulation,
    the rank-r intermediate rounded to bf16 once (nvfp4.low_rank). -> fp32."""
    return _mm(_mm(x.to(torch.bfloat16), A.t()).to(torch.bfloat16), B.t())


def _operand(x, rounding, four_over_six, seed, name, r=0, return_tensor=False, global_amax=None):
    """The Hopper GEMM's left operand (T, K + r) in bf16 with X_hat in its first K columns and r
    left for LoRA's branch (_branch_columns); X's s_g and, with return_tensor, the packed Q1x16(X)
    (codes, scales) written by the same pass. X_hat is nvfp4_quant's quantization of X (the same
    codes and, for SR, the same Philox draws given the seed)."""
    T, K = x.shape
    buf = torch.empty((T, K + r), device=x.device, dtype=torch.bfloat16)
    # X_hat into buf[:, :K] (rows K + r apart), the branch columns untouched
    _, s_g, *packed = quantize_dequant(x, (1, 16), rounding, four_over_six, seed=seed,
                                       global_amax=global_amax, return_tensor=return_tensor,
                                       name=name, out=buf[:, :K])
    return buf, s_g, packed


def _branch_columns(buf, x, L, beta, s_g, s_g_other):
    """The operand's last r columns beta X L^T / (s_g s_g_other) for LoRA's L (r, K) in bf16, from
    one GEMM with an fp32 result, the fp32 steps as torch's, rounded to bf16 once
    (nvfp4_gemm.scale_into)."""
    scale_into(buf[:, x.shape[1]:], _mm(x.to(L.dtype), L.t()), beta, s_g, s_g_other)  # (T, r)


def weight(w, ew, seed=0, L1=None, L2=None):
    """W's quantization as the forward and dX multiply it: three tensors on either route, the bf16
    grid values (out, in), with a branch [W_hat | L2 ; L1 | unused] (out + r, in + r), an empty
    scales tensor and the global scale; on Blackwell the packed Q16x16(W) (codes, scales, global
    scale). w (out, in); ew: its contract entry (nvfp4.LINEAR's forward.w); seed: its SR seed;
    L1 (r, in), L2 (out, r): LoRA-SVD's branch, or None."""
    ew = _check(ew, "forward.w", (16, 16))
    if use_dot_scaled(w.device):  # kept packed for dX (Packed, not grid values)
        return quantize(w, (16, 16), ew.rounding, ew.four_over_six, seed, name="weight W")[:3]
    # W's one quantize pass writes W_hat into [W_hat | L2 ; L1 | unused] (out + r, K + r): the
    # forward multiplies its first `out` rows [W_hat | L2], dX its first K columns [W_hat ; L1]
    (N, K), r = w.shape, 0 if L2 is None else L2.shape[1]
    wbuf = torch.empty((N + r, K + r), device=w.device, dtype=torch.bfloat16)
    _, s_gw = quantize_dequant(w, (16, 16), ew.rounding, ew.four_over_six, seed, name="weight W",
                               out=wbuf[:N, :K])
    if L2 is not None:  # cast to bf16 in place; the forward's branch reads L1 there
        wbuf[:N, K:].copy_(L2)
        wbuf[N:, :K].copy_(L1)
    return wbuf, wbuf.new_empty(0, dtype=torch.float8_e4m3fn), s_gw


def activation(x, ex, seed=0, r=0, global_amax=None):
    """X's quantization as the forward multiplies it (Q1x16(X)), four tensors: the packed codes,
    scales and global scale (eq. 2 reads them in the backward) and, on Hopper, the bf16 GEMM
    operand (T, in + r) with X_hat in its first `in` columns and r left for LoRA-SVD's branch
    (`forward` writes them), on Blackwell an empty tensor. x (T, in); ex: its contract entry
    (nvfp4.LINEAR's forward.x); seed: its SR seed; global_amax: max |x| if the caller has it (from
    its cast: nvfp4_quant.cast_bf16_amax). One quantization serves every layer that reads the same
    x (nvfp4._SharedInput): each writes its own branch columns before its GEMM."""
    ex = _check(ex, "forward.x", (1, 16))
    if use_dot_scaled(x.device):
        return *quantize(x, (1, 16), ex.rounding, ex.four_over_six, seed, global_amax=global_amax,
                         name="activation X")[:3], x.new_empty(0)
    buf, s_g, (codes, scales) = _operand(x, ex.rounding, ex.four_over_six, seed, "activation X", r,
                                         return_tensor=True, global_amax=global_amax)
    return codes, scales, s_g, buf


def forward(x, qx, qw, L1=None, L2=None, beta=1.0, branch_dtype=torch.bfloat16):
    """x (T, in); qx: its quantization (`activation`'s four tensors, with r = L1's rank); qw: W's
    (`weight`'s three tensors); L1 (r, in), L2 (out, r): LoRA-SVD's branch, or None.
    -> Y (T, out) in x's dtype."""
    _check_branch(L1, branch_dtype)
    if use_dot_scaled(x.device):
        qx = Packed(*qx[:3], x.shape, (1, 16))
        N = qw[0].shape[0]
        qw = Packed(*qw, (N, x.shape[1]), (16, 16))
        if L1 is None:
            return nvfp4_gemm(qx, qw, x.dtype)
        L1, L2 = L1.to(torch.bfloat16), L2.to(torch.bfloat16)
        y = nvfp4_gemm(qx, qw, torch.float32) + beta * _branch(x, L1, L2)
        return y.to(x.dtype)
    (_, _, s_gx, abuf), (wbuf, _, s_gw) = qx, qw
    N, K = wbuf.shape[0] - (0 if L1 is None else L1.shape[0]), x.shape[1]
    if L1 is not None:  # [X_hat | beta X L1^T / s_g], L1 in bf16 from W's buffer
        _branch_columns(abuf, x, wbuf[N:, :K], beta, s_gx, s_gw)
    return grid_values_mm(abuf, wbuf[:N].t(), s_gx, s_gw, x.dtype)


def backward(dy, qx, w_used, c, need, seed_dx, hadamard, seeds_dw, dw_dtype, L1=None, L2=None,
             beta=1.0, branch_dtype=torch.bfloat16, dx_dtype=None, dx_into=None):
    """dy (T, out); qx the forward's packed Q1x16(X) (codes, scales, global_scale, shape, block: an
    nvfp4.NVFP4Tensor); w_used the forward's W as forward returned it (three tensors); c the
    resolved contract (nvfp4.linear_contract); need: (dX, dW) wanted; seed_dx, hadamard, seeds_dw:
    the draws (nvfp4.backward_draws); L1, L2, beta: the branch, as forward took it. -> (dX rounded
    to dY's dtype and returned in dx_dtype (x's: fp32 under autocast where x is, the same values),
    dW in dw_dtype). dx_into: a contiguous (T, in) tensor of dX's dtype that dX is added into
    instead (in the scale pass on the grid-value route), returned as dX."""
    edy = _check(c["dgrad.dy"], "dgrad.dy", (1, 16))
    _check_branch(L1, branch_dtype)
    K, fp4_mma = qx.shape[1], use_dot_scaled(dy.device)  # the route of dX and dW alike
    amax_dy = amax_dyh = None
    if all(need) and hadamard is not None:  # one read of dY for both of its global amaxes
        amax_dy, amax_dyh = global_amax_pair(dy, hadamard, name="gradient dY")
    dx = dw = None
    if need[0] and fp4_mma:  # w_used: the packed Q16x16(W), read transposed
        dyq = Packed(*quantize(dy, (1, 16), edy.rounding, edy.four_over_six, seed=seed_dx,
                               global_amax=amax_dy, name="gradient dY"), dy.shape, (1, 16))
        qw = Packed(*w_used, (w_used[0].shape[0], K), (16, 16))
        if L1 is None:
            dx = nvfp4_gemm(dyq, qw, dy.dtype, trans_b=True)
        else:
            L1, L2 = L1.to(torch.bfloat16), L2.to(torch.bfloat16)
            dx = nvfp4_gemm(dyq, qw, torch.float32, trans_b=True)
            dx = (dx + beta * _branch(dy, L2.t(), L1.t())).to(dy.dtype)
        dx = dx if dx_dtype is None else dx.to(dx_dtype)
        dx = dx if dx_into is None else dx_into.add_(dx)
    elif need[0]:
        # [dY_hat | beta dY L2 / s_g] times Q16x16(W) reused, [W_hat ; L1] with a branch; L2 in
        # bf16 is the forward buffer's [W_hat | L2] columns
        r = 0 if L2 is None else L2.shape[1]
        abuf, s_g, _ = _operand(dy, edy.rounding, edy.four_over_six, seed_dx, "gradient dY", r,
                                global_amax=amax_dy)
        if L2 is not None:
            _branch_columns(abuf, dy, w_used[0][:dy.shape[1], K:].t(), beta, s_g, w_used[2])
        # the forward's W_hat (out, in), with a branch [W_hat ; L1] (out + r, in)
        dx = grid_values_mm(abuf, w_used[0][:, :K], s_g, w_used[2], dy.dtype, dx_dtype, dx_into)
    if need[1]:
        dw = wgrad(dy, qx, c, hadamard, seeds_dw, amax_dyh, dw_dtype, fp4_mma)
    return dx, dw


def wgrad(dy, qx, c, hadamard, seeds, dy_global_amax=None, out_dtype=torch.float32,
          fp4_mma=None):
    """Eq. 2, dW = Q(dY^T H) Q(H^T X_hat) (out, in), both operands quantized as stored, (T, out)
    and (T, in) with 16x1 blocks along T (c["wgrad.dy"], c["wgrad.x"]), and read transposed by the
    GEMM. X_hat = the packed qx dequantized in dY's dtype (the precision the activations had),
    decoded inside the 16x1 quantize pass and its amax pre-pass (never written as a tensor).
    hadamard: H, or None without a rotation; seeds: the two SR seeds (dY's, X_hat's);
    dy_global_amax: max |H^T dY| if the caller has it; fp4_mma: use_dot_scaled if it asked."""
    edy, ex = _check(c["wgrad.dy"], "wgrad.dy", (16, 1)), _check(c["wgrad.x"], "wgrad.x", (16, 1))
    if fp4_mma is None:
        fp4_mma = use_dot_scaled(dy.device)
    if fp4_mma:  # both packed as stored (T, .), 16x1, read transposed
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
