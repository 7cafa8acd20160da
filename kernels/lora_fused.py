"""
LoRA-SVD on the GPU (paper §3.2, App. 9): the low-rank branch of eq. 1 rides on the GEMMs the NVFP4
residual needs anyway, as r extra columns of one bf16 cuBLAS GEMM over the exact grid values:

    Y  = s_g (X_hat W_hat^T) + (beta X L1^T) L2^T = s_g ([X_hat | beta X L1^T / s_g] [W_hat | L2]^T)
    dX = s_g (dY_hat W_hat)  + (beta dY L2) L1    = s_g ([dY_hat | beta dY L2 / s_g] [W_hat ; L1])

with X_hat, W_hat the bf16 grid values q * s_b and s_g the product of the two global scales. The
quantize pass writes X_hat (and the packed X kept for eq. 2) straight into the left K columns of the
(T, K + r) operand (no concatenation: no second copy of an activation), a small GEMM the branch
columns beside it, W's one quantize pass W_hat into its own [W_hat | L2] buffer likewise (kept for
dX, as the direct layer keeps W's grid values: nvfp4_linear.py), and one GEMM with K + r columns
writes Y once, for ~r/K more FLOPs (docs/nvfp4_kernels.md measures the alternatives); dX's
[W_hat ; L1] copies the kept W_hat beside L1. eq. 2's dW is the direct layer's
(nvfp4_linear.wgrad): App. 8 takes the LoRA gradients from it later.

The branch is BF16 (lora_svd.BRANCH: bf16 operands, fp32 accumulation, beta x L^T / s_g rounded to
bf16 once); it equals the reference's branch up to where that intermediate is rounded.

On Blackwell the residual runs on the FP4 tensor cores instead (nvfp4_gemm's tl.dot_scaled
kernel, on the packed Q1x16(X) and Q16x16(W_res); dX reads W_res transposed) and the branch is
two bf16 GEMMs beside it, as the reference computes it (lora_svd._branch), added to the
residual's fp32 result.
"""

import torch

from kernels.nvfp4_gemm import grid_values_mm, mm_fp32, nvfp4_gemm, use_dot_scaled
from kernels.nvfp4_linear import Packed, _check, wgrad
from kernels.nvfp4_quant import global_amax_pair, quantize, quantize_dequant


def _operand(x, L, beta, rounding, four_over_six, seed, s_g_other, name, return_tensor=False,
             global_amax=None):
    """The left operand [X_hat | beta X L^T / (s_g s_g_other)] (T, K + r) in bf16, X's s_g and,
    with return_tensor, the packed Q1x16(X) (codes, scales) written by the same pass. X_hat is
    nvfp4_quant's quantization of X (the same codes and, for SR, the same Philox draws given the
    seed); the branch columns come from one cuBLAS GEMM with an fp32 result, scaled and rounded to
    bf16 once. global_amax: max |x| if known."""
    if x.dim() != 2 or L.dim() != 2 or L.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: need (T, K) and L (r, K), got {tuple(x.shape)} "
                         f"and {tuple(L.shape)}")
    (T, K), r = x.shape, L.shape[0]
    buf = torch.empty((T, K + r), device=x.device, dtype=torch.bfloat16)
    # X_hat into buf[:, :K] (rows K + r apart), the branch columns untouched
    _, s_g, *packed = quantize_dequant(x, (1, 16), rounding, four_over_six, seed=seed,
                                       global_amax=global_amax, return_tensor=return_tensor,
                                       name=name, out=buf[:, :K])
    a, b = x.to(L.dtype), L.t()
    xl = mm_fp32(a, b) if a.is_cuda and a.dtype == torch.bfloat16 else None
    xl = a.float() @ b.float() if xl is None else xl  # (T, r) fp32
    buf[:, K:] = xl * beta / (s_g * s_g_other)  # (T, r), rounded to bf16 once (RNE, as .to)
    return buf, s_g, packed


def _mm(a, b):
    """a @ b with an fp32 result: cuBLAS's fp32 accumulator for bf16 CUDA operands, else in fp32."""
    out = mm_fp32(a, b) if a.is_cuda else None
    return a.float() @ b.float() if out is None else out


def _branch(x, A, B):
    """Blackwell's branch (x A^T) B^T beside the FP4 residual: bf16 operands, fp32 accumulation,
    the rank-r intermediate rounded to bf16 once (lora_svd._branch). -> fp32."""
    return _mm(_mm(x.to(torch.bfloat16), A.t()).to(torch.bfloat16), B.t())


def _check_branch(dtype):
    if dtype != torch.bfloat16:
        raise ValueError(f"kernels/lora_fused: the fused branch runs in bf16 "
                         f"(lora_svd.BRANCH 'bf16'), got {dtype}")


def forward(x, w, L1, L2, beta, ex, ew, seeds, branch_dtype, out_dtype):
    """eq. 1's Y = Q1x16(X) Q16x16(W_res)^T + (beta X L1^T) L2^T. x (T, in), w = W_res (out, in),
    L1 (r, in), L2 (out, r); ex, ew: X's and W_res's contract entries (nvfp4.LINEAR's forward.x,
    forward.w), seeds their SR seeds. Returns (Y, Q1x16(X) as (codes, scales, global_scale) for
    eq. 2, W_res's quantization as dX reads it, three tensors on either route: ([W_hat | L2] bf16
    (out, in + r), an empty scales tensor, global scale), on Blackwell the packed Q16x16(W_res)
    (codes, scales, global scale))."""
    _check_branch(branch_dtype)
    ex, ew = _check(ex, "forward.x", (1, 16)), _check(ew, "forward.w", (16, 16))
    L1, L2 = L1.to(torch.bfloat16), L2.to(torch.bfloat16)
    if use_dot_scaled(x.device):  # the residual on the FP4 MMA, the bf16 branch beside it
        qw = Packed(*quantize(w, (16, 16), ew.rounding, ew.four_over_six, seeds[1],
                              name="weight W_res"), w.shape, (16, 16))
        xc, xs, s_gx = quantize(x, (1, 16), ex.rounding, ex.four_over_six, seeds[0],
                                name="activation X")
        y = nvfp4_gemm(Packed(xc, xs, s_gx, x.shape, (1, 16)), qw, torch.float32)
        return (y + beta * _branch(x, L1, L2)).to(out_dtype), (xc, xs, s_gx), qw[:3]
    # [W_hat | L2] (out, K + r): W_res's one quantize pass writes W_hat into its left columns
    (N, K), r = w.shape, L2.shape[1]
    wbuf = torch.empty((N, K + r), device=w.device, dtype=torch.bfloat16)
    _, s_gw = quantize_dequant(w, (16, 16), ew.rounding, ew.four_over_six, seeds[1],
                               name="weight W_res", out=wbuf[:, :K])
    wbuf[:, K:] = L2
    # [X_hat | beta X L1^T / s_g]
    abuf, s_gx, (xc, xs) = _operand(x, L1, beta, ex.rounding, ex.four_over_six, seeds[0], s_gw,
                                    "activation X", return_tensor=True)
    y = grid_values_mm(abuf, wbuf.t(), s_gx, s_gw, out_dtype)
    return y, (xc, xs, s_gx), (wbuf, wbuf.new_empty(0, dtype=torch.float8_e4m3fn), s_gw)


def backward(dy, qx, w_made, L1, L2, beta, c, need, seed_dx, hadamard, seeds_dw, branch_dtype):
    """eq. 1's dX = Q1x16(dY) Q16x16(W_res) + (beta dY L2) L1, reusing W_res as forward made it
    (w_made), and eq. 2's dW (fp32), each operand as the resolved contract c
    (nvfp4.linear_contract) says. need: (dX, dW) wanted; seed_dx, hadamard, seeds_dw: the draws
    (nvfp4.backward_draws). -> (dX in dY's dtype, dW)."""
    _check_branch(branch_dtype)
    edy = _check(c["dgrad.dy"], "dgrad.dy", (1, 16))
    L1, L2 = L1.to(torch.bfloat16), L2.to(torch.bfloat16)
    (r, K), s_gw = L1.shape, w_made[2]
    amax_dy = amax_dyh = None
    if all(need) and hadamard is not None:  # one read of dY for both of its global amaxes
        amax_dy, amax_dyh = global_amax_pair(dy, hadamard, name="gradient dY")
    dx = dw = None
    if need[0] and use_dot_scaled(dy.device):  # dY_hat W_res on the FP4 MMA (W_res read transposed)
        qw = Packed(*w_made, (w_made[0].shape[0], K), (16, 16))
        dc, ds, s_g = quantize(dy, (1, 16), edy.rounding, edy.four_over_six, seed=seed_dx,
                               global_amax=amax_dy, name="gradient dY")
        dx = nvfp4_gemm(Packed(dc, ds, s_g, dy.shape, (1, 16)), qw, torch.float32, trans_b=True)
        dx = (dx + beta * _branch(dy, L2.t(), L1.t())).to(dy.dtype)
    elif need[0]:
        # [dY_hat | beta dY L2 / s_g]
        abuf, s_g, _ = _operand(dy, L2.t(), beta, edy.rounding, edy.four_over_six, seed_dx,
                                s_gw, "gradient dY", global_amax=amax_dy)
        w_hat = w_made[0][:, :K]  # the forward's W_hat, beside L2
        wbuf = torch.empty((w_hat.shape[0] + r, K), device=dy.device, dtype=torch.bfloat16)
        wbuf[:w_hat.shape[0]], wbuf[w_hat.shape[0]:] = w_hat, L1  # (out + r, in) = [W_hat ; L1]
        dx = grid_values_mm(abuf, wbuf, s_g, s_gw, dy.dtype)
    if need[1]:
        dw = wgrad(dy, qx, c, hadamard, seeds_dw, amax_dyh)
    return dx, dw
