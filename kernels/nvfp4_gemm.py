"""
NVFP4 GEMM: out = a_hat @ b_hat^T for packed NVFP4 operands, logical a (M, K) and b (N, K),
both blocked along K: the "NT" GEMM of every linear layer (eqs. 1-2) and of Root's
Newton-Schulz (§3.4), as nvfp4.nvfp4_matmul computes it: products of E2M1 values and E4M3
block scales accumulated in fp32, the two global scales applied once at the end. Same numbers
as the reference up to fp32 summation order. An operand is anything with codes, scales,
global_scale, shape and block (nvfp4.NVFP4Tensor).

Transposed operands without copies: trans_a / trans_b say that the stored tensor is the
transpose of the logical operand, e.g. dX = dY W uses the forward's Q16x16(W) stored (out, in)
as the (N=in, K=out) operand.

The route is picked here, per GPU (use_dot_scaled, from kernels/targets.py's table):
  * Blackwell (capability 10.x and 12.x): every product on the NVFP4 tensor cores, in one kernel
    (_nvfp4_gemm_sm100_kernel): tl.dot_scaled with e2m1 operands and E4M3 block-16 scales,
    which lowers to tcgen05.mma kind::mxf4nvf4 on 10.x and mma.sync kind::mxf4nvf4 on 12.x, one
    scale per 16 elements (tiles per target: fp4_tile). That MMA reads FP4 operands K-major
    only, so an operand stored transposed has its nibbles re-packed along K in registers on the
    way (_k_major):
        forward   Q1x16(X) Q16x16(W)^T           both as stored
        dgrad     Q1x16(dY) Q16x16(W)            W's forward quantization, read transposed
        wgrad     Q16x1(H^T dY)^T Q16x1(H^T X)   both stored (T, .), blocked along T, read
                                                 transposed
        LoRA-SVD  the NVFP4 residual as forward and dgrad (its BF16 branch: a bf16 GEMM)
        Root NS   X X^T, A A, B X                1x16 operands, as stored
    tests/test_blackwell.py runs each in Triton's interpreter against the reference and
    compiles it for sm_100a; none has run on a Blackwell GPU (docs/blackwell.md).
  * Everything else (Hopper has no FP4 tensor cores): the grid values q * s_b as bf16 (exact:
    at most 6 significant bits), cuBLAS's bf16 GEMM with fp32 accumulation, then the global
    scales in one pass (packed operands save bytes only where tensor cores read FP4). The
    quantize kernels can write those grid values directly (nvfp4_quant.quantize_dequant);
    grid_values_mm multiplies them, and kernels/nvfp4_linear.py uses it so.
"""

import torch
import triton
import triton.language as tl

from kernels import targets
from kernels.nvfp4_dequant import grid_values_bf16
from kernels.nvfp4_math import _round_to_bf16

# --------------------------------------------------------------------------------------------
# Blackwell: native NVFP4 tensor cores through tl.dot_scaled


@triton.jit
def _k_major(t, R: tl.constexpr, BK: tl.constexpr):
    """(BK, R // 2) codes of a transposed operand as stored (two per byte along R, the even
    element low) -> (R, BK // 2), two per byte along K: the layout the FP4 MMA reads. (Giving
    dot_scaled the stored layout, lhs_k_pack / rhs_k_pack=False, fails: Triton 3.6 asserts
    "MMAv5 with kind=mxf4nvf4 does not support transpose", 3.9 falls back to a bf16 MMA.)"""
    u = tl.join(t & 0xF, t >> 4).reshape(BK, R)  # one code per byte, element r = 2 i + nibble
    lo, hi = tl.split(tl.trans(u).reshape(R, BK // 2, 2))
    return lo | (hi << 4)


@triton.jit
def _load_operand(codes, scales, r0, R, k0, K, stride_c0, stride_c1, stride_sr, stride_sk,
                  SB: tl.constexpr, TRANS: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):
    """The (BR, BK) tile at row r0, column k0 of a logical operand (R, K) blocked along K ->
    codes (BR, BK // 2) packed along K and E4M3 scales (BR, BK // 16), zeros outside. Codes
    are stored (R, K / 2), or with TRANS (K, R / 2); stride_sr / stride_sk step the scales
    along the logical rows / along K; SB logical rows share a scale (1 or 16)."""
    offs_r = r0 + tl.arange(0, BR)
    offs_ks = k0 // 16 + tl.arange(0, BK // 16)
    if TRANS:
        offs_k = k0 + tl.arange(0, BK)
        offs_rc = r0 // 2 + tl.arange(0, BR // 2)
        c = tl.load(codes + offs_k[:, None].to(tl.int64) * stride_c0 + offs_rc[None, :] * stride_c1,
                    mask=(offs_k[:, None] < K) & (offs_rc[None, :] < R // 2), other=0)
        c = _k_major(c, BR, BK)
    else:
        offs_kc = k0 // 2 + tl.arange(0, BK // 2)
        c = tl.load(codes + offs_r[:, None].to(tl.int64) * stride_c0 + offs_kc[None, :] * stride_c1,
                    mask=(offs_r[:, None] < R) & (offs_kc[None, :] < K // 2), other=0)
    s_rows = (offs_r[:, None] // SB).to(tl.int64) * stride_sr
    s = tl.load(scales + s_rows + offs_ks[None, :] * stride_sk,
                mask=(offs_r[:, None] < R) & (offs_ks[None, :] < K // 16), other=0.0)
    return c, s


@triton.jit
def _nvfp4_gemm_sm100_kernel(a_codes, a_scales, b_codes, b_scales, gs_a_ptr, gs_b_ptr, c_ptr,
                             M, N, K, stride_ac0, stride_ac1, stride_asr, stride_ask,
                             stride_bc0, stride_bc1, stride_bsr, stride_bsk, stride_cm, stride_cn,
                             A_SB: tl.constexpr, B_SB: tl.constexpr,
                             TRANS_A: tl.constexpr, TRANS_B: tl.constexpr,
                             OUT_BF16: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                             BK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """One (BM, BN) tile of a_hat b_hat^T: tl.dot_scaled over K in BK steps (masked: K need
    only be a multiple of 16), fp32 accumulation, the global scales once at the end. Plain
    row-major (not pre-swizzled) scales, as the quantize kernels write them."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BK), num_stages=NUM_STAGES):
        a, sa = _load_operand(a_codes, a_scales, pid_m * BM, M, kk * BK, K, stride_ac0,
                              stride_ac1, stride_asr, stride_ask, A_SB, TRANS_A, BM, BK)
        b, sb = _load_operand(b_codes, b_scales, pid_n * BN, N, kk * BK, K, stride_bc0,
                              stride_bc1, stride_bsr, stride_bsk, B_SB, TRANS_B, BN, BK)
        acc = tl.dot_scaled(a, sa, "e2m1", b.T, sb, "e2m1", acc)
    acc = acc * (tl.load(gs_a_ptr) * tl.load(gs_b_ptr))
    if OUT_BF16:
        acc = _round_to_bf16(acc)  # RNE (the interpreter's fp32 -> bf16 cast truncates)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def use_dot_scaled(device):
    """True on GPUs with NVFP4 tensor cores: the "fp4-mma" rows of kernels/targets.py (Blackwell,
    10.x and 12.x)."""
    return targets.of(device).route == "fp4-mma"


def fp4_tile(K, N, tiles):
    """(BM, BN, BK, NUM_STAGES) for targets.py's tile table `tiles`. "sm100": the block-scaled
    matmul tutorial's NVFP4 tile (128, 256, 256, 3), BK cut to 128 or 64 (the MMA's K step) for
    short K, BN to 128 for narrow outputs. "sm120" (12.x: mma.sync keeps the accumulator in
    registers, ~100 KB shared a block): (128, 128, 64, 3), which compiles without register spills
    where 128 x 256 x 256 spills (untuned: not run on a 12.x GPU)."""
    if tiles == "sm120":
        return 128, 128, 64, 3
    BK = 256 if K > 128 else 128 if K > 64 else 64
    return 128, 256 if N > 128 else 128, BK, 3


def _operand_strides(t, trans):
    """(codes' two strides, the scales' stride along the logical rows and along K, logical
    rows per scale) of a stored operand."""
    c0, c1 = t.codes.stride()
    s0, s1 = t.scales.stride()
    return (c0, c1, s1, s0, t.block[1]) if trans else (c0, c1, s0, s1, t.block[0])


def _gemm_sm100(a, b, out_dtype, trans_a=False, trans_b=False):
    """nvfp4_gemm's Blackwell route (operands checked): one launch of _nvfp4_gemm_sm100_kernel."""
    M, K = a.shape[::-1] if trans_a else a.shape
    N = b.shape[1] if trans_b else b.shape[0]
    out = torch.empty((M, N), device=a.codes.device, dtype=out_dtype)
    BM, BN, BK, stages = fp4_tile(K, N, targets.of(a.codes.device).tiles)
    *sa, a_sb = _operand_strides(a, trans_a)
    *sb, b_sb = _operand_strides(b, trans_b)
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _nvfp4_gemm_sm100_kernel[grid](a.codes, a.scales, b.codes, b.scales, a.global_scale,
                                   b.global_scale, out, M, N, K, *sa, *sb, *out.stride(),
                                   A_SB=a_sb, B_SB=b_sb, TRANS_A=trans_a, TRANS_B=trans_b,
                                   OUT_BF16=out_dtype == torch.bfloat16, BM=BM, BN=BN, BK=BK,
                                   NUM_STAGES=stages, num_warps=8)
    return out


# --------------------------------------------------------------------------------------------
# Hopper and the rest: bf16 grid values through cuBLAS


@triton.jit
def _scale_kernel(x_ptr, out_ptr, gs_a_ptr, gs_b_ptr, n, BLOCK: tl.constexpr,
                  ROUND_BF16: tl.constexpr, VEC: tl.constexpr, ACCUMULATE: tl.constexpr):
    """out = x * (s_ga * s_gb) for x bf16 or fp32 (the scales fp32 0-d tensors, their product
    rounded to fp32 as torch's s_ga * s_gb): the product in fp32, rounded once to x's dtype, as
    torch's x.mul_(s_ga * s_gb) computes it, then stored in out's dtype (x's, or fp32 for a bf16
    x: exact). ACCUMULATE: out += that value instead, the sum in fp32 rounded once to out's dtype
    (torch's out.add_(value), as autograd sums two gradients). torch's own kernel takes a slow,
    non-vectorized path for a 0-d CUDA operand of another dtype. VEC: elements a thread loads and
    stores at once (16 bytes of the wider dtype), so that loads and stores share one layout (no
    conversion through shared memory)."""
    offs = tl.max_contiguous(tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK), VEC)
    mask = offs < n
    v = tl.load(x_ptr + offs, mask=mask).to(tl.float32) * (tl.load(gs_a_ptr) * tl.load(gs_b_ptr))
    if ROUND_BF16:
        v = _round_to_bf16(v)  # exact in the interpreter too (its fp32 -> bf16 cast truncates)
    if ACCUMULATE:
        v += tl.load(out_ptr + offs, mask=mask).to(tl.float32)
        if out_ptr.dtype.element_ty == tl.bfloat16:
            v = _round_to_bf16(v)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


def scale_(x, gs_a, gs_b, out=None, accumulate=False):
    """x * (gs_a * gs_b) rounded to x's dtype, for a contiguous bf16/fp32 CUDA tensor x and fp32
    0-d tensors gs_a, gs_b (the two operands' global scales: no separate torch kernel for their
    product), written into out: x itself (in place), or a contiguous fp32 tensor of x's shape
    for a bf16 x (the bf16 values widened in the same pass, what x.to(torch.float32) would
    return after the in-place scaling, with one pass over x less). accumulate: added into out
    (contiguous, x's shape, x's dtype or fp32) instead, as out.add_(that value) would: the sum of
    the gradients of the layers sharing an input, without writing each and reading it back.
    Returns out."""
    out = x if out is None else out
    n, BLOCK = x.numel(), 4096
    # no fused multiply-add: the product is rounded before the sum, as torch's two ops round it
    _scale_kernel[(triton.cdiv(n, BLOCK),)](x, out, gs_a, gs_b, n, BLOCK=BLOCK,
                                            ROUND_BF16=x.dtype == torch.bfloat16,
                                            VEC=16 // max(x.element_size(), out.element_size()),
                                            ACCUMULATE=accumulate, num_warps=8,
                                            enable_fp_fusion=False)
    return out


@triton.jit
def _scale_into_kernel(x_ptr, out_ptr, gs_a_ptr, gs_b_ptr, beta, T, R, ld_out,
                       BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr):
    """out[t, c] = x[t, c] * beta / (s_ga * s_gb) for x (T, R) fp32 contiguous, out's rows ld_out
    apart: the two products and the quotient each rounded to fp32 (torch's x * beta / (s_ga *
    s_gb); tl.div_rn is IEEE's division), then one rounding to bf16, ties to even."""
    rows = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_R)
    mask = (rows[:, None] < T) & (cols[None, :] < R)
    x = tl.load(x_ptr + rows[:, None] * R + cols[None, :], mask=mask, other=0.0)
    v = tl.div_rn(x * beta, tl.load(gs_a_ptr) * tl.load(gs_b_ptr))
    tl.store(out_ptr + rows[:, None] * ld_out + cols[None, :],
             _round_to_bf16(v).to(tl.bfloat16), mask=mask)


def scale_into(out, x, beta, gs_a, gs_b):
    """out = x * beta / (gs_a * gs_b), rounded once to out's bf16: x (T, R) fp32 contiguous, out
    (T, R) bf16 with unit column stride and rows any fixed stride apart (LoRA-SVD's branch columns
    of the grid-value GEMM operand, nvfp4_linear._operand); gs_a, gs_b fp32 0-d. One launch for
    torch's four (the scales' product, the product, the quotient, the cast); returns out."""
    T, R = x.shape
    BLOCK_R = triton.next_power_of_2(R)
    BLOCK_T = max(1, 4096 // BLOCK_R)
    _scale_into_kernel[(triton.cdiv(T, BLOCK_T),)](x, out, gs_a, gs_b, beta, T, R, out.stride(0),
                                                  BLOCK_T=BLOCK_T, BLOCK_R=BLOCK_R,
                                                  enable_fp_fusion=False)
    return out


_MM_FP32_OUT = [True]  # torch.mm(..., out_dtype=torch.float32): bf16 on CUDA in recent torch


def mm_fp32(A, B):
    """A @ B with an fp32 result for bf16 CUDA operands (cuBLAS's fp32 accumulator, not rounded
    to bf16), or None where torch's mm has no out_dtype (older torch)."""
    if _MM_FP32_OUT[0]:
        try:
            return torch.mm(A, B, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _MM_FP32_OUT[0] = False
    return None


def grid_values_mm(A, B, gs_a, gs_b, out_dtype=torch.bfloat16, result_dtype=None, add_to=None):
    """(A @ B) * (gs_a * gs_b) for bf16 grid values A (M, K), B (K, N) (any strides) and the
    operands' global scales (fp32 0-d): the GEMM of the grid-value route, usable directly on
    nvfp4_quant.quantize_dequant's output. Rounded to out_dtype; result_dtype (fp32 for a bf16
    out_dtype): returned in that wider dtype, the same values (dX for an fp32 x, which the layer
    returns in x's dtype), converted in the scale pass rather than by a copy after it. add_to: a
    contiguous (M, N) tensor of the result's dtype that the result is added into, in the same
    pass (add_to.add_(result)'s bits), and returned."""
    result_dtype = out_dtype if result_dtype is None else result_dtype
    if A.device.type == "cpu":  # tests: the reference's fp32 accumulation
        out = (A.float() @ B.float()).mul_(gs_a * gs_b).to(out_dtype).to(result_dtype)
        return out if add_to is None else add_to.add_(out)
    if out_dtype == torch.float32:
        out = mm_fp32(A, B)  # the fp32 accumulator out, then the scales
        if out is not None:
            return scale_(out, gs_a, gs_b, out=add_to, accumulate=add_to is not None)
    # bf16 out of cuBLAS, then the global scales (one pass over the output, widening where asked):
    # one extra rounding (<= 1 ulp) vs the reference's single rounding of acc * s_g
    y = torch.mm(A, B)
    if out_dtype == torch.bfloat16:
        if add_to is not None:
            return scale_(y, gs_a, gs_b, out=add_to, accumulate=True)
        wide = result_dtype != out_dtype
        return scale_(y, gs_a, gs_b, out=torch.empty_like(y, dtype=result_dtype) if wide else None)
    y = y.float().mul_(gs_a * gs_b).to(out_dtype).to(result_dtype)
    return y if add_to is None else add_to.add_(y)


# --------------------------------------------------------------------------------------------
# The entry

def _k_dim(t, trans, name):
    """The contraction length of a stored operand, checking that its blocks run along K."""
    if t.codes.dim() != 2:
        raise ValueError(f"nvfp4_gemm: {name} must be 2-D (got shape {tuple(t.shape)}); "
                         "flatten leading dims")
    bm, bn = t.block
    if (bm if trans else bn) != 16:
        where = "transposed, K is its stored dim 0: block (16, 1) or (16, 16)" if trans else \
            "K is its last dim: block (1, 16) or (16, 16)"
        raise ValueError(f"nvfp4_gemm: {name} {tuple(t.shape)} must be blocked along K ({where}), "
                         f"got {t.block}")
    return t.shape[0] if trans else t.shape[1]


def nvfp4_gemm(a, b, out_dtype=torch.bfloat16, trans_a=False, trans_b=False):
    """a_hat @ b_hat^T (fp32 accumulation, global scales at the end) for packed NVFP4 operands.
    Logical a is (M, K) (stored (K, M) if trans_a), logical b is (N, K) (stored (K, N) if
    trans_b)."""
    Ka, Kb = _k_dim(a, trans_a, "a"), _k_dim(b, trans_b, "b")
    if Ka != Kb:
        raise ValueError(f"nvfp4_gemm: contraction dims differ: a {tuple(a.shape)} "
                         f"(trans_a={trans_a}) has K={Ka}, b {tuple(b.shape)} (trans_b={trans_b}) "
                         f"has K={Kb}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError("nvfp4_gemm: out_dtype must be float32, bfloat16 or float16, got "
                         f"{out_dtype}")
    if use_dot_scaled(a.codes.device):
        return _gemm_sm100(a, b, out_dtype, trans_a, trans_b)
    av, bv = grid_values_bf16(a), grid_values_bf16(b)                 # q * s_b, exact in bf16
    A = av.t() if trans_a else av                                     # (M, K) views, no copies
    B = bv if trans_b else bv.t()                                     # (K, N)
    return grid_values_mm(A, B, a.global_scale, b.global_scale, out_dtype)
