"""
LoRA-SVD kernel fusion (paper App. 9, after SVDQuant's Nunchaku engine): the low-rank branch of eq. 1 rides
on the two kernels the NVFP4 residual needs anyway, so it adds no pass over the big tensors.

  quantize_down_proj(x, L, beta)   one read of x (T, K): packed Q1x16(x) (codes + E4M3 scales, exactly
                                   kernels/nvfp4_quant.py's numbers) AND the down-projection beta * x L^T (T, r)
  nvfp4_matmul_up_proj(a, b, xl, L)  the NVFP4 GEMM a_hat b_hat^T whose epilogue adds xl L^T before the one
                                   write of the output (the up-projection; xl already carries beta)

Forward: Y = Q(X) Q(W_res)^T + (beta X L1^T) L2^T  ->  quantize_down_proj(X, L1), nvfp4_matmul_up_proj(.., L2)
dX:      dX = Q(dY) Q(W_res) + (beta dY L2) L1      ->  quantize_down_proj(dY, L2^T, SR), (.., L1^T, trans_b)
The global amax of x is still a separate read (as in kernels/nvfp4_quant.py): per-tensor scaling needs it first.

The quantize arithmetic reuses nvfp4_quant's @triton.jit helpers (E4M3 rounding, RTN, SR, E2M1 values, tile
load), the GEMM reuses nvfp4_gemm's in-register dequantization and its Hopper configs. Codes and scales are
bit-identical to nvfp4_quant.quantize (RTN, and SR given the seed: same tl.rand offsets). The branch is BF16
on the GPU (bf16 operands, fp32 accumulation, beta * x L^T rounded to bf16 once) and fp32 in the interpreter,
whose bf16 tl.dot is wrong in Triton 3.6; it equals the unfused torch branch up to those roundings.
"""

import os

import torch
import triton
import triton.language as tl

from kernels.nvfp4_gemm import _CONFIGS, _dequant_tile, _operand
from kernels.nvfp4_quant import _e2m1_value, _load_tile, _round_to_e4m3, _rtn_e2m1, _sr_e2m1


# ----------------------------------------------------------------------------------------------------------
# quantize + down-projection

@triton.jit
def _scale_candidate(xb, block_amax, s_g, FP4_MAX: tl.constexpr):
    """Block scale with the block max mapped to FP4_MAX (6, or 4 for 4/6's second candidate) and the scaled
    magnitudes a = min(|x| / (s_b s_g), 6), rounded exactly as nvfp4_quant._quantize_kernel does."""
    s, bits = _round_to_e4m3(tl.minimum(tl.div_rn(tl.div_rn(block_amax, FP4_MAX), s_g), 448.0))
    den = (s * s_g)[:, None, :, None]
    a = tl.minimum(tl.where(den > 0, tl.div_rn(xb, tl.where(den > 0, den, 1.0)), 0.0), 6.0)
    err = _e2m1_value(_rtn_e2m1(a)) * den - xb  # RTN reconstruction error, for the 4/6 choice
    return bits, a, tl.sum(tl.sum(err * err, axis=3), axis=1)


@triton.jit
def _quantize_down_proj_kernel(x_ptr, l_ptr, amax_ptr, codes_ptr, scales_ptr, xl_ptr, M, R, beta, seed,
                               stride_xm, stride_xn, stride_lr, stride_ln, N: tl.constexpr,
                               BM: tl.constexpr, BN: tl.constexpr, BR: tl.constexpr, FP8_BOUND: tl.constexpr,
                               FOUR_OVER_SIX: tl.constexpr, SR: tl.constexpr, DOT_FP32: tl.constexpr):
    """A strip of BM rows: for each (BM, BN) tile, 1x16 NVFP4 codes + scales, and x_tile L_tile^T accumulated
    into the (BM, r) down-projection in registers (deterministic: no atomics across column tiles).
    N is a constexpr: the interpreter cannot range() over a runtime int (see nvfp4_gemm)."""
    pid_m, pid_b = tl.program_id(0), tl.program_id(1)  # pid_b is 0: the grid has one batch
    m0 = pid_m * BM
    amax = tl.load(amax_ptr)
    s_g = tl.where(amax > 0, tl.div_rn(amax, FP8_BOUND * 6.0), 1.0)
    offs_r = tl.arange(0, BR)
    acc = tl.zeros((BM, BR), dtype=tl.float32)
    for n0 in range(0, N, BN):
        x, offs_m, offs_n, mask = _load_tile(x_ptr, x_ptr, pid_b, m0, n0, M, N, 0, stride_xm, stride_xn,
                                             BM, BN, 0, True)
        xb = tl.abs(x).reshape(BM, 1, BN // 16, 16)
        block_amax = tl.max(tl.max(xb, axis=3), axis=1)  # (BM, BN // 16)
        bits, a, err6 = _scale_candidate(xb, block_amax, s_g, 6.0)
        if FOUR_OVER_SIX:  # keep the lower-error candidate per block, ties to 6
            bits4, a4, err4 = _scale_candidate(xb, block_amax, s_g, 4.0)
            use4 = err4 < err6
            bits = tl.where(use4, bits4, bits)
            a = tl.where(use4[:, None, :, None], a4, a)
        if SR:  # same counter-based draws as nvfp4_quant: tl.rand(seed, element index)
            rand = tl.rand(seed, (offs_m[:, None] * N + offs_n[None, :]).to(tl.uint32))
            idx = _sr_e2m1(a, rand.reshape(BM, 1, BN // 16, 16))
        else:
            idx = _rtn_e2m1(a)
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
    offs_m = m0 + tl.arange(0, BM)
    tl.store(xl_ptr + offs_m[:, None].to(tl.int64) * R + offs_r[None, :], (acc * beta).to(xl_ptr.dtype.element_ty),
             mask=(offs_m[:, None] < M) & (offs_r[None, :] < R))


def _interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def _rank_block(r):
    return max(16, triton.next_power_of_2(r))


def quantize_down_proj(x, L, beta=1.0, rounding="rtn", four_over_six=False, seed=None, name="x"):
    """x (T, K) -> (Q1x16(x) as nvfp4.NVFP4Tensor, beta * x L^T (T, r) in L's dtype) in one pass over x.
    L (r, K): L1 for the forward, L2^T for dX. rounding "rtn" | "sr"; for SR the seed is drawn from torch's
    global RNG of x's device when not given (as nvfp4.quantize does)."""
    import nvfp4
    if rounding not in ("rtn", "sr"):
        raise ValueError(f"{name}: rounding must be 'rtn' or 'sr', got {rounding!r}")
    nvfp4._check(x, (1, 16), name)
    if x.dim() != 2 or L.dim() != 2 or L.shape[1] != x.shape[1]:
        raise ValueError(f"quantize_down_proj: need {name} (T, K) and L (r, K), got {tuple(x.shape)} and "
                         f"{tuple(L.shape)}")
    if rounding == "sr" and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (), device=x.device))
    M, N = x.shape
    R = L.shape[0]
    amax = torch.linalg.vector_norm(x, ord=float("inf")).float().reshape(1)
    codes = torch.empty((M, N // 2), device=x.device, dtype=torch.uint8)
    scales = torch.empty((M, N // 16), device=x.device, dtype=torch.uint8)
    xl = torch.empty((M, R), device=x.device, dtype=L.dtype)
    BM, BN = (16, 64) if _interpreting() else (64, 64)
    _quantize_down_proj_kernel[(triton.cdiv(M, BM),)](
        x, L, amax, codes, scales, xl, M, R, float(beta), int(seed or 0),
        x.stride(0), x.stride(1), L.stride(0), L.stride(1), N=N, BM=BM, BN=BN, BR=_rank_block(R),
        FP8_BOUND=256.0 if four_over_six else 448.0, FOUR_OVER_SIX=bool(four_over_six), SR=rounding == "sr",
        DOT_FP32=L.dtype == torch.float32, num_warps=4,
        enable_fp_fusion=False)  # no FMA contraction: every rounding as in the reference
    s_g = nvfp4.global_scale(amax.reshape(()), four_over_six) if x.device.type == "cpu" else \
        _true_div_global_scale(amax, four_over_six)
    t = nvfp4.NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), s_g, x.shape, (1, 16))
    return t, xl


def _true_div_global_scale(amax, four_over_six):
    from kernels.nvfp4_quant import _global_scale_dev
    return _global_scale_dev(amax, four_over_six)


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


_gemm_up_proj_autotuned = triton.autotune(configs=_CONFIGS, key=["M", "N", "K", "B_TRANS", "BR", "EVEN_K"])(
    _gemm_up_proj_kernel)


def nvfp4_matmul_up_proj(a, b, xl, L, out_dtype=torch.float32, trans_b=False):
    """a_hat b_hat^T + xl L^T in one kernel. a: NVFP4Tensor (M, K) blocked along K; b: logical (N, K) blocked
    along K, stored (K, N) when trans_b (dX reuses the forward's Q16x16(W_res) (out, in) this way, without
    re-packing); xl (M, r) and L (N, r) in the same dtype (bf16 on the GPU, fp32 in the interpreter)."""
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
    if out.device.type != "cuda":  # the interpreter: one small config, no autotuning
        cfg = dict(BM=32, BN=32, BK=64, GROUP_M=4, NUM_STAGES=1)
        grid = (triton.cdiv(M, 32) * triton.cdiv(N, 32),)
        _gemm_up_proj_kernel[grid](*args, **flags, EVEN_K=K % 64 == 0, **cfg, num_warps=4)
        return out
    grid = lambda meta: (triton.cdiv(M, meta["BM"]) * triton.cdiv(N, meta["BN"]),)
    _gemm_up_proj_autotuned[grid](*args, **flags, EVEN_K=K % 128 == 0)
    return out
