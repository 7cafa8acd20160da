"""
Fused quantized-state AdamW step (paper §3.3) for a 2-D fp32 parameter with packed NVFP4 states:
decode m and v, AdamW update, write the parameter, re-encode m and v, in one pass over the tensor.

The exact per-tensor global scales (S_enc = 256 * 6 / amax) of the NEW m H and (sqrt(v) - mu) H are
needed before any block can be encoded, and it depends on every element. So there are two launches:
  1. `_amax_pass`:   decode, update (registers only), per-program max |m H| and |(sqrt(v) - mu) H|.
                     Reads g and the packed states (~5.2 bytes/param), writes nothing but the
                     partial maxima.
  2. `_update_pass`: decode, update, write p, encode with the new global scales, write codes, E4M3
                     scales and tile means in place (each program reads its own tile before writing
                     it).
Bytes per parameter (fp32 p and g): pass 2 reads 4 + 4 + 2 x 0.5625 + 4/128 and writes 4 + 2 x
0.5625 + 4/128 (~14.3 B, the useful traffic); pass 1 adds ~5.2 B of re-reads.

Program tile: BM rows x T columns where T = gcd(C, 128) is the v tile (optim.CONTRACT's
adamw.v.tile): one tile mean per row.
Same arithmetic as optim.py's reference (decode_first_moment / decode_second_moment,
adamw_update_math, encode_first_moment / encode_second_moment), op for op, compiled with
enable_fp_fusion=False:
  - the 16-point Hadamard is every kernel's butterfly (nvfp4_math._butterfly16), optim.fwht16's
    stage for stage, the tile mean the same pairwise tree;
  - quantization is kernels/nvfp4_math.py's, as in every quantize kernel (_scale_blocks: the block
    scales and 4/6's choice; the E2M1 roundings), bit-exact with nvfp4.quantize;
  - divisions and sqrt are correctly rounded (tl.div_rn / tl.sqrt_rn), like torch on the CPU; a
    division by a per-block or per-program value is Markstein's fma step from one reciprocal
    (nvfp4_math._div_by: the same correctly rounded bits);
So with the same inputs p, the global scales, the E4M3 block scales (4/6 picks them by RTN error)
and v's tile means equal the CPU reference bit for bit. m's and v's stochastic rounding draw the SR
contract's 16 random bits per element (nvfp4.sr_uniforms: one Philox4x32-10 call per 8 elements,
keyed by (seed, element index // 8); nvfp4_math._random_words), one seed each, so given the seeds
their codes equal the reference's too.

The kernel is instruction-bound, so the layout keeps each 16-element block in one thread
(codes in and out as one int64 per block, built by join / split, which stay in registers), E2M1
codes decode from their bits, the tile mean's cross-thread levels are shuffles, and addresses are
int64 once per program.
"""

import torch
import triton
import triton.language as tl

from kernels.nvfp4_math import (E4M3_MAX_46, _butterfly16, _decode_e2m1, _div_by, _e4m3_value,
                                _global_scales, _pack_codes, _random_words, _scale_blocks,
                                _sign_bits, _sr_e2m1_value)
from kernels.nvfp4_quant import _exact_fma, seed_tensor


@triton.jit
def _h16(x, BM: tl.constexpr, BN: tl.constexpr):
    """x . H16 (unnormalized) on groups of 16 along the columns of a (BM, BN) tile
    (nvfp4_math._butterfly16)."""
    return _butterfly16(x.reshape(BM * BN // 16, 16, 1), BM * BN // 16, 1).reshape(BM, BN)


@triton.jit
def _fwht16(x, BM: tl.constexpr, BN: tl.constexpr):
    """x . H16/4 (optim.fwht16): the butterfly, then the exact * 1/4."""
    return _h16(x, BM, BN) * 0.25


@triton.jit
def _tile_mean(s, BM: tl.constexpr, BN: tl.constexpr, LOG2_BN: tl.constexpr):
    """Mean of each row of the (BM, BN) tile: optim.tile_mean's pairwise tree (first half + second
    half). Each level sums a size-2 axis: one add, a + b == b + a, so the bits cannot depend on how
    Triton reduces; the levels across threads become shuffles instead of a shared-memory layout
    conversion."""
    x = s
    for i in tl.static_range(LOG2_BN):
        x = tl.sum(x.reshape(BM, 2, BN >> (i + 1)), axis=1)
    return x.reshape(BM) * (1.0 / BN)


@triton.jit
def _decode(codes_ptr, scales_ptr, gs, blk, rmask, BM: tl.constexpr, BN: tl.constexpr):
    """Packed (1, 16)-block NVFP4 -> (q * s_b) * s_g, (BM, BN) fp32 (NVFP4Tensor.dequantize, by
    nvfp4_math._decode_e2m1). blk: (BM, BN // 16) block indices from the pointers. A block's 16
    codes are one int64, low nibble first (_pack_codes)."""
    w = tl.load(codes_ptr.to(tl.pointer_type(tl.int64)) + blk, mask=rmask, other=0)
    # code k of each 32-bit half to bits 31..28 (shift 28 - 4k) by joins, which keep a block in one
    # thread
    u = tl.join(w.to(tl.uint32), (w >> 32).to(tl.uint32))  # (BM, G, 2): codes 0-7, 8-15
    u = tl.join(u << 16, u)
    u = tl.join(u << 8, u)
    u = tl.join(u << 4, u).reshape(BM, BN // 16, 16)
    sc = tl.load(scales_ptr + blk, mask=rmask, other=0)
    s_b = _e4m3_value(sc).reshape(BM, BN // 16, 1)
    return _decode_e2m1(u.to(tl.int32, bitcast=True), s_b, gs).reshape(BM, BN)


@triton.jit
def _decode_update(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, gs_m_ptr, gs_v_ptr, offs,
                   blk, mu_offs, mask_r, wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2,
                   bc2_sqrt, eps, step_size,
                   FLOOR: tl.constexpr, EXACT_FMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   LOG2_BN: tl.constexpr):
    """Decode m, v; AdamW update (optim.adamw_update_math). Returns new p, m, sqrt(v) - mu_new
    (not yet rotated: each pass applies H16 itself) and mu_new. The pointers point at the program's
    tile; offs, blk and mu_offs are int32 offsets from them (one int64 address per pointer and
    program, not per element)."""
    rmask = mask_r[:, None]
    # rows past R: zeros, not stored
    g = tl.load(g_ptr + offs, mask=rmask, other=0.0).to(tl.float32)
    m = _fwht16(_decode(mc_ptr, ms_ptr, tl.load(gs_m_ptr), blk, rmask, BM, BN), BM, BN)
    mu = tl.load(mu_ptr + mu_offs, mask=mask_r, other=0.0)                   # (BM,)
    r = (_fwht16(_decode(vc_ptr, vs_ptr, tl.load(gs_v_ptr), blk, rmask, BM, BN), BM, BN)
         + mu[:, None])
    r = tl.maximum(r, mu[:, None] * FLOOR)
    v = r * r
    # AdamW, one rounding per op in the reference's order
    p = tl.load(p_ptr + offs, mask=rmask, other=0.0) * wd_factor
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    s = tl.sqrt_rn(v)
    # sqrt(v) / bc2_sqrt correctly rounded from one reciprocal per program (bc2_sqrt in (0, 1],
    # sqrt(v) 0 or normal)
    inv_bc2 = tl.div_rn(1.0, bc2_sqrt)
    denom = _div_by(s, bc2_sqrt, inv_bc2, EXACT_FMA) + eps
    p = p - step_size * tl.div_rn(m, denom)
    mu_new = _tile_mean(s, BM, BN, LOG2_BN)
    return p, m, s - mu_new[:, None], mu_new


@triton.jit
def _tile_setup(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, R, C, BM: tl.constexpr,
                BN: tl.constexpr):
    """The program's tile: the pointers moved to its first element (int64, once per program), int32
    offsets from them (element, (1, 16) block, tile mean), the row mask and the global row
    indices."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    row0 = pid_m * BM
    cols = pid_n * BN
    base = row0.to(tl.int64) * C + cols  # the tile's first element
    r = tl.arange(0, BM)
    offs = r[:, None] * C + tl.arange(0, BN)[None, :]
    blk = r[:, None] * (C // 16) + tl.arange(0, BN // 16)[None, :]
    return (p_ptr + base, g_ptr + base, mc_ptr + base // 2, ms_ptr + base // 16, vc_ptr + base // 2,
            vs_ptr + base // 16, mu_ptr + base // BN, offs, blk, r * (C // BN), row0 + r < R,
            row0 + r, cols)


@triton.jit
def _amax_pass(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, gs_m_ptr, gs_v_ptr, part_ptr,
               R, C,
               wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size,
               FLOOR: tl.constexpr, EXACT_FMA: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               LOG2_BN: tl.constexpr):
    p_t, g_t, mc_t, ms_t, vc_t, vs_t, mu_t, offs, blk, mu_offs, mask_r, _, _ = _tile_setup(
        p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, R, C, BM, BN)
    _, m, r, _ = _decode_update(p_t, g_t, mc_t, ms_t, vc_t, vs_t, mu_t, gs_m_ptr, gs_v_ptr, offs,
                                blk, mu_offs, mask_r,
                                wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2,
                                bc2_sqrt, eps, step_size, FLOOR, EXACT_FMA, BM, BN, LOG2_BN)
    # max |y * 1/4| = (max |y|) * 1/4 exactly (rounding is monotone): the 1/4 once per program, not
    # per element
    amax_m = tl.max(tl.max(tl.abs(_h16(m, BM, BN)), axis=1), axis=0) * 0.25
    amax_r = tl.max(tl.max(tl.abs(_h16(r, BM, BN)), axis=1), axis=0) * 0.25
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(part_ptr + 2 * pid, amax_m)
    tl.store(part_ptr + 2 * pid + 1, amax_r)


@triton.jit
def _encode(x, s_enc, s_dec, rand, codes_ptr, scales_ptr, blk, rmask, SR: tl.constexpr,
            UP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """nvfp4.quantize(x, (1, 16), rtn | sr | sr_up (SR, UP), four_over_six=True) of a (BM, BN) tile
    given its global scales; stores in place."""
    # (BM, BN / 16) blocks of 1 x 16, the scales and 4/6's choice as every quantize kernel's
    a, _, bits, q = _scale_blocks(tl.abs(x).reshape(BM, 1, BN // 16, 16), s_enc, s_dec,
                                      BM, 1, BN // 16, 16, True, UP)
    a = a.reshape(BM, BN // 16, 16)
    if SR:
        q = _sr_e2m1_value(a, rand.reshape(BM, BN // 16, 16))
    w = _pack_codes(q, _sign_bits(x, a.reshape(BM, BN)), BM, BN // 16, 16)  # one int64 a block
    tl.store(codes_ptr.to(tl.pointer_type(tl.int64)) + blk, w, mask=rmask)
    tl.store(scales_ptr + blk, bits, mask=rmask)


@triton.jit
def _update_pass(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, gs_m_ptr, gs_v_ptr, amax_ptr,
                 new_gs_ptr, R, C, seed_m_ptr, seed_v_ptr,
                 wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps,
                 step_size, FLOOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 LOG2_BN: tl.constexpr, EXACT_FMA: tl.constexpr, SR_M: tl.constexpr,
                 UP_M: tl.constexpr, SR_V: tl.constexpr, UP_V: tl.constexpr):
    p_t, g_t, mc_t, ms_t, vc_t, vs_t, mu_t, offs, blk, mu_offs, mask_r, rows, cols = _tile_setup(
        p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, R, C, BM, BN)
    p, m, r, mu = _decode_update(p_t, g_t, mc_t, ms_t, vc_t, vs_t, mu_t, gs_m_ptr, gs_v_ptr, offs,
                                 blk, mu_offs, mask_r,
                                 wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2,
                                 bc2_sqrt, eps, step_size, FLOOR, EXACT_FMA, BM, BN, LOG2_BN)
    tl.store(p_t + offs, p, mask=mask_r[:, None])
    # global scales (nvfp4.global_scales with 4/6's bound)
    se_m, gs_m = _global_scales(tl.load(amax_ptr), E4M3_MAX_46)
    se_v, gs_v = _global_scales(tl.load(amax_ptr + 1), E4M3_MAX_46)
    # Philox keyed by element index (a uint32: int32 rows suffice); m and v draw independent words
    # (own seeds)
    rand = _random_words(tl.load(seed_m_ptr), rows, cols, C, BM, BN)
    _encode(_fwht16(m, BM, BN), se_m, gs_m, rand, mc_t, ms_t, blk, mask_r[:, None], SR_M, UP_M,
            BM, BN)
    rand = _random_words(tl.load(seed_v_ptr), rows, cols, C, BM, BN)
    _encode(_fwht16(r, BM, BN), se_v, gs_v, rand, vc_t, vs_t, blk, mask_r[:, None], SR_V, UP_V,
            BM, BN)
    tl.store(mu_t + mu_offs, mu, mask=mask_r)
    if (tl.program_id(0) == 0) & (tl.program_id(1) == 0):
        tl.store(new_gs_ptr, gs_m)
        tl.store(new_gs_ptr + 1, gs_v)


def _rows_per_program(R, T, elements):
    """BM: ~`elements` per program (a power of two; the last program's rows past R are masked)."""
    return min(max(1, elements // T), triton.next_power_of_2(R))


def fused_adamw_step(p, g, state, lr, beta1, beta2, eps, weight_decay, step, seed_m, seed_v, floor,
                     rounding_m="sr", rounding_v="sr", elements_per_program=2048, num_warps=4):
    """One QuantizedAdamW step on p (R, C) fp32 with optim.py's packed "nvfp4" state (keys m.codes,
    m.scales, m.global_scale, v.codes, v.scales, v.global_scale, v.tile_mean), updated in place.
    seed_m, seed_v: the stochastic-rounding seeds of m's and v's encodings (one pair per step),
    0-d int64 tensors on p's device (optim._seeds draws them there) or host ints.
    floor: the decoded sqrt(v) is at least floor * its tile mean (optim.CONTRACT["adamw.v.floor"];
    a power of two).
    rounding_m, rounding_v: "rtn" | "sr" | "sr_up", the states' contract entries' rounding.
    elements_per_program / num_warps: launch shape (the results do not depend on it)."""
    if p.dtype != torch.float32 or p.dim() != 2 or not p.is_contiguous():
        raise ValueError(f"fused_adamw_step: p must be a contiguous 2-D fp32 tensor, "
                         f"got {p.dtype} {tuple(p.shape)}")
    g = g.contiguous()
    R, C = p.shape
    T = C // state["v.tile_mean"].shape[-1]
    BM = _rows_per_program(R, T, elements_per_program)
    scalars = (1 - lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2,
               (1 - beta2 ** step) ** 0.5, eps, lr / (1 - beta1 ** step))
    ms, vs = state["m.scales"].view(torch.uint8), state["v.scales"].view(torch.uint8)
    grid = (triton.cdiv(R, BM), C // T)
    tensors = (p, g, state["m.codes"], ms, state["v.codes"], vs, state["v.tile_mean"],
               state["m.global_scale"], state["v.global_scale"])
    partial = torch.empty(2 * grid[0] * grid[1], device=p.device, dtype=torch.float32)
    _amax_pass[grid](*tensors, partial, R, C, *scalars, FLOOR=floor, EXACT_FMA=_exact_fma(), BM=BM,
                     BN=T, LOG2_BN=T.bit_length() - 1, num_warps=num_warps, enable_fp_fusion=False)
    amax = partial.view(-1, 2).amax(0)
    new_gs = torch.empty(2, device=p.device, dtype=torch.float32)
    _update_pass[grid](*tensors, amax, new_gs, R, C, seed_tensor(seed_m, p.device),
                       seed_tensor(seed_v, p.device), *scalars,
                       FLOOR=floor, BM=BM, BN=T,
                       LOG2_BN=T.bit_length() - 1, EXACT_FMA=_exact_fma(), num_warps=num_warps,
                       SR_M=rounding_m != "rtn", UP_M=rounding_m == "sr_up",
                       SR_V=rounding_v != "rtn", UP_V=rounding_v == "sr_up",
                       enable_fp_fusion=False)
    # p was written behind torch's back: bump its version counter as an in-place op does (autograd's
    # checks, and a layer's cached quantized weight, which a changed version makes stale)
    torch.autograd.graph.increment_version(p)
    # views: no copy kernels
    state["m.global_scale"], state["v.global_scale"] = new_gs[0], new_gs[1]
