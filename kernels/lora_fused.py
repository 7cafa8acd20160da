"""
LoRA-SVD on the GPU (paper §3.2, App. 9): the low-rank branch of eq. 1 rides on the GEMMs the NVFP4 residual
needs anyway, as r extra columns of one bf16 cuBLAS GEMM over the exact grid values:

    Y  = s_g (X_hat W_hat^T) + (beta X L1^T) L2^T = s_g ([X_hat | beta X L1^T / s_g] [W_hat | L2]^T)
    dX = s_g (dY_hat W_hat)  + (beta dY L2) L1    = s_g ([dY_hat | beta dY L2 / s_g] [W_hat ; L1])

with X_hat, W_hat the bf16 grid values q * s_b and s_g the product of the two global scales. The quantize pass
writes X_hat (and the packed X kept for eq. 2), a small GEMM the branch columns beside it, and one GEMM with
K + r columns writes Y once, for ~r/K more FLOPs. (A Triton kernel that quantized X and down-projected it in one
read, and a GEMM whose epilogue added the up-projection, were slower on Hopper: docs/nvfp4_kernels.md.)
eq. 2's dW is the direct layer's (nvfp4_linear.wgrad): App. 8 takes the LoRA gradients from it later.

The branch is BF16 on the GPU (bf16 operands, fp32 accumulation, beta x L^T / s_g rounded to bf16 once) and
fp32 on the CPU; it equals the unfused torch branch up to those roundings.
"""

import torch

from kernels.nvfp4_gemm import grid_values_mm, mm_fp32
from kernels.nvfp4_linear import wgrad
from kernels.nvfp4_quant import global_amax_pair, grid_values_bf16, quantize_dequant


def _operand(x, L, beta, rounding, four_over_six, seed, s_g_other, name, return_tensor=False, global_amax=None):
    """The left operand [X_hat | beta X L^T / (s_g s_g_other)] (T, K + r) in bf16, X's s_g and, with
    return_tensor, the packed Q1x16(X) (codes, scales) written by the same pass. X_hat is nvfp4_quant's
    quantization of X (the same codes and, for SR, the same Philox draws given the seed); the branch columns come
    from one cuBLAS GEMM with an fp32 result, scaled and rounded to bf16 once. global_amax: max |x| if known."""
    if x.dim() != 2 or L.dim() != 2 or L.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: need (T, K) and L (r, K), got {tuple(x.shape)} and {tuple(L.shape)}")
    xv, s_g, *packed = quantize_dequant(x, (1, 16), rounding, four_over_six, seed=seed, global_amax=global_amax,
                                        return_tensor=return_tensor, name=name)
    a, b = x.to(L.dtype), L.t()
    xl = mm_fp32(a, b) if a.is_cuda and a.dtype == torch.bfloat16 else None
    xl = a.float() @ b.float() if xl is None else xl  # (T, r) fp32
    branch = (xl * beta / (s_g * s_g_other)).to(torch.bfloat16)  # (T, r)
    return torch.cat((xv, branch), dim=1), s_g, packed


def forward(x, qw, L1, L2, beta, four_over_six, out_dtype):
    """eq. 1's Y = Q1x16(X) Q16x16(W_res)^T + (beta X L1^T) L2^T. x (T, in); qw the packed Q16x16(W_res)
    (out, in) (an nvfp4.NVFP4Tensor); L1 (r, in), L2 (out, r) in the branch dtype.
    Returns (Y, Q1x16(X) as (codes, scales, global_scale) for eq. 2)."""
    abuf, s_gx, (xc, xs) = _operand(x, L1, beta, "rtn", four_over_six, 0, qw.global_scale, "activation X",
                                    return_tensor=True)                   # [X_hat | beta X L1^T / s_g]
    wbuf = torch.cat((grid_values_bf16(qw), L2.to(torch.bfloat16)), dim=1)  # (out, K + r) = [W_hat | L2]
    return grid_values_mm(abuf, wbuf.t(), s_gx, qw.global_scale, out_dtype), (xc, xs, s_gx)


def backward(dy, xq, qw, L1, L2, beta, four_over_six, seed_dx, hadamard, seeds_dw, rounding="sr"):
    """eq. 1's dX = Q1x16(dY, SR) Q16x16(W_res) + (beta dY L2) L1, reusing the forward's packed qw, and eq. 2's
    dW (fp32). seed_dx: dX's SR seed, None when dX is not needed; hadamard, seeds_dw: eq. 2's H and SR seeds,
    None when dW is not needed (nvfp4.backward_draws); rounding: "sr" or "sr_up". -> (dX in dY's dtype, dW)."""
    amax_dy = amax_dyh = None
    if seed_dx is not None and hadamard is not None:  # one read of dY for both of its global amaxes
        amax_dy, amax_dyh = global_amax_pair(dy, hadamard, name="gradient dY")
    dx = dw = None
    if seed_dx is not None:
        abuf, s_g, _ = _operand(dy, L2.t(), beta, rounding, four_over_six, seed_dx, qw.global_scale, "gradient dY",
                                global_amax=amax_dy)                      # [dY_hat | beta dY L2 / s_g]
        wbuf = torch.cat((grid_values_bf16(qw), L1.to(torch.bfloat16)), dim=0)  # (out + r, in) = [W_hat ; L1]
        dx = grid_values_mm(abuf, wbuf, s_g, qw.global_scale, dy.dtype)
    if hadamard is not None:
        dw = wgrad(dy, xq, four_over_six, hadamard, seeds_dw, amax_dyh, rounding=rounding)
    return dx, dw
