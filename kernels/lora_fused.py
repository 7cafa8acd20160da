"""
LoRA-SVD kernel fusion (paper App. 9, after SVDQuant's Nunchaku engine): the low-rank branch of eq. 1 rides
on the two kernels the NVFP4 residual needs anyway, so it adds no pass over the big tensors.

  quantize_down_proj(x, L, beta)   one read of x (T, K): packed Q1x16(x) (codes + E4M3 scales, exactly
                                   kernels/nvfp4_quant.py's numbers) AND the down-projection beta * x L^T (T, r)
  nvfp4_matmul_up_proj(a, b, xl, L)  the NVFP4 GEMM a_hat b_hat^T whose epilogue adds xl L^T before the one
                                   write of the output (the up-projection; xl already carries beta)
  cuBLAS route (the default on CUDA): nvfp4_quant's quantize pass writes the bf16 grid values, one small
                                   GEMM the branch columns beta x L^T / s_g beside them, and one GEMM with K + r
                                   columns adds the branch to the output (two reads of x instead of one: the
                                   fused quantize kernel was slower than quantize + down-projection unfused)
  lora_forward / lora_dx           what lora_svd.py calls: eq. 1's Y and dX on the faster route (timed once)

Forward: Y = Q(X) Q(W_res)^T + (beta X L1^T) L2^T  ->  quantize_down_proj(X, L1), nvfp4_matmul_up_proj(.., L2)
dX:      dX = Q(dY) Q(W_res) + (beta dY L2) L1      ->  quantize_down_proj(dY, L2^T, SR), (.., L1^T, trans_b)
The global amax of x is still a separate read (as in kernels/nvfp4_quant.py): per-tensor scaling needs it first.

The quantize arithmetic reuses nvfp4_quant's @triton.jit helpers (E4M3 rounding, RTN, SR, E2M1 values, tile
load), the GEMM reuses nvfp4_gemm's in-register dequantization and its Hopper configs. Codes and scales are
bit-identical to nvfp4_quant.quantize (RTN, and SR given the seed: same Philox counters). The branch is BF16
on the GPU (bf16 operands, fp32 accumulation, beta * x L^T rounded to bf16 once) and fp32 in the interpreter,
whose bf16 tl.dot is wrong in Triton 3.6; it equals the unfused torch branch up to those roundings.
"""

import os

import torch
import triton
import triton.language as tl

from kernels.nvfp4_gemm import _CONFIGS, _dequant_tile, _operand, grid_values_mm, mm_fp32
from kernels.nvfp4_quant import (_block_scale, _div_by, _e2m1_value, _exact_fma, _load_tile, _pairwise_block_sum,
                                 _rtn_e2m1, _sr_e2m1, _random_words, grid_values_bf16, quantize_dequant)


# ----------------------------------------------------------------------------------------------------------
# quantize + down-projection

@triton.jit
def _scale_candidate(xb, block_amax, s_g, FP4_MAX: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr,
                     EXACT_FMA: tl.constexpr):
    """E4M3 bits of the block scale s_b with the block max mapped to FP4_MAX (6, or 4 for 4/6's second
    candidate), the scaled magnitudes a = min(|x| / (s_b s_g), 6), their RTN indices and the blocks' RTN squared
    errors, rounded exactly as nvfp4_quant._quantize_kernel does (one reciprocal per block + Markstein's fma step
    per element: the correctly rounded quotient)."""
    s, bits, den, inv = _block_scale(block_amax, s_g, FP4_MAX, EXACT_FMA)
    den, inv = den[:, None, :, None], inv[:, None, :, None]
    a = tl.minimum(_div_by(xb, den, inv, EXACT_FMA), 6.0)
    idx = _rtn_e2m1(a)
    err = _e2m1_value(idx) * den - xb  # RTN reconstruction error, for the 4/6 choice
    return bits, a, idx, _pairwise_block_sum(err * err, BM, 1, NB, 16)  # (BM, NB): nvfp4's fixed summation order


@triton.jit(do_not_specialize=["seed"])  # a fresh SR seed per call must not recompile
def _quantize_down_proj_kernel(x_ptr, l_ptr, amax_ptr, codes_ptr, scales_ptr, xl_ptr,
                               M, R, beta, seed, stride_xm, stride_xn, stride_lr, stride_ln, stride_xlm,
                               N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr,
                               FP8_BOUND: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, SR: tl.constexpr,
                               DOT_FP32: tl.constexpr, EXACT_FMA: tl.constexpr, NUM_STAGES: tl.constexpr):
    """A strip of BM rows: for each (BM, BN) tile, the 1x16 NVFP4 codes + scales and x_tile L_tile^T
    accumulated into the (BM, r) down-projection in registers (deterministic: no atomics across column tiles);
    the strip then stores beta * x L^T. N is a constexpr: the interpreter cannot range() over a runtime int."""
    pid_m, pid_b = tl.program_id(0), tl.program_id(1)  # pid_b is 0: the grid has one batch
    m0 = pid_m * BM
    amax = tl.load(amax_ptr)
    s_g = tl.where(amax > 0, tl.div_rn(amax, FP8_BOUND * 6.0), 1.0)
    offs_r = tl.arange(0, BR)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for n0 in tl.range(0, N, BN, num_stages=NUM_STAGES):
        x, offs_m, offs_n, mask = _load_tile(x_ptr, x_ptr, pid_b, m0, n0, M, N, 0, stride_xm, stride_xn,
                                             BM, BN, 0)
        xb = tl.abs(x).reshape(BM, 1, BN // 16, 16)
        block_amax = tl.max(tl.max(xb, axis=3), axis=1)  # (BM, BN // 16)
        bits, a, idx, err6 = _scale_candidate(xb, block_amax, s_g, 6.0, BM, BN // 16, EXACT_FMA)
        if FOUR_OVER_SIX:  # keep the lower-error candidate per block, ties to 6
            bits4, a4, idx4, err4 = _scale_candidate(xb, block_amax, s_g, 4.0, BM, BN // 16, EXACT_FMA)
            use4 = err4 < err6
            bits = tl.where(use4, bits4, bits)
            a = tl.where(use4[:, None, :, None], a4, a)
            idx = tl.where(use4[:, None, :, None], idx4, idx)  # the RTN indices, already computed
        if SR:  # the same counter-based draws as nvfp4_quant (its _random_words: Philox keyed by element index)
            rand = _random_words(seed, offs_m, n0, N, BM, BN)
            idx = _sr_e2m1(a, rand.reshape(BM, 1, BN // 16, 16))
        code = (idx.reshape(BM, BN) | ((x < 0).to(tl.int32) << 3)).to(tl.uint8)
        lo, hi = tl.split(code.reshape(BM, BN // 2, 2))  # even element in the low nibble
        offs_c = n0 // 2 + tl.arange(0, BN // 2)
        tl.store(codes_ptr + offs_m[:, None].to(tl.int64) * (N // 2) + offs_c[None, :], lo | (hi << 4),
                 mask=(offs_m[:, None] < M) & (offs_c[None, :] < N // 2))
        offs_s = n0 // 16 + tl.arange(0, BN // 16)
        tl.store(scales_ptr + offs_m[:, None].to(tl.int64) * (N // 16) + offs_s[None, :], bits,
                 mask=(offs_m[:, None] < M) & (offs_s[None, :] < N // 16))
        # the down-projection from the same registers: acc += x_tile @ L_tile^T
        lt = tl.load(l_ptr + offs_r[:, None] * stride_lr + offs_n[None, :] * stride_ln,
                     mask=(offs_r[:, None] < R) & (offs_n[None, :] < N), other=0.0)  # (BR, BN)
        if DOT_FP32:
            acc = tl.dot(x, tl.trans(lt.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x.to(lt.dtype), tl.trans(lt), acc)
    acc = acc * beta
    offs_m = m0 + tl.arange(0, BM)
    tl.store(xl_ptr + offs_m[:, None].to(tl.int64) * stride_xlm + offs_r[None, :], acc.to(xl_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))


# Row strips of BM rows walk the columns in BN-wide tiles of BM * BN = 4096 elements (nvfp4_quant's tile
# size: the 4/6 candidates keep several fp32 copies of a tile in registers). More, shorter strips hide memory
# latency better; taller strips re-read L (from L2) fewer times. Untuned guesses: autotuned per shape.
_QUANT_CONFIGS = [triton.Config({"BM": bm, "BN": bn, "NUM_STAGES": st}, num_warps=w)
                  for bm, bn, st, w in ((64, 64, 2, 4), (32, 128, 2, 4), (16, 256, 2, 4), (64, 128, 2, 8),
                                        (32, 64, 3, 4))]
_quantize_down_proj_autotuned = triton.autotune(  # cache_results: later processes on this machine skip the timing
    configs=_QUANT_CONFIGS, key=["M", "N", "BR", "SR"], cache_results=True)(
    _quantize_down_proj_kernel)


def _rank_block(r):
    return max(16, triton.next_power_of_2(r))


def quantize_down_proj(x, L, beta=1.0, rounding="rtn", four_over_six=False, seed=None, global_amax=None, name="x"):
    """x (T, K) -> (Q1x16(x) as nvfp4.NVFP4Tensor, beta * x L^T (T, r) in L's dtype) in one pass over x.
    L (r, K): L1 for the forward, L2^T for dX. rounding "rtn" | "sr"; for SR the seed is nvfp4.sr_seed() (torch's
    global CPU RNG) when not given, as nvfp4.quantize draws it. global_amax: max |x| if the caller has it."""
    import nvfp4
    if rounding not in ("rtn", "sr"):
        raise ValueError(f"{name}: rounding must be 'rtn' or 'sr', got {rounding!r}")
    nvfp4._check(x, (1, 16), name)
    if x.dim() != 2 or L.dim() != 2 or L.shape[1] != x.shape[1]:
        raise ValueError(f"quantize_down_proj: need {name} (T, K) and L (r, K), got {tuple(x.shape)} and "
                         f"{tuple(L.shape)}")
    if rounding == "sr" and seed is None:
        seed = nvfp4.sr_seed()
    M, N = x.shape
    R = L.shape[0]
    amax = (torch.linalg.vector_norm(x, ord=float("inf")) if global_amax is None else global_amax).float().reshape(1)
    codes = torch.empty((M, N // 2), device=x.device, dtype=torch.uint8)
    scales = torch.empty((M, N // 16), device=x.device, dtype=torch.uint8)
    xl = torch.empty((M, R), device=x.device, dtype=L.dtype)
    args = (x, L, amax, codes, scales, xl, M, R, float(beta), int(seed or 0),
            x.stride(0), x.stride(1), L.stride(0), L.stride(1), xl.stride(0))
    flags = dict(N=N, BR=_rank_block(R), FP8_BOUND=256.0 if four_over_six else 448.0,
                 FOUR_OVER_SIX=bool(four_over_six), SR=rounding == "sr", DOT_FP32=L.dtype == torch.float32,
                 EXACT_FMA=_exact_fma(), enable_fp_fusion=False)  # no FMA contraction: roundings as the reference
    if x.device.type != "cuda":  # the interpreter: one small config
        _quantize_down_proj_kernel[(triton.cdiv(M, 16),)](*args, **flags, BM=16, BN=64, NUM_STAGES=1, num_warps=4)
    else:
        _quantize_down_proj_autotuned[lambda meta: (triton.cdiv(M, meta["BM"]),)](*args, **flags)
    s_g = nvfp4.global_scale(amax.reshape(()), four_over_six)  # the kernel's s_g: same true division
    return nvfp4.NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), s_g, x.shape, (1, 16)), xl


# ----------------------------------------------------------------------------------------------------------
# NVFP4 GEMM + up-projection epilogue

@triton.jit
def _gemm_up_proj_kernel(a_codes, a_scales, b_codes, b_scales, gs_a_ptr, gs_b_ptr, xl_ptr, l_ptr, c_ptr, M, N, R,
                         K: tl.constexpr, stride_ac0, stride_ac1, stride_asr, stride_ask,
                         stride_bc0, stride_bc1, stride_bsr, stride_bsk, stride_xlm, stride_xlr,
                         stride_ln, stride_lr, stride_cm, stride_cn,
                         B_TRANS: tl.constexpr, A_SB: tl.constexpr, B_SB: tl.constexpr, BR: tl.constexpr,
                         DOT_FP32: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                         GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, NUM_STAGES: tl.constexpr):
    """nvfp4_gemm's main loop (in-register dequantization, fp32 accumulation), then in the epilogue
    acc = acc * s_ga s_gb + xl_tile L_tile^T: the low-rank branch is added before the only store."""
    pid_m, pid_n = tl.swizzle2d(tl.program_id(0) // tl.cdiv(N, BN), tl.program_id(0) % tl.cdiv(N, BN),
                                tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BK), num_stages=NUM_STAGES):
        a = _dequant_tile(a_codes, a_scales, pid_m * BM, kk * BK, M, K, stride_ac0, stride_ac1, stride_asr,
                          stride_ask, BM, BK, A_SB, False, EVEN_K)
        b = _dequant_tile(b_codes, b_scales, pid_n * BN, kk * BK, N, K, stride_bc0, stride_bc1, stride_bsr,
                          stride_bsk, BN, BK, B_SB, B_TRANS, EVEN_K)
        acc = tl.dot(a, tl.trans(b), acc)
    acc = acc * (tl.load(gs_a_ptr) * tl.load(gs_b_ptr))
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_r = tl.arange(0, BR)
    xl = tl.load(xl_ptr + offs_m[:, None].to(tl.int64) * stride_xlm + offs_r[None, :] * stride_xlr,
                 mask=(offs_m[:, None] < M) & (offs_r[None, :] < R), other=0.0)  # (BM, BR)
    lt = tl.load(l_ptr + offs_n[:, None].to(tl.int64) * stride_ln + offs_r[None, :] * stride_lr,
                 mask=(offs_n[:, None] < N) & (offs_r[None, :] < R), other=0.0)  # (BN, BR)
    if DOT_FP32:
        acc = tl.dot(xl, tl.trans(lt), acc, input_precision="ieee")
    else:
        acc = tl.dot(xl, tl.trans(lt), acc)
    tl.store(c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn,
             acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


# nvfp4_gemm's Hopper configs minus its 4-warp one: with the epilogue's second tl.dot, BM=128 x BN=128 on 4 warps
# (one warpgroup) gives wrong sums in the forward and an illegal memory access in dX on the H200 (Triton 3.6;
# scripts/debug_lora_fused.py, 2026-11-29), while the same config is correct in the plain GEMM. The 8-warp
# configs are correct at every toy shape (that script; tests/test_lora_svd.py::test_gpu_triton_epilogue_configs).
_UP_PROJ_CONFIGS = [c for c in _CONFIGS if c.num_warps == 8]
_gemm_up_proj_autotuned = triton.autotune(configs=_UP_PROJ_CONFIGS, key=["M", "N", "K", "B_TRANS", "BR", "EVEN_K"],
                                          cache_results=True)(_gemm_up_proj_kernel)


def nvfp4_matmul_up_proj(a, b, xl, L, out_dtype=torch.float32, trans_b=False, config=None):
    """a_hat b_hat^T + xl L^T in one kernel. a: NVFP4Tensor (M, K) blocked along K; b: logical (N, K) blocked
    along K, stored (K, N) when trans_b (dX reuses the forward's Q16x16(W_res) (out, in) this way, without
    re-packing); xl (M, r) and L (N, r) in the same dtype (bf16 on the GPU, fp32 in the interpreter).
    config: a triton.Config to run instead of autotuning (tests and scripts/debug_lora_fused.py check each one)."""
    if a.codes.dim() != 2:
        raise ValueError(f"nvfp4_matmul_up_proj: a must be 2-D, got {tuple(a.shape)}")
    M, K, sac0, sac1, sasr, sask, a_sb = _operand(a, False, "a")
    N, Kb, sbc0, sbc1, sbsr, sbsk, b_sb = _operand(b, trans_b, "b")
    R = xl.shape[1]
    if Kb != K or xl.shape[0] != M or tuple(L.shape) != (N, R) or xl.dtype != L.dtype:
        raise ValueError(f"nvfp4_matmul_up_proj: need a (M, K), b (N, K), xl (M, r), L (N, r) of one dtype; got "
                         f"a {tuple(a.shape)}, b {(N, Kb)}, xl {tuple(xl.shape)} {xl.dtype}, L {tuple(L.shape)} {L.dtype}")
    out = torch.empty((M, N), device=a.codes.device, dtype=out_dtype)
    args = (a.codes, a.scales, b.codes, b.scales, a.global_scale, b.global_scale, xl, L, out, M, N, R, K,
            sac0, sac1, sasr, sask, sbc0, sbc1, sbsr, sbsk, xl.stride(0), xl.stride(1), L.stride(0), L.stride(1),
            out.stride(0), out.stride(1))
    flags = dict(B_TRANS=trans_b, A_SB=a_sb, B_SB=b_sb, BR=_rank_block(R), DOT_FP32=L.dtype == torch.float32)
    if config is not None or out.device.type != "cuda":  # a given config, or the interpreter's one small config
        config = config or triton.Config(dict(BM=32, BN=32, BK=64, GROUP_M=4, NUM_STAGES=1), num_warps=4)
        cfg = config.kwargs
        grid = (triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"]),)
        _gemm_up_proj_kernel[grid](*args, **flags, EVEN_K=K % cfg["BK"] == 0, **cfg, num_warps=config.num_warps)
        return out
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)
    _gemm_up_proj_autotuned[grid](*args, **flags, EVEN_K=K % 128 == 0)
    return out


# ----------------------------------------------------------------------------------------------------------
# cuBLAS route: the branch as r extra columns of one bf16 GEMM
#   Y = s_g (X_hat W_hat^T) + (beta X L1^T) L2^T = s_g ([X_hat | beta X L1^T / s_g] [W_hat | L2]^T)
# with X_hat, W_hat the exact bf16 grid values q * s_b and s_g = s_gx s_gw. The quantize pass writes both
# blocks of the left operand (one read of X), one cuBLAS GEMM with K + r produces Y (one write), for ~r/K more
# FLOPs. dX likewise with [dY_hat | beta dY L2 / s_g] [W_hat ; L1]. nvfp4_gemm picks cuBLAS over its Triton
# kernel when that is faster; this route is the fused counterpart.

def _cublas_operand(x, L, beta, rounding, four_over_six, seed, s_g_other, name, return_tensor=False,
                    global_amax=None):
    """The cuBLAS route's left operand [X_hat | beta X L^T / (s_g s_g_other)] (T, K + r) in bf16, X's s_g and, with
    return_tensor, the packed Q1x16(X) written by the same pass. X_hat comes from quantize_dequant (the rows
    kernel: the same codes and, for SR, the same Philox draws as every nvfp4 quantization of X given the seed);
    the branch columns from one cuBLAS GEMM with an fp32 result, scaled and rounded to bf16 once. (The fused
    quantize + down-projection kernel wrote both in one pass, reading X once, but took 0.66 ms at 16384 x 4096 with
    4/6 on the H200, against 0.24 ms for nvfp4.quantize of X and 0.05 ms for a torch down-projection; this
    operand takes 0.40-0.43 ms with its small GEMM and cat, results/h200_run6/.) global_amax: max |x| if known."""
    import nvfp4
    if x.dim() != 2 or L.dim() != 2 or L.shape[1] != x.shape[1]:
        raise ValueError(f"{name}: need (T, K) and L (r, K), got {tuple(x.shape)} and {tuple(L.shape)}")
    if rounding == "sr" and seed is None:
        seed = nvfp4.sr_seed()
    xv, s_g, *t = quantize_dequant(x, (1, 16), rounding, four_over_six, seed=seed or 0, global_amax=global_amax,
                                   return_tensor=return_tensor, name=name)
    a, b = x.to(L.dtype), L.t()
    xl = mm_fp32(a, b) if a.is_cuda and a.dtype == torch.bfloat16 else None
    xl = a.float() @ b.float() if xl is None else xl  # (T, r) fp32
    branch = (xl * beta / (s_g * s_g_other)).to(torch.bfloat16)  # (T, r)
    return (t[0] if t else None), torch.cat((xv, branch), dim=1), s_g


def _forward_cublas(x, qw, L1, L2, beta, four_over_six, out_dtype):
    qx, abuf, s_gx = _cublas_operand(x, L1, beta, "rtn", four_over_six, None, qw.global_scale, "activation X",
                                     return_tensor=True)                  # [X_hat | beta X L1^T / s_g]
    wbuf = torch.cat((grid_values_bf16(qw), L2.to(torch.bfloat16)), dim=1)  # (out, K + r) = [W_hat | L2]
    return qx, grid_values_mm(abuf, wbuf.t(), s_gx, qw.global_scale, out_dtype)


def _dx_cublas(dy, qw, L1, L2, beta, four_over_six, out_dtype, seed, global_amax=None):
    _, abuf, s_g = _cublas_operand(dy, L2.t(), beta, "sr", four_over_six, seed, qw.global_scale, "gradient dY",
                                   global_amax=global_amax)               # [dY_hat | beta dY L2 / s_g]
    wbuf = torch.cat((grid_values_bf16(qw), L1.to(torch.bfloat16)), dim=0)  # (out + r, in) = [W_hat ; L1]
    return grid_values_mm(abuf, wbuf, s_g, qw.global_scale, out_dtype)


# ----------------------------------------------------------------------------------------------------------
# What lora_svd.py calls: eq. 1's Y and dX, fused, on the faster route

_ROUTES = {}


def _pick_route(key, run_triton, run_cublas, device):
    """NANOFP4_GEMM_ROUTE=triton|cublas|auto picks the route (auto: time both once per shape, keep the faster).
    The default on CUDA is cublas: it won at every shape measured on the H200 (1.47x faster fwd+bwd at 4096^2,
    bench_lora_svd.py), and auto compiles every Triton variant (N, K are constexprs) for each new shape, which
    cost the 1b config minutes before its first step."""
    forced = os.environ.get("NANOFP4_GEMM_ROUTE", "cublas" if device.type == "cuda" else "auto")
    if forced in ("triton", "cublas"):
        return forced
    if device.type != "cuda":
        return "triton"
    if key not in _ROUTES:
        from triton.testing import do_bench
        t_triton, t_cublas = (do_bench(f, warmup=5, rep=20) for f in (run_triton, run_cublas))
        _ROUTES[key] = "triton" if t_triton <= t_cublas else "cublas"
    return _ROUTES[key]


def lora_forward(x, qw, L1, L2, beta, four_over_six, out_dtype, route=None):
    """eq. 1's Y = Q1x16(X) Q16x16(W_res)^T + (beta X L1^T) L2^T, fused. x (T, in), qw the packed Q16x16(W_res)
    (out, in), L1 (r, in), L2 (out, r) in the branch dtype. Returns (Q1x16(X) packed, for the backward; Y)."""
    def run_triton():
        qx, xl1 = quantize_down_proj(x, L1, beta, "rtn", four_over_six, name="activation X")
        return qx, nvfp4_matmul_up_proj(qx, qw, xl1, L2, out_dtype=out_dtype)

    def run_cublas():
        return _forward_cublas(x, qw, L1, L2, beta, four_over_six, out_dtype)

    key = ("fwd", *x.shape, qw.shape[0], L1.shape[0], x.dtype, out_dtype, x.device.index)
    route = route or _pick_route(key, run_triton, run_cublas, x.device)
    return run_triton() if route == "triton" else run_cublas()


def lora_dx(dy, qw, L1, L2, beta, four_over_six, out_dtype, route=None, seed=None, global_amax=None):
    """eq. 1's dX = Q1x16(dY, SR) Q16x16(W_res) + (beta dY L2) L1, fused, reusing the forward's packed qw (no
    requantization). The SR seed is nvfp4.sr_seed() when not given, as nvfp4.quantize draws it; global_amax:
    max |dY| if the caller has it."""
    if seed is None:
        import nvfp4
        seed = nvfp4.sr_seed()

    def run_triton():
        q_dy, dyl2 = quantize_down_proj(dy, L2.t(), beta, "sr", four_over_six, seed=seed, global_amax=global_amax,
                                        name="gradient dY")
        return nvfp4_matmul_up_proj(q_dy, qw, dyl2, L1.t(), out_dtype=out_dtype, trans_b=True)

    def run_cublas():
        return _dx_cublas(dy, qw, L1, L2, beta, four_over_six, out_dtype, seed, global_amax)

    key = ("dx", *dy.shape, qw.shape[1], L1.shape[0], dy.dtype, out_dtype, dy.device.index)
    route = route or _pick_route(key, run_triton, run_cublas, dy.device)
    return run_triton() if route == "triton" else run_cublas()
