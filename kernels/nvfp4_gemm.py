"""
NVFP4 GEMM: out = a_hat @ b_hat^T for packed NVFP4 operands a (M, K), b (N, K) blocked along K (the "NT" GEMM of
every linear layer, eqs. 1-2), as nvfp4.nvfp4_matmul computes it: products of E2M1 values and E4M3 block scales
accumulated in fp32, the two global scales applied once at the end. Same numbers as the reference up to fp32
summation order. An operand is anything with codes, scales, global_scale, shape and block (nvfp4.NVFP4Tensor).

The route is picked here, per GPU:
  * Blackwell (capability 10.x): tl.dot_scaled with e2m1 operands and e4m3 block-16 scales, the native NVFP4
    tensor-core MMA (tests/test_blackwell.py checks that it lowers to it for sm_100a). Its numerics are untested:
    no Blackwell GPU was available.
  * Everything else (Hopper has no FP4 tensor cores): the grid values q * s_b as bf16 (exact: at most 6
    significant bits), cuBLAS's bf16 GEMM with fp32 accumulation, then the global scales in one pass. Decoding
    packed operands in registers before tl.dot was slower: the byte saving pays only where tensor cores read FP4.
    The quantize kernels can write those grid values directly (nvfp4_quant.quantize_dequant); grid_values_mm
    multiplies them, and kernels/nvfp4_linear.py uses it so.

Transposed operands without copies: trans_a / trans_b say that the stored tensor is the transpose of the logical
operand, e.g. dX = dY W uses the forward's Q16x16(W) stored (out, in) as the (N=in, K=out) operand.
"""

import torch
import triton
import triton.language as tl

from kernels.nvfp4_quant import _round_to_bf16, grid_values_bf16


# ----------------------------------------------------------------------------------------------------------
# Blackwell: native NVFP4 tensor cores through tl.dot_scaled

@triton.jit
def _nvfp4_gemm_sm100_kernel(a_codes, a_scales, b_codes, b_scales, gs_a_ptr, gs_b_ptr, c_ptr, M, N, K: tl.constexpr,
                             stride_ac0, stride_ac1, stride_asr, stride_ask,
                             stride_bc0, stride_bc1, stride_bsr, stride_bsk, stride_cm, stride_cn,
                             A_SB: tl.constexpr, B_SB: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Like Triton's block-scaled matmul tutorial, with plain row-major (not pre-swizzled) scales and K-packed
    codes for both operands (non-transposed operands only). K must be a multiple of BK. A_SB / B_SB: logical rows
    per scale row (1 for 1x16 blocks, 16 for 16x16)."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BK), num_stages=NUM_STAGES):
        k0 = kk * BK
        offs_kc = k0 // 2 + tl.arange(0, BK // 2)
        offs_ks = k0 // 16 + tl.arange(0, BK // 16)
        a = tl.load(a_codes + offs_m[:, None].to(tl.int64) * stride_ac0 + offs_kc[None, :] * stride_ac1,
                    mask=offs_m[:, None] < M, other=0)
        b = tl.load(b_codes + offs_n[:, None].to(tl.int64) * stride_bc0 + offs_kc[None, :] * stride_bc1,
                    mask=offs_n[:, None] < N, other=0)
        sa = tl.load(a_scales + (offs_m[:, None] // A_SB) * stride_asr + offs_ks[None, :] * stride_ask,
                     mask=offs_m[:, None] < M, other=0.0)
        sb = tl.load(b_scales + (offs_n[:, None] // B_SB) * stride_bsr + offs_ks[None, :] * stride_bsk,
                     mask=offs_n[:, None] < N, other=0.0)
        acc = tl.dot_scaled(a, sa, "e2m1", b.T, sb, "e2m1", acc)
    acc = acc * (tl.load(gs_a_ptr) * tl.load(gs_b_ptr))
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


SM100_TILE = dict(BM=128, BN=256, BK=256, NUM_STAGES=3)  # the block-scaled matmul tutorial's tile for NVFP4


def use_dot_scaled(device):
    """True on GPUs with NVFP4 tensor cores (Blackwell, sm_100)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 10


def _gemm_sm100(a, b, out_dtype):
    M, K = a.shape
    N = b.shape[0]
    out = torch.empty((M, N), device=a.codes.device, dtype=out_dtype)
    grid = (triton.cdiv(M, SM100_TILE["BM"]), triton.cdiv(N, SM100_TILE["BN"]))
    _nvfp4_gemm_sm100_kernel[grid](a.codes, a.scales, b.codes, b.scales, a.global_scale, b.global_scale, out, M, N, K,
                                   a.codes.stride(0), a.codes.stride(1), a.scales.stride(0), a.scales.stride(1),
                                   b.codes.stride(0), b.codes.stride(1), b.scales.stride(0), b.scales.stride(1),
                                   out.stride(0), out.stride(1), A_SB=a.block[0], B_SB=b.block[0], **SM100_TILE,
                                   num_warps=8)
    return out


# ----------------------------------------------------------------------------------------------------------
# Hopper and the rest: bf16 grid values through cuBLAS

@triton.jit
def _scale_kernel(x_ptr, gs_a_ptr, gs_b_ptr, n, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    """x *= s_ga * s_gb in place (x bf16 or fp32; the scales fp32 0-d tensors, their product rounded to fp32 as
    torch's s_ga * s_gb): the product in fp32, rounded once to x's dtype, as torch's x.mul_(s_ga * s_gb) computes
    it. torch's own kernel takes a slow, non-vectorized path for a 0-d CUDA operand of another dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * (tl.load(gs_a_ptr) * tl.load(gs_b_ptr))
    if OUT_BF16:
        v = _round_to_bf16(v)  # exact in the interpreter too (its fp32 -> bf16 cast truncates)
    tl.store(x_ptr + offs, v.to(x_ptr.dtype.element_ty), mask=mask)


def scale_(x, gs_a, gs_b):
    """x *= gs_a * gs_b in place for a contiguous bf16/fp32 CUDA tensor x and fp32 0-d tensors gs_a, gs_b (the
    two operands' global scales: no separate torch kernel for their product); returns x."""
    n, BLOCK = x.numel(), 4096
    _scale_kernel[(triton.cdiv(n, BLOCK),)](x, gs_a, gs_b, n, BLOCK=BLOCK, OUT_BF16=x.dtype == torch.bfloat16,
                                            num_warps=8)
    return x


_MM_FP32_OUT = [True]  # torch.mm(..., out_dtype=torch.float32) exists for bf16 on CUDA in recent torch


def mm_fp32(A, B):
    """A @ B with an fp32 result for bf16 CUDA operands (cuBLAS's fp32 accumulator, not rounded to bf16), or None
    where torch's mm has no out_dtype (older torch)."""
    if _MM_FP32_OUT[0]:
        try:
            return torch.mm(A, B, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _MM_FP32_OUT[0] = False
    return None


def grid_values_mm(A, B, gs_a, gs_b, out_dtype=torch.bfloat16):
    """(A @ B) * (gs_a * gs_b) for bf16 grid values A (M, K), B (K, N) (any strides) and the operands' global
    scales (fp32 0-d): the GEMM of the grid-value route, usable directly on nvfp4_quant.quantize_dequant's output."""
    if A.device.type == "cpu":  # tests: the reference's fp32 accumulation
        return (A.float() @ B.float()).mul_(gs_a * gs_b).to(out_dtype)
    if out_dtype == torch.float32:
        out = mm_fp32(A, B)  # the fp32 accumulator out, then the scales
        if out is not None:
            return scale_(out, gs_a, gs_b)
    # bf16 out of cuBLAS, then the global scales in place (one pass over the output): one extra rounding
    # (<= 1 ulp) vs the reference's single rounding of acc * s_g
    out = torch.mm(A, B)
    return scale_(out, gs_a, gs_b) if out_dtype == torch.bfloat16 else out.float().mul_(gs_a * gs_b).to(out_dtype)


# ----------------------------------------------------------------------------------------------------------
# The entry

def _k_dim(t, trans, name):
    """The contraction length of a stored operand, checking that its blocks run along K."""
    if t.codes.dim() != 2:
        raise ValueError(f"nvfp4_gemm: {name} must be 2-D (got shape {tuple(t.shape)}); flatten leading dims")
    bm, bn = t.block
    if (bm if trans else bn) != 16:
        where = "transposed, K is its stored dim 0: block (16, 1) or (16, 16)" if trans else \
            "K is its last dim: block (1, 16) or (16, 16)"
        raise ValueError(f"nvfp4_gemm: {name} {tuple(t.shape)} must be blocked along K ({where}), got {t.block}")
    return t.shape[0] if trans else t.shape[1]


def nvfp4_gemm(a, b, out_dtype=torch.bfloat16, trans_a=False, trans_b=False):
    """a_hat @ b_hat^T (fp32 accumulation, global scales at the end) for packed NVFP4 operands. Logical a is
    (M, K) (stored (K, M) if trans_a), logical b is (N, K) (stored (K, N) if trans_b)."""
    Ka, Kb = _k_dim(a, trans_a, "a"), _k_dim(b, trans_b, "b")
    if Ka != Kb:
        raise ValueError(f"nvfp4_gemm: contraction dims differ: a {tuple(a.shape)} (trans_a={trans_a}) has "
                         f"K={Ka}, b {tuple(b.shape)} (trans_b={trans_b}) has K={Kb}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_gemm: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if not trans_a and not trans_b and Ka % SM100_TILE["BK"] == 0 and use_dot_scaled(a.codes.device):
        return _gemm_sm100(a, b, out_dtype)
    av, bv = grid_values_bf16(a), grid_values_bf16(b)                 # q * s_b, exact in bf16
    A = av.t() if trans_a else av                                     # (M, K) views, no copies
    B = bv if trans_b else bv.t()                                     # (K, N)
    return grid_values_mm(A, B, a.global_scale, b.global_scale, out_dtype)
