"""
Fused quantized-state AdamW step (paper §3.3) for a 2-D fp32 parameter with packed NVFP4 states:
decode m and v, AdamW update, write the parameter, re-encode m and v, in one pass over the tensor.

The exact per-tensor global scale s_g = amax / (256 * 6) of the NEW m H and (sqrt(v) - mu) H is needed before
any block can be encoded, and it depends on every element. So there are two launches:
  1. `_amax_pass`:   decode, update (registers only), per-program max |m H| and |(sqrt(v) - mu) H|.
                     Reads g and the packed states (~5.2 bytes/param), writes nothing but the partial maxima.
  2. `_update_pass`: decode, update, write p, encode with the new global scales, write codes, E4M3 scales
                     and tile means in place (each program reads its own tile before writing it).
Bytes per parameter (fp32 p and g): pass 2 reads 4 + 4 + 2 x 0.5625 + 4/128 and writes 4 + 2 x 0.5625 +
4/128 (~14.3 B, the useful traffic); pass 1 adds ~5.2 B of re-reads. bench_optim.py reports both.

Program tile: BM rows x T columns where T = gcd(C, 128) is the v tile (optim.V_TILE): one tile mean per row.
Same arithmetic as optim.py's reference (decode_first_moment / decode_second_moment, adamw_update_math,
encode_first_moment / encode_second_moment), op for op, compiled with enable_fp_fusion=False:
  - the 16-point Hadamard is the same 4-stage butterfly as optim.fwht16, the tile mean the same pairwise tree;
  - quantization reuses kernels/nvfp4_quant.py's E4M3 / E2M1 helpers (bit-exact with nvfp4.quantize);
  - divisions and sqrt are correctly rounded (tl.div_rn / tl.sqrt_rn), like torch on the CPU.
  - 4/6's block errors are summed with the same fixed pairwise tree as nvfp4._pairwise_block_sum.
So with the same inputs the RTN parts (v's codes, scales, tile means; p) equal the CPU reference bit for bit.
m's stochastic rounding draws Philox uniforms keyed by (seed, element index) (nvfp4_quant._uniforms), not torch's
generator: equal in distribution only (its block scales, chosen by RTN error, match).
"""

import triton
import triton.language as tl

from kernels.nvfp4_quant import (_div_by, _e2m1_value, _exact_fma, _pairwise_block_sum, _round_to_e4m3, _rtn_e2m1,
                                 _sr_e2m1, _uniforms)


@triton.jit
def _fwht16(x, BM: tl.constexpr, BN: tl.constexpr):
    """x . H16/4 on groups of 16 along the columns: optim.fwht16's butterfly, stage for stage."""
    G: tl.constexpr = BM * BN // 16
    y = x.reshape(G, 1, 2, 8)
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)).reshape(G, 2, 2, 4)
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)).reshape(G, 4, 2, 2)
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)).reshape(G, 8, 2, 1)
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return y.reshape(BM, BN) * 0.25


@triton.jit
def _tile_mean(s, BM: tl.constexpr, BN: tl.constexpr, LOG2_BN: tl.constexpr):
    """Mean of each row of the (BM, BN) tile: optim.tile_mean's pairwise tree (first half + second half)."""
    x = s
    for i in tl.static_range(LOG2_BN):
        a, b = tl.split(tl.permute(x.reshape(BM, 2, BN >> (i + 1)), (0, 2, 1)))
        x = a + b
    return x.reshape(BM) * (1.0 / BN)


@triton.jit
def _decode(codes_ptr, scales_ptr, gs, rows, cols, R, C, BM: tl.constexpr, BN: tl.constexpr):
    """Packed (1, 16)-block NVFP4 -> (q * s_b) * s_g, (BM, BN) fp32 (NVFP4Tensor.dequantize)."""
    half = cols // 2 + tl.arange(0, BN // 2)
    c = tl.load(codes_ptr + rows[:, None] * (C // 2) + half[None, :], mask=rows[:, None] < R, other=0)
    code = tl.join(c & 0xF, c >> 4).reshape(BM, BN).to(tl.int32)
    q = _e2m1_value(code & 7)
    q = tl.where(code >= 8, -q, q)
    sc = tl.load(scales_ptr + rows[:, None] * (C // 16) + cols // 16 + tl.arange(0, BN // 16)[None, :],
                 mask=rows[:, None] < R, other=0)
    s = sc.to(tl.float8e4nv, bitcast=True).to(tl.float32).reshape(BM, BN // 16, 1)
    return (q.reshape(BM, BN // 16, 16) * s).reshape(BM, BN) * gs


@triton.jit
def _decode_update(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, old_gs_ptr, rows, cols, R, C,
                   wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size,
                   FLOOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOG2_BN: tl.constexpr):
    """Decode m, v; AdamW update (optim.adamw_update_math). Returns new p, m H, (sqrt(v) - mu) H and mu."""
    offs = rows[:, None] * C + cols + tl.arange(0, BN)[None, :]
    rmask = rows[:, None] < R                                                 # rows past R: zeros, not stored
    g = tl.load(g_ptr + offs, mask=rmask, other=0.0).to(tl.float32)
    m = _fwht16(_decode(mc_ptr, ms_ptr, tl.load(old_gs_ptr), rows, cols, R, C, BM, BN), BM, BN)
    n_tiles = C // BN
    mu = tl.load(mu_ptr + rows * n_tiles + cols // BN, mask=rows < R, other=0.0)  # (BM,)
    r = _fwht16(_decode(vc_ptr, vs_ptr, tl.load(old_gs_ptr + 1), rows, cols, R, C, BM, BN), BM, BN) + mu[:, None]
    r = tl.maximum(r, mu[:, None] * FLOOR)
    v = r * r
    # AdamW, one rounding per op in the reference's order
    p = tl.load(p_ptr + offs, mask=rmask, other=0.0) * wd_factor
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * (g * g)
    denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    # re-encoding inputs: m H and (sqrt(v) - mu_new) H
    s = tl.sqrt_rn(v)
    mu_new = _tile_mean(s, BM, BN, LOG2_BN)
    return p, _fwht16(m, BM, BN), _fwht16(s - mu_new[:, None], BM, BN), mu_new, offs


@triton.jit
def _amax_pass(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, old_gs_ptr, part_ptr, R, C,
               wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size,
               FLOOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOG2_BN: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    _, mh, rh, _, _ = _decode_update(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, old_gs_ptr, rows,
                                     pid_n * BN, R, C, wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2,
                                     bc2_sqrt, eps, step_size, FLOOR, BM, BN, LOG2_BN)
    pid = pid_m * tl.num_programs(1) + pid_n
    tl.store(part_ptr + 2 * pid, tl.max(tl.max(tl.abs(mh), axis=1), axis=0))
    tl.store(part_ptr + 2 * pid + 1, tl.max(tl.max(tl.abs(rh), axis=1), axis=0))


@triton.jit
def _encode(x, s_g, rand, codes_ptr, scales_ptr, rows, cols, R, C, SR: tl.constexpr, EXACT_FMA: tl.constexpr,
            BM: tl.constexpr, BN: tl.constexpr):
    """nvfp4.quantize(x, (1, 16), rtn|sr, four_over_six=True) of a (BM, BN) tile given s_g; stores in place."""
    ax = tl.abs(x)
    xb = ax.reshape(BM, BN // 16, 16)
    block_amax = tl.max(xb, axis=2)                                            # (BM, BN // 16)
    s6, bits6 = _round_to_e4m3(tl.minimum(tl.div_rn(tl.div_rn(block_amax, 6.0), s_g), 448.0))
    s4, bits4 = _round_to_e4m3(tl.minimum(tl.div_rn(tl.div_rn(block_amax, 4.0), s_g), 448.0))
    den6, den4 = s6 * s_g, s4 * s_g
    inv6 = tl.where(den6 > 0, tl.div_rn(1.0, tl.where(den6 > 0, den6, 1.0)), 0.0)
    inv4 = tl.where(den4 > 0, tl.div_rn(1.0, tl.where(den4 > 0, den4, 1.0)), 0.0)
    a6 = tl.minimum(_div_by(xb, den6[:, :, None], inv6[:, :, None], EXACT_FMA), 6.0)
    a4 = tl.minimum(_div_by(xb, den4[:, :, None], inv4[:, :, None], EXACT_FMA), 6.0)
    d6 = _e2m1_value(_rtn_e2m1(a6)) * den6[:, :, None] - xb
    d4 = _e2m1_value(_rtn_e2m1(a4)) * den4[:, :, None] - xb
    err6 = _pairwise_block_sum((d6 * d6).reshape(BM, 1, BN // 16, 16), BM, 1, BN // 16, 16)
    err4 = _pairwise_block_sum((d4 * d4).reshape(BM, 1, BN // 16, 16), BM, 1, BN // 16, 16)
    use4 = err4 < err6                                                         # 4/6, ties to 6
    a = tl.where(use4[:, :, None], a4, a6)
    if SR:
        idx = _sr_e2m1(a, rand.reshape(BM, BN // 16, 16))
    else:
        idx = _rtn_e2m1(a)
    code = (idx.reshape(BM, BN) | ((x < 0).to(tl.int32) << 3)).to(tl.uint8)
    lo, hi = tl.split(code.reshape(BM, BN // 2, 2))
    half = cols // 2 + tl.arange(0, BN // 2)
    tl.store(codes_ptr + rows[:, None] * (C // 2) + half[None, :], lo | (hi << 4), mask=rows[:, None] < R)
    bits = tl.where(use4, bits4, bits6)
    tl.store(scales_ptr + rows[:, None] * (C // 16) + cols // 16 + tl.arange(0, BN // 16)[None, :], bits,
             mask=rows[:, None] < R)


@triton.jit(do_not_specialize=["seed"])  # a fresh SR seed per step must not recompile
def _update_pass(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, old_gs_ptr, amax_ptr, new_gs_ptr, R, C, seed,
                 wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size,
                 FLOOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, LOG2_BN: tl.constexpr,
                 EXACT_FMA: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols = pid_n * BN
    p, mh, rh, mu, offs = _decode_update(p_ptr, g_ptr, mc_ptr, ms_ptr, vc_ptr, vs_ptr, mu_ptr, old_gs_ptr, rows,
                                         cols, R, C, wd_factor, beta1, one_minus_beta1, beta2, one_minus_beta2,
                                         bc2_sqrt, eps, step_size, FLOOR, BM, BN, LOG2_BN)
    tl.store(p_ptr + offs, p, mask=rows[:, None] < R)
    # global scales s_g = amax / (256 * 6) (nvfp4.global_scale with 4/6), 1 when amax == 0
    amax_m, amax_v = tl.load(amax_ptr), tl.load(amax_ptr + 1)
    gs_m = tl.where(amax_m > 0, tl.div_rn(amax_m, 1536.0), 1.0)
    gs_v = tl.where(amax_v > 0, tl.div_rn(amax_v, 1536.0), 1.0)
    rand = _uniforms(seed, rows, cols, C, BM, BN)  # Philox keyed by element index, as in nvfp4_quant
    _encode(mh, gs_m, rand, mc_ptr, ms_ptr, rows, cols, R, C, True, EXACT_FMA, BM, BN)
    _encode(rh, gs_v, rand, vc_ptr, vs_ptr, rows, cols, R, C, False, EXACT_FMA, BM, BN)
    tl.store(mu_ptr + rows * (C // BN) + cols // BN, mu, mask=rows < R)
    if (pid_m == 0) & (pid_n == 0):
        tl.store(new_gs_ptr, gs_m)
        tl.store(new_gs_ptr + 1, gs_v)


def _rows_per_program(R, T, elements):
    """BM: ~`elements` per program (a power of two; the last program's rows past R are masked)."""
    return min(max(1, elements // T), triton.next_power_of_2(R))


def fused_adamw_step(p, g, state, lr, beta1, beta2, eps, weight_decay, step, seed, floor=None,
                     elements_per_program=2048, num_warps=4):
    """One QuantizedAdamW step on p (R, C) fp32 with optim.py's packed "pipeline" state (keys m.codes,
    m.scales, m.global_scale, v.codes, v.scales, v.global_scale, v.tile_mean), updated in place.
    elements_per_program / num_warps: launch shape (bench_optim.py sweeps them; results do not depend on it)."""
    import torch
    import optim
    if p.dtype != torch.float32 or p.dim() != 2 or not p.is_contiguous():
        raise ValueError(f"fused_adamw_step: p must be a contiguous 2-D fp32 tensor, got {p.dtype} {tuple(p.shape)}")
    g = g.contiguous()
    R, C = p.shape
    T = C // state["v.tile_mean"].shape[-1]
    BM = _rows_per_program(R, T, elements_per_program)
    floor = optim.FLOOR_FRACTION if floor is None else floor
    old_gs = torch.stack((state["m.global_scale"], state["v.global_scale"])).float()
    scalars = (1 - lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2, (1 - beta2 ** step) ** 0.5, eps,
               lr / (1 - beta1 ** step))
    ms, vs = state["m.scales"].view(torch.uint8), state["v.scales"].view(torch.uint8)
    grid = (triton.cdiv(R, BM), C // T)
    tensors = (p, g, state["m.codes"], ms, state["v.codes"], vs, state["v.tile_mean"], old_gs)
    partial = torch.empty(2 * grid[0] * grid[1], device=p.device, dtype=torch.float32)
    _amax_pass[grid](*tensors, partial, R, C, *scalars, FLOOR=floor, BM=BM, BN=T, LOG2_BN=T.bit_length() - 1,
                     num_warps=num_warps, enable_fp_fusion=False)
    amax = partial.view(-1, 2).amax(0)
    new_gs = torch.empty(2, device=p.device, dtype=torch.float32)
    _update_pass[grid](*tensors, amax, new_gs, R, C, int(seed), *scalars, FLOOR=floor, BM=BM, BN=T, LOG2_BN=T.bit_length() - 1,
                       EXACT_FMA=_exact_fma(), num_warps=num_warps, enable_fp_fusion=False)
    state["m.global_scale"], state["v.global_scale"] = new_gs[0].clone(), new_gs[1].clone()
