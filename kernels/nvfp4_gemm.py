"""
NVFP4 GEMM: out = a_hat @ b_hat^T for packed NVFP4Tensors a (M, K), b (N, K) blocked along K (the "NT" GEMM of
every linear layer, eqs. 1-2), as nvfp4.nvfp4_matmul computes it: products of E2M1 values and E4M3 block
scales accumulated in fp32, the two global scales applied once at the end. Same numbers as the reference up
to fp32 summation order.

Routes (DESIGN.md "Hardware facts"):
  * "triton" (Hopper and anything without FP4 tensor cores): load packed codes + E4M3 scales, dequantize in
    registers to fp16 (exact: q * s_b has at most 6 significant bits and lies in [2^-10, 2688]), tl.dot with
    fp32 accumulation, global scales in the epilogue. A quarter of bf16's operand bytes.
  * "cublas": a tiny kernel writes q * s_b as bf16 (exact), torch.mm (cuBLAS) multiplies, then the global
    scales. More bytes, but cuBLAS's bf16 GEMM is hard to beat on Hopper for big shapes.
  * Blackwell (capability 10.x): tl.dot_scaled with e2m1 operands and e4m3 scales, i.e. native NVFP4 tensor
    cores. UNTESTED: no Blackwell GPU was available; it sits behind a capability check and
    NANOFP4_DOT_SCALED=0 turns it off.
`pick_route` chooses per shape with a cached micro-benchmark; NANOFP4_GEMM_ROUTE=triton|cublas forces one.

Transposed operands without copies: trans_a / trans_b say that the stored tensor is the transpose of the
logical operand, e.g. dX = dY W uses the forward's Q16x16(W) stored (out, in) as the (N=in, K=out) operand:
nvfp4_gemm(dyq, wq, trans_b=True). A transposed operand must be blocked along its stored dim -2
((16, 1) or (16, 16)).
"""

import os

import torch
import triton
import triton.language as tl

from kernels.nvfp4_quant import _round_to_bf16, grid_values_bf16


# ----------------------------------------------------------------------------------------------------------
# Hopper / generic kernel: dequantize in registers, tl.dot

@triton.jit
def _dequant_tile(codes_ptr, scales_ptr, r0, k0, R, K, stride_c0, stride_c1, stride_sr, stride_sk,
                  BR: tl.constexpr, BK: tl.constexpr, SB: tl.constexpr, TRANS: tl.constexpr,
                  EVEN_K: tl.constexpr):
    """(BR, BK) fp16 tile of q * s_b of the logical operand (rows r0.., K k0..), zeros outside.
    TRANS=False: codes stored (R, K/2); TRANS=True: codes stored (K, R/2) (the logical operand's transpose).
    SB: logical rows per scale (1 or 16); the scale of (r, k) is scales[r // SB, k // 16] via the strides."""
    offs_r = r0 + tl.arange(0, BR)
    if TRANS:
        offs_k = k0 + tl.arange(0, BK)
        offs_rc = r0 // 2 + tl.arange(0, BR // 2)
        mask = (offs_k[:, None] < K) & (offs_rc[None, :] < R // 2)
        c = tl.load(codes_ptr + offs_k[:, None].to(tl.int64) * stride_c0 + offs_rc[None, :] * stride_c1,
                    mask=mask, other=0)
        code = tl.trans(tl.join(c & 0xF, c >> 4).reshape(BK, BR))                     # (BR, BK)
    else:
        offs_kc = k0 // 2 + tl.arange(0, BK // 2)
        if EVEN_K:
            mask = offs_r[:, None] < R
        else:
            mask = (offs_r[:, None] < R) & (offs_kc[None, :] < K // 2)
        c = tl.load(codes_ptr + offs_r[:, None].to(tl.int64) * stride_c0 + offs_kc[None, :] * stride_c1,
                    mask=mask, other=0)
        code = tl.join(c & 0xF, c >> 4).reshape(BR, BK)                                # even element low
    # E2M1 -> E4M3 bits: sign to bit 7, (exp, mantissa) to bits 4..2 is exactly q * 2^-6 (E2M1's subnormal 0.5
    # lands on E4M3's subnormal 2^-7); the fp8 -> fp16 conversion is one hardware cvt per two elements.
    q = (((code & 7) << 2) | ((code & 8) << 4)).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    offs_ks = k0 // 16 + tl.arange(0, BK // 16)
    smask = (offs_r[:, None] < R) & (offs_ks[None, :] < K // 16)
    s = tl.load(scales_ptr + (offs_r[:, None] // SB).to(tl.int64) * stride_sr + offs_ks[None, :] * stride_sk,
                mask=smask, other=0.0)
    s = s.to(tl.float16) * 64.0                                       # s_b * 2^6 <= 28672: exact in fp16
    v = q.reshape(BR, BK // 16, 16) * s[:, :, None]                   # q * s_b, exact in fp16
    return v.reshape(BR, BK)


@triton.jit
def _nvfp4_gemm_kernel(a_codes, a_scales, b_codes, b_scales, gs_a_ptr, gs_b_ptr, c_ptr, M, N, K: tl.constexpr,
                       stride_ac0, stride_ac1, stride_asr, stride_ask,
                       stride_bc0, stride_bc1, stride_bsr, stride_bsk, stride_cm, stride_cn,
                       A_TRANS: tl.constexpr, B_TRANS: tl.constexpr, A_SB: tl.constexpr, B_SB: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    # K is a constexpr: one compile per model width (a handful), full unrolling knowledge for the pipeliner, and
    # a loop bound the interpreter can iterate (Triton 3.6's interpreter cannot range() over a runtime int
    # under numpy >= 2.4).
    # grouped tile order so that GROUP_M row-tiles reuse the same B columns while they sit in L2
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BK), num_stages=NUM_STAGES):
        k0 = kk * BK
        a = _dequant_tile(a_codes, a_scales, pid_m * BM, k0, M, K, stride_ac0, stride_ac1, stride_asr, stride_ask,
                          BM, BK, A_SB, A_TRANS, EVEN_K)
        b = _dequant_tile(b_codes, b_scales, pid_n * BN, k0, N, K, stride_bc0, stride_bc1, stride_bsr, stride_bsk,
                          BN, BK, B_SB, B_TRANS, EVEN_K)
        acc = tl.dot(a, tl.trans(b), acc)                             # fp16 x fp16 -> fp32
    acc = acc * (tl.load(gs_a_ptr) * tl.load(gs_b_ptr))               # the reference's acc * (s_ga * s_gb)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# Hopper configs: 128-wide tiles for wgmma, 8 warps (two warpgroups) on the big tiles, 3-4 stages of
# cp.async prefetch (the packed operands are small: BK/2 bytes per row). Few configs: every one is a compile
# per (K, layout, out dtype), and the GPU check runs the benchmark under a 5-minute limit.
_CONFIGS = [
    triton.Config({"BM": 128, "BN": 256, "BK": 64, "GROUP_M": 8, "NUM_STAGES": 3}, num_warps=8),
    triton.Config({"BM": 128, "BN": 128, "BK": 128, "GROUP_M": 8, "NUM_STAGES": 3}, num_warps=8),
    triton.Config({"BM": 128, "BN": 128, "BK": 64, "GROUP_M": 8, "NUM_STAGES": 4}, num_warps=4),
]
# cache_results: the timings go to Triton's disk cache beside the binaries, so the runs after the first on a machine
# (an ablation queue) neither recompile nor re-time the losing configs
_nvfp4_gemm_autotuned = triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "A_TRANS", "B_TRANS", "EVEN_K"],
                                        cache_results=True)(_nvfp4_gemm_kernel)


# ----------------------------------------------------------------------------------------------------------
# Blackwell kernel: native NVFP4 tensor cores through tl.dot_scaled (UNTESTED here: no sm_100 GPU)

@triton.jit
def _nvfp4_gemm_sm100_kernel(a_codes, a_scales, b_codes, b_scales, gs_a_ptr, gs_b_ptr, c_ptr, M, N, K: tl.constexpr,
                             stride_ac0, stride_ac1, stride_asr, stride_ask,
                             stride_bc0, stride_bc1, stride_bsr, stride_bsk, stride_cm, stride_cn,
                             A_SB: tl.constexpr, B_SB: tl.constexpr,
                             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Like Triton's block-scaled matmul tutorial, with plain row-major (not pre-swizzled) scales and K-packed
    codes for both operands (non-transposed operands only). K must be a multiple of BK."""
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


# ----------------------------------------------------------------------------------------------------------
# Host side

def _operand(t, trans, name):
    """Logical (rows, K) view of a stored NVFP4Tensor: its strides, rows per scale, and shape checks."""
    if t.codes.dim() != 2:
        raise ValueError(f"nvfp4_gemm: {name} must be 2-D (got shape {tuple(t.shape)}); flatten leading dims")
    R0, C0 = t.shape
    bm, bn = t.block
    if not trans:
        if bn != 16:
            raise ValueError(f"nvfp4_gemm: {name} {tuple(t.shape)} must be blocked along K (its last dim): "
                             f"block (1, 16) or (16, 16), got {t.block}")
        return R0, C0, t.codes.stride(0), t.codes.stride(1), t.scales.stride(0), t.scales.stride(1), bm
    if bm != 16:
        raise ValueError(f"nvfp4_gemm: transposed {name} {tuple(t.shape)} must be blocked along K (its stored "
                         f"dim 0): block (16, 1) or (16, 16), got {t.block}")
    # logical rows = stored columns; the scale of logical (r, k) is scales[k // 16, r // bn]
    return C0, R0, t.codes.stride(0), t.codes.stride(1), t.scales.stride(1), t.scales.stride(0), bn


def _use_dot_scaled(device):
    if os.environ.get("NANOFP4_DOT_SCALED", "1") == "0" or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] == 10


def _gemm_triton(a, b, trans_a, trans_b, out_dtype, config=None):
    M, K, sac0, sac1, sasr, sask, a_sb = _operand(a, trans_a, "a")
    N, Kb, sbc0, sbc1, sbsr, sbsk, b_sb = _operand(b, trans_b, "b")
    out = torch.empty((M, N), device=a.codes.device, dtype=out_dtype)
    args = (a.codes, a.scales, b.codes, b.scales, a.global_scale, b.global_scale, out, M, N, K,
            sac0, sac1, sasr, sask, sbc0, sbc1, sbsr, sbsk, out.stride(0), out.stride(1))
    if not trans_a and not trans_b and K % 256 == 0 and _use_dot_scaled(out.device):
        grid = (triton.cdiv(M, 128), triton.cdiv(N, 256))
        _nvfp4_gemm_sm100_kernel[grid](*args, A_SB=a_sb, B_SB=b_sb, BM=128, BN=256, BK=256, NUM_STAGES=3,
                                       num_warps=8)
        return out
    flags = dict(A_TRANS=trans_a, B_TRANS=trans_b, A_SB=a_sb, B_SB=b_sb)
    if config is not None or out.device.type != "cuda":  # the interpreter: one small config, no autotuning
        cfg = config or dict(BM=32, BN=32, BK=64, GROUP_M=4, NUM_STAGES=1, num_warps=4)
        warps = cfg.get("num_warps", 4)
        cfg = {k: v for k, v in cfg.items() if k != "num_warps"}
        grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
        _nvfp4_gemm_kernel[grid](*args, **flags, EVEN_K=K % cfg["BK"] == 0, **cfg, num_warps=warps)
        return out
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)
    _nvfp4_gemm_autotuned[grid](*args, **flags, EVEN_K=K % 128 == 0)
    return out


_MM_FP32_OUT = [True]  # torch.mm(..., out_dtype=torch.float32) exists for bf16 on CUDA in recent torch


@triton.jit
def _scale_kernel(x_ptr, gs_a_ptr, gs_b_ptr, n, BLOCK: tl.constexpr, OUT_BF16: tl.constexpr):
    """x *= s_ga * s_gb in place (x bf16 or fp32; the scales fp32 0-d tensors, their product rounded to fp32 as
    torch's s_ga * s_gb): the product in fp32, rounded once to x's dtype, as torch's x.mul_(s_ga * s_gb)
    computes it. torch's own kernel takes a non-vectorized path for a 0-d CUDA operand of another dtype: 256 us
    for a 16384 x 4096 bf16 output on the H200, ~4x a copy."""
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


def _gemm_cublas(a, b, trans_a, trans_b, out_dtype):
    _operand(a, trans_a, "a"), _operand(b, trans_b, "b")
    av, bv = grid_values_bf16(a), grid_values_bf16(b)                 # q * s_b, exact in bf16
    A = av.t() if trans_a else av                                     # (M, K) views, no copies
    B = bv if trans_b else bv.t()                                     # (K, N)
    return grid_values_mm(A, B, a.global_scale, b.global_scale, out_dtype)


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
    scales (fp32 0-d): the cuBLAS route's GEMM, usable directly on kernels.nvfp4_quant.quantize_dequant's output."""
    if A.device.type == "cpu":  # tests: same fp32 accumulation as the reference
        return (A.float() @ B.float()).mul_(gs_a * gs_b).to(out_dtype)
    if out_dtype == torch.float32:
        out = mm_fp32(A, B)  # the fp32 accumulator out, then the scales
        if out is not None:
            return scale_(out, gs_a, gs_b)
    # bf16 out of cuBLAS, then the global scales in place (one pass over the output): one extra rounding
    # (<= 1 ulp) vs the reference's single rounding of acc * s_g
    out = torch.mm(A, B)
    return scale_(out, gs_a, gs_b) if out_dtype == torch.bfloat16 else out.float().mul_(gs_a * gs_b).to(out_dtype)


_ROUTES = {}


def pick_route(a, b, trans_a=False, trans_b=False, out_dtype=torch.bfloat16):
    """'triton' or 'cublas' for this GEMM on this GPU: NANOFP4_GEMM_ROUTE if set, else a micro-benchmark of
    both routes on these operands, run once per (M, N, K, transposes, blocks, out dtype, device) and cached."""
    forced = os.environ.get("NANOFP4_GEMM_ROUTE", "auto")
    if forced in ("triton", "cublas"):
        return forced
    if a.codes.device.type != "cuda":
        return "triton"
    M, K = _operand(a, trans_a, "a")[:2]
    N = _operand(b, trans_b, "b")[0]
    key = (M, N, K, trans_a, trans_b, a.block, b.block, out_dtype, a.codes.device.index)
    if key not in _ROUTES:
        from triton.testing import do_bench
        t_triton = do_bench(lambda: _gemm_triton(a, b, trans_a, trans_b, out_dtype), warmup=5, rep=20)
        t_cublas = do_bench(lambda: _gemm_cublas(a, b, trans_a, trans_b, out_dtype), warmup=5, rep=20)
        _ROUTES[key] = "triton" if t_triton <= t_cublas else "cublas"
    return _ROUTES[key]


def nvfp4_gemm(a, b, out_dtype=torch.bfloat16, trans_a=False, trans_b=False, route=None):
    """a_hat @ b_hat^T (fp32 accumulation, global scales at the end) for NVFP4Tensors. Logical a is (M, K)
    (stored (K, M) if trans_a), logical b is (N, K) (stored (K, N) if trans_b); leading dims of a are folded
    into M. route: None (pick_route), 'triton' or 'cublas'."""
    lead = ()
    if a.codes.dim() > 2 and not trans_a and b.codes.dim() == 2:
        import nvfp4
        lead, K = a.shape[:-2], a.shape[-1]
        bm, bn = a.block
        a = nvfp4.NVFP4Tensor(a.codes.reshape(-1, K // 2), a.scales.reshape(-1, K // bn), a.global_scale,
                              (a.shape[:-1].numel(), K), a.block)
    Ka = a.shape[-2] if trans_a else a.shape[-1]
    Kb = b.shape[-2] if trans_b else b.shape[-1]
    if Ka != Kb:
        raise ValueError(f"nvfp4_gemm: contraction dims differ: a {tuple(a.shape)} (trans_a={trans_a}) has "
                         f"K={Ka}, b {tuple(b.shape)} (trans_b={trans_b}) has K={Kb}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"nvfp4_gemm: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    route = route or pick_route(a, b, trans_a, trans_b, out_dtype)
    if route == "cublas":
        out = _gemm_cublas(a, b, trans_a, trans_b, out_dtype)
    elif route == "triton":
        out = _gemm_triton(a, b, trans_a, trans_b, out_dtype)
    else:
        raise ValueError(f"nvfp4_gemm: route must be 'triton' or 'cublas', got {route!r}")
    return out.reshape(*lead, -1, out.shape[-1]) if lead else out
