"""
Triton NVFP4 quantization (paper §2; DESIGN.md "NVFP4 conventions"): one pass that reads bf16/fp32 and
writes packed E2M1 codes + E4M3 block scales, for 1x16, 16x1 and 16x16 blocks, RTN or SR, optional 4/6,
optional fused 16-point (random) Hadamard rotation. Plus `quantize_dequant` (writes q * s_b in bf16, exactly
on the grid, for the cuBLAS GEMM route) and `dequantize` (packed -> dense in one pass).

It reproduces the reference `nvfp4._quantize_reference` (the spec) bit for bit:
  s_g = amax / (448 * 6)                     correctly rounded fp32 division (torch on CPU; see the note below)
  s_b = e4m3(min(amax_b / 6 / s_g, 448))     two correctly rounded divisions (tl.div_rn), then RNE to E4M3 with
                                             explicit arithmetic (the interpreter's fp32->fp8 cast is wrong on ties)
  a   = min(|x| / (s_b * s_g), 6)            the product rounded to fp32 first, then a correctly rounded
                                             division (one reciprocal per block + Markstein's fma step)
  q   = RTN ties-to-even on the E2M1 grid, or SR: up with probability (a - lo) / (hi - lo)
  sign = x < 0                               (-0.0 gets a + code, as in the reference)
Where it can differ from the reference:
  * SR draws its uniforms from Philox, 4 words per tl.randint4x call (1x16 blocks: counter element index // 4,
    4 neighbours in a row; 16x1 and 16x16 blocks: counter (row // 4) * N + column, 4 neighbours in a column),
    instead of torch's generator: same distribution, not the same numbers. Tests pass the reference's uniforms through
    `noise=` to check the arithmetic bit for bit, and check the Philox path statistically.
  * 4/6 sums the 16 (or 256) squared errors of a block with a fixed pairwise tree (_pairwise_block_sum); it
    equals the reference bit for bit once the reference sums the same way (nvfp4._pairwise_block_sum). With a
    plain torch .sum() the two orders differ in the last bit and ~1e-5 of the blocks pick the other candidate.
  * With `hadamard`, x·H sums 16 exact products; the kernels add them in one fixed butterfly order (_hadamard16,
    the same in every kernel), the reference's torch matmul in its own, so the rotation is bit-exact where it is
    exact (tests use such inputs) and otherwise equal up to an ulp of the rotated value.
Note: torch on CUDA divides by a Python scalar as a multiply by the fp32 reciprocal, so the reference run on a
CUDA tensor can differ from the reference on CPU in the last bit of `amax_b / 6`; this kernel follows the
CPU reference (true division) everywhere, and the GPU tests compare against the reference on CPU.
"""

import os

import torch
import triton
import triton.language as tl

# ----------------------------------------------------------------------------------------------------------
# Device helpers

@triton.jit
def _round_to_e4m3(s):
    """fp32 s in [0, 448] -> (the nearest E4M3 value, ties to even, as fp32; its uint8 bit pattern).
    Rounds to a multiple of the E4M3 quantum at s's binade (2^(e-3), but at least 2^-9 for subnormals) with the
    2^23 magic-number trick, which is exact RNE for 0 <= t < 2^22."""
    bits = s.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 127 - 6)                       # biased fp32 exponent, floored at 2^-6
    quantum = ((e - 3) << 23).to(tl.float32, bitcast=True)             # 2^(e-127-3)
    t = s * ((254 - (e - 3)) << 23).to(tl.float32, bitcast=True)       # s / quantum, exact (a power of two)
    t = (t + 8388608.0) - 8388608.0                                    # RNE to an integer (0..16)
    v = t * quantum
    # E4M3 bit pattern of v: normal (exp >= 1): (biased exp << 3) | top 3 mantissa bits; subnormal: v / 2^-9
    vbits = v.to(tl.int32, bitcast=True)
    ve = (vbits >> 23) & 0xFF
    normal = ((ve - 120) << 3) | ((vbits >> 20) & 7)
    sub = (v * 512.0).to(tl.int32)
    code = tl.where(ve >= 127 - 6, normal, sub)
    return v, code.to(tl.uint8)


@triton.jit
def _rtn_e2m1(a):
    """Index 0..7 of the nearest E2M1 magnitude for a in [0, 6], ties to the even index (nvfp4.rtn_e2m1), from
    a's fp32 bits instead of a compare tree (7 instructions instead of ~16). For a >= 1 the E2M1 code is the
    fp32 exponent and the top mantissa bit: round the mantissa to one bit, ties to even (the carry of 1.75 -> 2
    moves into the exponent), and (bits >> 22) - (126 << 1) is the index (1.0 -> 2, 6.0 -> 7; a <= 6 cannot round
    past 6). Below 1 the grid is 0, 0.5, 1 (quantum 0.5): RNE of 2a with the 2^23 magic number, whose low bits
    are then the index. Both are exact RNE, so the index equals the compare tree's on every fp32 (tested on every
    tie and its neighbours)."""
    bits = a.to(tl.int32, bitcast=True)
    normal = ((bits + 0x1FFFFF + ((bits >> 22) & 1)) >> 22) - 252
    sub = tl.fma(a, 2.0, 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # a * 2 is exact: one rounding either way
    return tl.where(a < 1.0, sub, normal)


@triton.jit
def _div_by(x, den, inv, EXACT_FMA: tl.constexpr):
    """x / den rounded to nearest (what tl.div_rn and torch give) for x >= 0, with inv = RN(1 / den) per block
    (inv = 0 where den == 0, which returns 0 like the reference). On the GPU, Markstein's correction step:
    q = RN(x * inv) is within an ulp, r = x - q * den is exact with an fma, and RN(q + r * inv) is the correctly
    rounded quotient (Markstein 1990; Muller et al., Handbook of Floating-Point Arithmetic, ch. 4): a mul and two
    fmas per element instead of div.rn's reciprocal + refinement. The interpreter's fma rounds twice, so there
    it is tl.div_rn (the GPU tests check the fma path bit for bit at full size)."""
    if EXACT_FMA:
        q = x * inv
        r = tl.fma(q, -den, x)  # the same exact product; -den is per block (-q would be 0 - q per element)
        return tl.fma(r, inv, q)
    else:
        return tl.where(den > 0, tl.div_rn(x, tl.where(den > 0, den, 1.0)), 0.0)


@triton.jit
def _block_scale(block_amax, s_g, MAX_Q: tl.constexpr, EXACT_FMA: tl.constexpr, inv_g=None):
    """A block scale candidate with the block's max mapped to MAX_Q (6; 4 for 4/6's second candidate):
    s_b = e4m3(min(amax_b / MAX_Q / s_g, 448)) (two correctly rounded divisions, RNE to E4M3), its uint8 bits,
    den = s_b * s_g (the elements' divisor, rounded to fp32 first as in the reference) and inv = RN(1 / den) for
    _div_by (0 where den == 0: an all-zero block gives zero codes). The divisors MAX_Q and s_g are the same for
    every block, so both divisions are _div_by's Markstein step on one reciprocal (a division per block costs
    ~4x more: where a thread holds 4 elements of a block, as in the attention kernels' MMA tiles, that mattered).
    s_g > 0 (nvfp4.global_scale gives 1 for an all-zero tensor); inv_g: RN(1 / s_g) if the caller has it."""
    if inv_g is None:
        inv_g = tl.div_rn(1.0, s_g)
    t = _div_by(block_amax, MAX_Q, 1.0 / MAX_Q, EXACT_FMA)   # 1 / MAX_Q: RN(1/6) = 0x3E2AAAAB, 1/4 exact
    t = _div_by(t, s_g, inv_g, EXACT_FMA)
    s, bits = _round_to_e4m3(tl.minimum(t, 448.0))
    den = s * s_g
    inv = tl.where(den > 0, tl.div_rn(1.0, tl.where(den > 0, den, 1.0)), 0.0)
    return s, bits, den, inv


@triton.jit
def _e2m1_bits(top):
    """fp32 q * 2^-126 for E2M1 codes held in bits 31..28 of an int32 (lower bits ignored): an arithmetic shift by
    6 and a mask leave sign, exponent (2 bits) and mantissa (1 bit) where fp32 keeps them (exponent 0 lands in
    fp32's subnormal range: 0.5 -> 2^-127, exactly E2M1's subnormal). Code 8 gives -0.0, as the reference's -q.
    The inverse of _rtn_e2m1's bit trick; callers undo the 2^-126 with exact power-of-two scalings."""
    return ((top >> 6) & -2118123520).to(tl.float32, bitcast=True)                  # 0x81C00000


@triton.jit
def _e2m1_value(idx):
    """E2M1 magnitude of index 0..7: 0, .5, 1, 1.5, 2, 3, 4, 6. idx << 22 is _e2m1_bits' placement of an
    unsigned code, q * 2^-126; the 2^126 scaling is exact (a subnormal needs no flush-to-zero: Triton uses none)."""
    return (idx << 22).to(tl.float32, bitcast=True) * 8.507059173023462e37          # 2^126


@triton.jit
def _decode_codes(code, s_b):
    """E2M1 codes (int32, 0..15) times their block scales s_b (fp32): q * s_b, exact, signed as the reference
    (-0.0 for code 8). q * 2^-126 from the bits (_e2m1_bits), then two exact power-of-two scalings (2^126 * 448
    would overflow in one), instead of an fp8 -> fp32 conversion per element."""
    return (_e2m1_bits(code << 28) * 9.223372036854776e18) * (s_b * 9.223372036854776e18)  # 2^63 each


@triton.jit
def _with_sign(q, x):
    """q >= 0 with x's sign as the reference decodes it (the code's sign bit is x < 0): -q is 0 - q in Triton,
    which turns a negative code's -0.0 into +0.0, so set the fp32 sign bit instead."""
    return (q.to(tl.int32, bitcast=True) | ((x < 0).to(tl.int32) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _sr_e2m1(a, r):
    """Stochastic rounding of a in [0, 6] (nvfp4.sr_e2m1: up to the next grid value iff u < (a - lo) / gap), from
    a's fp32 bits, for the uniform u = (r >> 8) * 2^-24 of 32 random bits r (uint32): torch.rand's fp32 grid, so
    the tests' torch uniforms pass through exactly (_noise_bits). For a >= 1, lo is a with its mantissa cut to
    one bit and (a - lo) / gap = m / 2^22 for the 22 bits m cut off, so u < m / 2^22 <=> (r >> 10) < m: one
    integer compare. At a = 6, m = 0: never up. Below 1 the gap is 0.5: lo = floor(2a) / 2, fraction
    f = 2a - floor(2a) (exact), and u < f <=> float(r >> 8) < f * 2^24 (both sides exact). Same decisions as the
    reference for every torch uniform, so the tests' given uniforms reproduce it bit for bit."""
    bits = a.to(tl.int32, bitcast=True)
    up = (r >> 10).to(tl.int32) < (bits & 0x3FFFFF)
    normal = (bits >> 22) - 252 + up.to(tl.int32)
    t = a * 2.0
    fl = tl.floor(t)
    sub = fl.to(tl.int32) + ((r >> 8).to(tl.float32) < (t - fl) * 16777216.0).to(tl.int32)
    return tl.where(a < 1.0, sub, normal)


@triton.jit
def _noise_bits(u):
    """Given uniforms u = k * 2^-24 (torch.rand's fp32 grid, k < 2^24) -> the 32 random bits _sr_e2m1 reads:
    k << 8, exactly."""
    return (u * 16777216.0).to(tl.uint32) << 8


@triton.jit
def _random_words(seed, rows, n0, N, BM: tl.constexpr, BN: tl.constexpr):
    """(BM, BN) random uint32 words (for _sr_e2m1) for the elements (rows[i], n0 + j) of a row-major tensor with N
    columns: one Philox call (tl.randint4x, 10 rounds) per 4 consecutive elements, counter = element index // 4,
    so a quarter of tl.rand's Philox work (the bulk of an SR quantization's arithmetic) and a draw that does not
    depend on the tiling. Raw bits, not tl.rand's floats: _sr_e2m1 compares integers (no conversion per element).
    n0 and N are multiples of 4 (of 16, in fact)."""
    offs4 = rows[:, None] * (N // 4) + (n0 // 4 + tl.arange(0, BN // 4))[None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, offs4.to(tl.uint32))
    # element 4c + k gets r_k[c]: join(join(r0, r2), join(r1, r3))[.., a, b] = r_(2a + b)
    return tl.join(tl.join(r0, r2), tl.join(r1, r3)).reshape(BM, BN)


@triton.jit
def _column_random_words(seed, offs4):
    """Random words for 16x1 blocks (as _random_words): one Philox call per 4 rows of a column, counter =
    (row // 4) * N + column, word k for row 4i + k (four rows of one column, not four columns of one row as
    _random_words for 1x16 blocks: a kernel holding whole column blocks per thread then uses every word of a call).
    offs4: the counters, any shape S; returns S + (2, 2) with [..., a, b] the word of row offset 2a + b; callers
    permute it into their tiles. The draw depends on (seed, row, column) only, not on the tiling."""
    r0, r1, r2, r3 = tl.randint4x(seed, offs4.to(tl.uint32))
    return tl.join(tl.join(r0, r2), tl.join(r1, r3))


@triton.jit
def _block_random_words(seed, blocks, NB: tl.constexpr):
    """_random_words for whole 1x16 blocks of a flat tensor, as the rows kernel's (NB, 2, 8) tile: the same Philox
    counters (element index // 4 = block * 4 + half * 2 + c) and the same assignment (element 4c + k gets r_k[c]),
    generated in the tile's own arrangement (a reshape of _random_words' (NB, 16) cost a layout shuffle)."""
    offs4 = blocks[:, None, None] * 4 + tl.arange(0, 2)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    r0, r1, r2, r3 = tl.randint4x(seed, offs4.to(tl.uint32))                   # (NB, 2, 2) each
    return tl.join(tl.join(r0, r2), tl.join(r1, r3)).reshape(NB, 2, 8)


@triton.jit
def _pairwise_block_sum(e, GM: tl.constexpr, SBM: tl.constexpr, GN: tl.constexpr, SBN: tl.constexpr):
    """Per-block sum of e (GM, SBM, GN, SBN) -> (GM, GN) as a fixed binary tree: neighbours along the row are
    added pairwise (16 -> 8 -> 4 -> 2 -> 1), then along the column. Every step adds exactly two fp32 values
    (a + b == b + a), so the result does not depend on the compiler's reduction order and equals the reference's
    nvfp4._pairwise_block_sum bit for bit (4/6's error comparison must pick the same candidate)."""
    if SBN == 16:
        e = tl.sum(e.reshape(GM, SBM, GN, 8, 2), axis=4)
        e = tl.sum(e.reshape(GM, SBM, GN, 4, 2), axis=4)
        e = tl.sum(e.reshape(GM, SBM, GN, 2, 2), axis=4)
        e = tl.sum(e.reshape(GM, SBM, GN, 1, 2), axis=4)
    e = e.reshape(GM, SBM, GN)
    if SBM == 16:
        e = tl.sum(e.reshape(GM, 8, 2, GN), axis=2)
        e = tl.sum(e.reshape(GM, 4, 2, GN), axis=2)
        e = tl.sum(e.reshape(GM, 2, 2, GN), axis=2)
        e = tl.sum(e.reshape(GM, 1, 2, GN), axis=2)
    return e.reshape(GM, GN)


@triton.jit
def _butterfly_stage(y, P: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, W: tl.constexpr):
    """(P, 16, W): in each of the G groups of 2 * HALF along dim 1, (a, b) -> (a + b, a - b) across its halves."""
    a, b = tl.split(tl.permute(y.reshape(P, G, 2, HALF, W), (0, 1, 3, 4, 2)))         # the pair dim last
    return tl.permute(tl.join(a + b, a - b), (0, 1, 4, 2, 3)).reshape(P, 16, W)


@triton.jit
def _hadamard16(x, h_ptr, P: tl.constexpr, W: tl.constexpr):
    """x (P, 16, W) fp32 -> x . H along dim 1, for H = diag(s) . H16 / 4 (nvfp4.random_hadamard's form: its
    column 0 is s / 4). The products x_i * H_ij are exact (a sign and a power of two), so this is x * H[:, 0]
    then the 4-stage butterfly of Sylvester's H16: 5 operations per element instead of a 16-term dot product.
    One fixed order of additions in every kernel that rotates (quantize passes and amax pre-passes see the same
    bits); the reference's matmul sums the same products in its own order: equal where the sums are exact, else
    within an ulp of the rotated value."""
    y = x * tl.load(h_ptr + tl.arange(0, 16) * 16)[None, :, None]
    y = _butterfly_stage(y, P, 1, 8, W)
    y = _butterfly_stage(y, P, 2, 4, W)
    y = _butterfly_stage(y, P, 4, 2, W)
    return _butterfly_stage(y, P, 8, 1, W)


@triton.jit
def _rotate(x, h_ptr, BM: tl.constexpr, BN: tl.constexpr, HAD_DIM: tl.constexpr):
    """fp32 (BM, BN) tile. HAD_DIM 1: x·H on groups of 16 along the columns; 2: H^T·x on groups of 16 along the
    rows (the reference's hadamard_transform with dim=-1 / -2; H^T x = x'H column-wise); 0: x unchanged."""
    x = x.to(tl.float32)
    if HAD_DIM == 1:
        x = _hadamard16(x.reshape(BM * BN // 16, 16, 1), h_ptr, BM * BN // 16, 1).reshape(BM, BN)
    elif HAD_DIM == 2:
        x = _hadamard16(x.reshape(BM // 16, 16, BN), h_ptr, BM // 16, BN).reshape(BM, BN)
    return x


@triton.jit
def _load_tile(x_ptr, h_ptr, pid_b, m0, n0, M, N, stride_xb, stride_xm, stride_xn,
               BM: tl.constexpr, BN: tl.constexpr, HAD_DIM: tl.constexpr):
    """(BM, BN) fp32 tile of a dense (strided) x, zeros outside, optionally rotated (_rotate)."""
    offs_m = m0 + tl.arange(0, BM)
    offs_n = n0 + tl.arange(0, BN)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = x_ptr + pid_b.to(tl.int64) * stride_xb + offs_m[:, None].to(tl.int64) * stride_xm \
        + offs_n[None, :].to(tl.int64) * stride_xn
    x = tl.load(ptrs, mask=mask, other=0.0)
    return _rotate(x, h_ptr, BM, BN, HAD_DIM), offs_m, offs_n, mask


@triton.jit
def _round_to_bf16(v):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32. Explicit because the interpreter's
    fp32 -> bf16 cast truncates. Finite inputs."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _amax_kernel(x_ptr, h_ptr, part_ptr, M, N, stride_xb, stride_xm, stride_xn,
                 BM: tl.constexpr, BN: tl.constexpr, HAD_DIM: tl.constexpr, PLAIN_TOO: tl.constexpr):
    """Per-program max |x| (of the rotated x if HAD_DIM): the global amax is the max of these partials.
    Same rotation code as the quantize pass, so both see bit-identical rotated values. PLAIN_TOO: also the
    unrotated max |x|, stored after the rotated partials (one read of x for both global amaxes)."""
    pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # rows on axis 0: no 65535 cap
    x, _, _, _ = _load_tile(x_ptr, h_ptr, pid_b, pid_m * BM, pid_n * BN, M, N, stride_xb, stride_xm, stride_xn,
                            BM, BN, 0)                                           # fp32, not rotated
    n_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    pid = (pid_b * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_m
    if PLAIN_TOO:
        tl.store(part_ptr + n_programs + pid, tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    x = _rotate(x, h_ptr, BM, BN, HAD_DIM)
    tl.store(part_ptr + pid, tl.max(tl.max(tl.abs(x), axis=1), axis=0))


# seed: not specialized. Triton specializes int arguments on "== 1" and "% 16 == 0"; with a fresh random seed
# per call that recompiled the SR kernels whenever a seed first fell into a new class (0.3-0.6 s each): the
# "672 ms" NVFP4Linear(4/6) fwd+bwd of bench_lora_svd (its do_bench estimate saw the compiles).
@triton.jit(do_not_specialize=["seed"])
def _quantize_kernel(x_ptr, h_ptr, noise_ptr, amax_ptr, gs_out_ptr, codes_ptr, scales_ptr,
                     values_ptr, M, N, stride_xb, stride_xm, stride_xn, seed,
                     BM: tl.constexpr, BN: tl.constexpr, SBM: tl.constexpr, SBN: tl.constexpr,
                     FP8_BOUND: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, SR: tl.constexpr,
                     USE_NOISE: tl.constexpr, HAD_DIM: tl.constexpr,
                     WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr, EXACT_FMA: tl.constexpr):
    """One (BM, BN) tile: block amax -> E4M3 block scale -> E2M1 codes (packed 2/byte, even element low) and/or
    bf16 values q * s_b. Blocks are (SBM, SBN) = (1, 16), (16, 1) or (16, 16)."""
    pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # rows on axis 0: no 65535 cap
    m0, n0 = pid_m * BM, pid_n * BN
    x, offs_m, offs_n, mask = _load_tile(x_ptr, h_ptr, pid_b, m0, n0, M, N, stride_xb, stride_xm, stride_xn,
                                         BM, BN, HAD_DIM)
    # global scale s_g = amax / (bound * 6), 1 when amax == 0 (nvfp4.global_scale)
    amax = tl.load(amax_ptr).to(tl.float32)  # fp32, or bf16 straight from torch's amax of a bf16 x (exact)
    s_g = tl.where(amax > 0, tl.div_rn(amax, FP8_BOUND * 6.0), 1.0)
    if (pid_m == 0) & (pid_n == 0) & (pid_b == 0):  # the tensor's s_g for the host: no extra torch kernels
        tl.store(gs_out_ptr, s_g)

    ax = tl.abs(x)
    xb = ax.reshape(BM // SBM, SBM, BN // SBN, SBN)                    # (bm-groups, bm, bn-groups, bn)
    block_amax = tl.max(tl.max(xb, axis=3), axis=1)                    # (BM // SBM, BN // SBN)

    # candidate "max -> 6": s_b = e4m3(min(amax_b / 6 / s_g, 448)); a = min(|x| / (s_b * s_g), 6)
    s6, bits6, den6, inv6 = _block_scale(block_amax, s_g, 6.0, EXACT_FMA)
    den6, inv6 = den6[:, None, :, None], inv6[:, None, :, None]
    a6 = tl.minimum(_div_by(xb, den6, inv6, EXACT_FMA), 6.0)
    a = a6
    s_b = s6
    bits = bits6
    if FOUR_OVER_SIX:
        # 4/6 (paper §2, DESIGN.md): also try "max -> 4" (its own E4M3 rounding of amax_b / 4 / s_g) and keep
        # the candidate whose RTN reconstruction has the lower squared error, ties to 6.
        s4, bits4, den4, inv4 = _block_scale(block_amax, s_g, 4.0, EXACT_FMA)
        den4, inv4 = den4[:, None, :, None], inv4[:, None, :, None]
        a4 = tl.minimum(_div_by(xb, den4, inv4, EXACT_FMA), 6.0)
        i6, i4 = _rtn_e2m1(a6), _rtn_e2m1(a4)
        d6 = _e2m1_value(i6) * den6 - xb
        d4 = _e2m1_value(i4) * den4 - xb
        err6 = _pairwise_block_sum(d6 * d6, BM // SBM, SBM, BN // SBN, SBN)
        err4 = _pairwise_block_sum(d4 * d4, BM // SBM, SBM, BN // SBN, SBN)
        use4 = err4 < err6
        s_b = tl.where(use4, s4, s6)
        bits = tl.where(use4, bits4, bits6)
        a = tl.where(use4[:, None, :, None], a4, a6)
        rtn_idx = tl.where(use4[:, None, :, None], i4, i6)                # = _rtn_e2m1(a), already computed

    if SR:
        if USE_NOISE:  # the reference's uniforms (tests): noise has x's logical shape, contiguous
            nptrs = noise_ptr + (pid_b.to(tl.int64) * M + offs_m[:, None]) * N + offs_n[None, :]
            rand = _noise_bits(tl.load(nptrs, mask=mask, other=0.0))
        else:
            if SBM == 16:  # 16x1 and 16x16 blocks: four rows of a column per Philox call (_column_random_words)
                quad = (pid_b.to(tl.int64) * M + m0) // 4 + tl.arange(0, BM // 4)                 # BM % 16 == 0
                rand = _column_random_words(seed, quad[:, None] * N + offs_n[None, :])       # (BM / 4, BN, 2, 2)
                rand = tl.permute(rand, (0, 2, 3, 1)).reshape(BM, BN)
            else:  # counter-based: independent of the tiling
                rand = _random_words(seed, pid_b * M + offs_m, n0, N, BM, BN)
        idx = _sr_e2m1(a, rand.reshape(BM // SBM, SBM, BN // SBN, SBN))
    elif FOUR_OVER_SIX:
        idx = rtn_idx
    else:
        idx = _rtn_e2m1(a)
    idx = idx.reshape(BM, BN)

    if WRITE_CODES:
        code = (idx | ((x < 0).to(tl.int32) << 3)).to(tl.uint8)
        lo, hi = tl.split(code.reshape(BM, BN // 2, 2))                # even / odd elements along the row
        packed = lo | (hi << 4)
        offs_c = n0 // 2 + tl.arange(0, BN // 2)
        cptrs = codes_ptr + (pid_b.to(tl.int64) * M + offs_m[:, None]) * (N // 2) + offs_c[None, :]
        tl.store(cptrs, packed, mask=(offs_m[:, None] < M) & (offs_c[None, :] < N // 2))
        offs_sm = m0 // SBM + tl.arange(0, BM // SBM)
        offs_sn = n0 // SBN + tl.arange(0, BN // SBN)
        sptrs = scales_ptr + (pid_b.to(tl.int64) * (M // SBM) + offs_sm[:, None]) * (N // SBN) + offs_sn[None, :]
        tl.store(sptrs, bits, mask=(offs_sm[:, None] < M // SBM) & (offs_sn[None, :] < N // SBN))
    if WRITE_VALUES:
        # q * s_b: at most 6 significant bits and within bf16's range, so the bf16 store is exact
        q = _e2m1_value(idx).reshape(BM // SBM, SBM, BN // SBN, SBN) * s_b[:, None, :, None]
        q = _with_sign(q.reshape(BM, BN), x)
        vptrs = values_ptr + (pid_b.to(tl.int64) * M + offs_m[:, None]) * N + offs_n[None, :]
        tl.store(vptrs, q.to(tl.bfloat16), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _quantize_rows_kernel(x_ptr, h_ptr, noise_ptr, amax_ptr, gs_out_ptr, codes_ptr, scales_ptr, values_ptr, part_ptr,
                          n_blocks, seed, NB: tl.constexpr, CHUNKS: tl.constexpr, UNROLL: tl.constexpr,
                          FP8_BOUND: tl.constexpr,
                          FOUR_OVER_SIX: tl.constexpr, SR: tl.constexpr, USE_NOISE: tl.constexpr,
                          HADAMARD: tl.constexpr, WRITE_CODES: tl.constexpr, WRITE_VALUES: tl.constexpr,
                          EXACT_FMA: tl.constexpr, AMAX_ONLY: tl.constexpr):
    """_quantize_kernel's arithmetic for the common case, 1x16 blocks of a contiguous x: CHUNKS chunks of NB
    consecutive blocks per program, each held as an (NB, 2, 8) tile (the two 8-element halves of each block) so that
    the compiler puts one block on each thread: both halves of a block in one thread's registers, its amax, scale
    and division constants computed once (with the blocks as (NB, 16) rows a block spanned two threads, which both
    computed its scale), its 16 codes stored as two int32 words (8 codes each, element 0 in the low nibble:
    little-endian, the same bytes) without a shared-memory shuffle. The chunk loop (unrolled UNROLL times) issues the
    next chunk's load before this chunk's arithmetic (the kernel is instruction-bound: the loads' latency hides
    behind it), and the global scale's two divisions are done once per program, not once per chunk. Same results bit for
    bit (same operations per element; SR: the same Philox counters, element index // 4). AMAX_ONLY: the
    global-amax pre-pass over the same (rotated) values."""
    pid = tl.program_id(0)
    blk = tl.arange(0, NB)
    # (NB, 2, 8): the halves' dim after the blocks' dim, so Triton's coalescing (dims ordered by contiguity, ties by
    # index) spreads the blocks over the threads and keeps both halves of a block in one thread
    half = tl.arange(0, 2)[None, :, None]
    offs = blk[:, None, None] * 16 + half * 8 + tl.arange(0, 8)[None, None, :]  # (NB, 2, 8) int32: element offsets
    first = pid.to(tl.int64) * (NB * CHUNKS)                                     # first block of this program
    if not AMAX_ONLY:
        amax = tl.load(amax_ptr).to(tl.float32)  # fp32, or bf16 from torch's amax of a bf16 x (exact)
        s_g = tl.where(amax > 0, tl.div_rn(amax, FP8_BOUND * 6.0), 1.0)
        inv_g = tl.div_rn(1.0, s_g)
        if pid == 0:
            tl.store(gs_out_ptr, s_g)
    else:
        run_max = tl.zeros((NB,), dtype=tl.float32)
    x_next = tl.load(x_ptr + first * 16 + offs, mask=(blk < n_blocks - first)[:, None, None], other=0.0)
    for c in tl.range(0, CHUNKS, loop_unroll_factor=UNROLL):
        base = first + c * NB
        bmask = blk < n_blocks - base
        mask = bmask[:, None, None]
        x = x_next.to(tl.float32)
        # prefetch the next chunk (none after the last: an all-false mask moves no data)
        x_next = tl.load(x_ptr + (base + NB) * 16 + offs, other=0.0,
                         mask=((blk < n_blocks - base - NB) & (c + 1 < CHUNKS))[:, None, None])
        if HADAMARD:  # x . H on each block (the reference's hadamard_transform(x, H, dim=-1))
            x = _hadamard16(x.reshape(NB, 16, 1), h_ptr, NB, 1).reshape(NB, 2, 8)
        ax = tl.abs(x)
        block_amax = tl.max(tl.max(ax, axis=2), axis=1)                             # (NB,)
        if AMAX_ONLY:  # (an else branch, not an early return: Triton would still compile the rest for this launch)
            run_max = tl.maximum(run_max, block_amax)
        else:
            s_b, bits, den, inv = _block_scale(block_amax, s_g, 6.0, EXACT_FMA, inv_g)
            a = tl.minimum(_div_by(ax, den[:, None, None], inv[:, None, None], EXACT_FMA), 6.0)
            if FOUR_OVER_SIX:  # as in _quantize_kernel: the "max -> 4" candidate wins on a lower RTN error, ties to 6
                s4, bits4, den4, inv4 = _block_scale(block_amax, s_g, 4.0, EXACT_FMA, inv_g)
                a4 = tl.minimum(_div_by(ax, den4[:, None, None], inv4[:, None, None], EXACT_FMA), 6.0)
                i6, i4 = _rtn_e2m1(a), _rtn_e2m1(a4)
                d6 = _e2m1_value(i6) * den[:, None, None] - ax
                d4 = _e2m1_value(i4) * den4[:, None, None] - ax
                use4 = _half_pair_sum(d4 * d4, NB) < _half_pair_sum(d6 * d6, NB)
                s_b = tl.where(use4, s4, s_b)
                bits = tl.where(use4, bits4, bits)
                a = tl.where(use4[:, None, None], a4, a)
                rtn_idx = tl.where(use4[:, None, None], i4, i6)                      # = _rtn_e2m1(a), already computed
            if SR:
                if USE_NOISE:
                    rand = _noise_bits(tl.load(noise_ptr + base * 16 + offs, mask=mask, other=0.0))
                else:  # the flat tensor as rows of 16 elements: the same counters (element index // 4)
                    rand = _block_random_words(seed, base + blk, NB)
                idx = _sr_e2m1(a, rand)
            elif FOUR_OVER_SIX:
                idx = rtn_idx
            else:
                idx = _rtn_e2m1(a)
            if WRITE_CODES:
                code = idx | ((x < 0).to(tl.int32) << 3)
                words = tl.sum(code << (tl.arange(0, 8) * 4)[None, None, :], axis=2)                  # (NB, 2)
                tl.store(codes_ptr + base * 2 + blk[:, None] * 2 + tl.arange(0, 2)[None, :], words,
                         mask=bmask[:, None])
                tl.store(scales_ptr + base + blk, bits, mask=bmask)
            if WRITE_VALUES:
                q = _with_sign(_e2m1_value(idx) * s_b[:, None, None], x)
                tl.store(values_ptr + base * 16 + offs, q.to(tl.bfloat16), mask=mask)
    if AMAX_ONLY:
        tl.store(part_ptr + pid, tl.max(run_max, axis=0))


@triton.jit(do_not_specialize=["seed"])
def _quantize_cols_kernel(x_ptr, xs_ptr, xgs_ptr, h_ptr, noise_ptr, amax_ptr, gs_out_ptr, codes_ptr, scales_ptr,
                          values_ptr, part_ptr, M, N, stride_xb, stride_xm, seed, C: tl.constexpr,
                          FP8_BOUND: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, SR: tl.constexpr,
                          USE_NOISE: tl.constexpr, HADAMARD: tl.constexpr, WRITE_CODES: tl.constexpr,
                          WRITE_VALUES: tl.constexpr, EXACT_FMA: tl.constexpr, AMAX_ONLY: tl.constexpr,
                          PLAIN_TOO: tl.constexpr, PACKED_X: tl.constexpr, X_BF16: tl.constexpr):
    """_quantize_kernel's arithmetic for 16x1 blocks of a row-major x (eq. 2's wgrad operands, Q16x1(H^T dY) and
    Q16x1(H^T X-hat)): a (16, 2C) tile held as (C, 16, 2), i.e. each thread holds two whole column blocks (16 rows
    x 2 adjacent columns: 4-byte loads, 128 bytes per row and warp, one code byte per row). So the rotation H^T x
    is a butterfly in registers, a block's amax needs no shuffle and its scale is computed once; in the (16, BN)
    tile kernel a column block spanned several threads, which each recomputed its scale. (Four columns per thread
    needed 255 registers: 8 warps per SM, slower than the tile kernel.) Same results bit for bit as the tile
    kernel (same operations per element, same Philox counters: _column_random_words). AMAX_ONLY: the global-amax
    pre-pass over the same rotated values (with PLAIN_TOO also max |x|, stored after the rotated partials: dY's
    two global amaxes in one read).
    PACKED_X: x is a packed 1x16 NVFP4 tensor (codes at x_ptr, E4M3 scales at xs_ptr, global scale at xgs_ptr),
    decoded in registers to exactly the values its dequantize() gives (bf16-rounded with X_BF16): eq. 2's
    Q16x1(H^T Q1x16(X)) straight from the forward's saved Q1x16(X), without writing and re-reading X-hat."""
    pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # rows on axis 0: no 65535 cap
    m0, n0 = pid_m * 16, pid_n * (2 * C)
    pair = tl.arange(0, C)[:, None, None]
    row = tl.arange(0, 16)[None, :, None]
    col = n0 + pair * 2 + tl.arange(0, 2)[None, None, :]                               # (C, 1, 2)
    mask = (col < N) & (row < 16)                                                      # (C, 16, 2)
    rows = pid_b.to(tl.int64) * M + m0 + row                                           # row index in (B * M, N)
    if PACKED_X:  # (q * s_b) * s_g rounded as NVFP4Tensor.dequantize / _dequantize_rows_kernel round it
        byte = n0 // 2 + pair                                                          # (C, 1, 1): columns 2c, 2c+1
        c8 = tl.load(x_ptr + rows * (N // 2) + byte, mask=(byte < N // 2) & (row < 16), other=0)   # (C, 16, 1)
        code = tl.join(c8 & 0xF, c8 >> 4).reshape(C, 16, 2).to(tl.int32)                 # even column: low nibble
        sblk = (n0 + pair * 2) // 16                                                   # (C, 1, 1)
        s_x = tl.load(xs_ptr + rows * (N // 16) + sblk, mask=(sblk < N // 16) & (row < 16), other=0)
        x = _decode_codes(code, s_x.to(tl.float8e4nv, bitcast=True).to(tl.float32)) * tl.load(xgs_ptr)
        if X_BF16:
            x = _round_to_bf16(x)
    else:
        x = tl.load(x_ptr + pid_b.to(tl.int64) * stride_xb + (m0 + row).to(tl.int64) * stride_xm + col, mask=mask,
                    other=0.0).to(tl.float32)
    xr = _hadamard16(x, h_ptr, C, 2) if HADAMARD else x                               # H^T x along the rows
    ax = tl.abs(xr)
    if AMAX_ONLY:
        n_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        pid = (pid_b * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_m
        if PLAIN_TOO:
            tl.store(part_ptr + n_programs + pid, tl.max(tl.max(tl.max(tl.abs(x), axis=2), axis=1), axis=0))
        tl.store(part_ptr + pid, tl.max(tl.max(tl.max(ax, axis=2), axis=1), axis=0))
    else:
        amax = tl.load(amax_ptr).to(tl.float32)  # fp32, or bf16 from torch's amax of a bf16 x (exact)
        s_g = tl.where(amax > 0, tl.div_rn(amax, FP8_BOUND * 6.0), 1.0)
        if (pid_m == 0) & (pid_n == 0) & (pid_b == 0):
            tl.store(gs_out_ptr, s_g)
        block_amax = tl.max(ax, axis=1)                                                # (C, 2)
        s_b, bits, den, inv = _block_scale(block_amax, s_g, 6.0, EXACT_FMA)
        a = tl.minimum(_div_by(ax, den[:, None, :], inv[:, None, :], EXACT_FMA), 6.0)
        if FOUR_OVER_SIX:  # as in _quantize_kernel: the "max -> 4" candidate wins on a lower RTN error, ties to 6
            s4, bits4, den4, inv4 = _block_scale(block_amax, s_g, 4.0, EXACT_FMA)
            a4 = tl.minimum(_div_by(ax, den4[:, None, :], inv4[:, None, :], EXACT_FMA), 6.0)
            i6, i4 = _rtn_e2m1(a), _rtn_e2m1(a4)
            d6 = _e2m1_value(i6) * den[:, None, :] - ax
            d4 = _e2m1_value(i4) * den4[:, None, :] - ax
            use4 = _column_pair_sum(d4 * d4, C) < _column_pair_sum(d6 * d6, C)
            s_b = tl.where(use4, s4, s_b)
            bits = tl.where(use4, bits4, bits)
            a = tl.where(use4[:, None, :], a4, a)
            rtn_idx = tl.where(use4[:, None, :], i4, i6)                         # = _rtn_e2m1(a), already computed
        if SR:
            if USE_NOISE:  # the reference's uniforms (tests): x's logical shape, contiguous
                rand = _noise_bits(tl.load(noise_ptr + rows * N + col, mask=mask, other=0.0))
            else:
                quad = (pid_b.to(tl.int64) * M + m0) // 4 + tl.arange(0, 4)[None, :, None]      # (1, 4, 1)
                rand = _column_random_words(seed, quad * N + col)                            # (C, 4, 2, 2, 2)
                rand = tl.permute(rand, (0, 1, 3, 4, 2)).reshape(C, 16, 2)              # row 4i + 2a + b
            idx = _sr_e2m1(a, rand)
        elif FOUR_OVER_SIX:
            idx = rtn_idx
        else:
            idx = _rtn_e2m1(a)
        if WRITE_CODES:
            code = idx | ((xr < 0).to(tl.int32) << 3)
            lo, hi = tl.split(code)                                                    # even / odd column: (C, 16)
            tl.store(codes_ptr + rows.reshape(1, 16) * (N // 2) + (n0 // 2 + pair.reshape(C, 1)),
                     (lo | (hi << 4)).to(tl.uint8), mask=(n0 // 2 + pair.reshape(C, 1)) < N // 2)
            scol = col.reshape(C, 2)
            tl.store(scales_ptr + (pid_b.to(tl.int64) * (M // 16) + pid_m) * N + scol, bits, mask=scol < N)
        if WRITE_VALUES:  # q * s_b, exact in bf16
            q = _with_sign(_e2m1_value(idx) * s_b[:, None, :], xr)
            tl.store(values_ptr + rows * N + col, q.to(tl.bfloat16), mask=mask)


@triton.jit
def _column_pair_sum(e, C: tl.constexpr):
    """(C, 16, 2) squared errors -> (C, 2) sums over each 16x1 block in _pairwise_block_sum's fixed tree for
    SBM == 16: neighbouring rows added pairwise, 16 -> 8 -> 4 -> 2 -> 1."""
    e = tl.sum(e.reshape(C, 8, 2, 2), axis=2)
    e = tl.sum(e.reshape(C, 4, 2, 2), axis=2)
    e = tl.sum(e.reshape(C, 2, 2, 2), axis=2)
    return tl.sum(e.reshape(C, 1, 2, 2), axis=2).reshape(C, 2)


@triton.jit
def _half_pair_sum(e, NB: tl.constexpr):
    """(NB, 2, 8) squared errors -> (NB,) block sums in _pairwise_block_sum's fixed tree: pairwise within each
    half (8 -> 4 -> 2 -> 1), then the two halves (the tree's last step adds elements 0-7's sum to 8-15's)."""
    e = tl.sum(e.reshape(NB, 2, 4, 2), axis=3)
    e = tl.sum(e.reshape(NB, 2, 2, 2), axis=3)
    e = tl.sum(e.reshape(NB, 2, 1, 2), axis=3).reshape(NB, 2)
    return tl.sum(e, axis=1)


@triton.jit
def _dequant_store(v, gs_ptr, out_ptr, offs, mask, APPLY_GLOBAL: tl.constexpr, ROUND_BF16: tl.constexpr):
    if APPLY_GLOBAL:
        v = v * tl.load(gs_ptr)
    if ROUND_BF16:
        v = _round_to_bf16(v)
    tl.store(out_ptr + offs, v.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_rows_kernel(codes_ptr, scales_ptr, gs_ptr, out_ptr, n_blocks, NB: tl.constexpr,
                            APPLY_GLOBAL: tl.constexpr, ROUND_BF16: tl.constexpr):
    """1x16 blocks: NB consecutive blocks per program, each block's 16 codes read as two int32 words (element 0 in
    the low nibble) and its scale read once (the tile kernel gathered a scale per element: one load each)."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * NB
    blk = tl.arange(0, NB)
    bmask = blk < n_blocks - base
    words = tl.load(codes_ptr + base * 2 + blk[:, None] * 2 + tl.arange(0, 2)[None, :], mask=bmask[:, None],
                    other=0)                                                        # (NB, 2) int32
    code = ((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF).reshape(NB, 16)
    s_b = tl.load(scales_ptr + base + blk, mask=bmask, other=0).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    v = _decode_codes(code, s_b[:, None])                                           # (NB, 16)
    _dequant_store(v, gs_ptr, out_ptr + base * 16, blk[:, None] * 16 + tl.arange(0, 16)[None, :],
                   bmask[:, None], APPLY_GLOBAL, ROUND_BF16)


@triton.jit
def _dequantize_kernel(codes_ptr, scales_ptr, gs_ptr, out_ptr, M, N, BN: tl.constexpr, SBN: tl.constexpr,
                       APPLY_GLOBAL: tl.constexpr, ROUND_BF16: tl.constexpr):
    """16-row blocks ((16, 1) or (16, 16)): a (16, BN) tile shares one row of scales, loaded once per column
    (16x1) or once per 16 columns (16x16) and broadcast down the rows."""
    pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)  # rows on axis 0: no 65535 cap
    offs_m = pid_m * 16 + tl.arange(0, 16)
    offs_c = pid_n * (BN // 2) + tl.arange(0, BN // 2)
    cmask = (offs_m[:, None] < M) & (offs_c[None, :] < N // 2)
    c = tl.load(codes_ptr + (pid_b.to(tl.int64) * M + offs_m[:, None]) * (N // 2) + offs_c[None, :], mask=cmask,
                other=0)
    code = tl.join(c & 0xF, c >> 4).reshape(16, BN).to(tl.int32)                   # even element: low nibble
    offs_n = pid_n * BN + tl.arange(0, BN)
    s = tl.load(scales_ptr + (pid_b.to(tl.int64) * (M // 16) + pid_m) * (N // SBN) + offs_n // SBN,
                mask=offs_n < N, other=0)
    v = _decode_codes(code, s.to(tl.float8e4nv, bitcast=True).to(tl.float32)[None, :])
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    _dequant_store(v, gs_ptr, out_ptr, (pid_b.to(tl.int64) * M + offs_m[:, None]) * N + offs_n[None, :], mask,
                   APPLY_GLOBAL, ROUND_BF16)


# ----------------------------------------------------------------------------------------------------------
# Host side

AMAX_DTYPES = (torch.float32, torch.bfloat16)  # global amaxes the kernels read as they are (no conversion op)
TILE_OVERRIDE = None  # (BM, BN, num_warps) for every dense quantize launch; scripts/gpu_diag.py's tile sweep
# (blocks per chunk, num_warps, chunks per program) of _quantize_rows_kernel (1x16 blocks, contiguous x): plain RTN,
# and SR or 4/6 (longer code per element, more registers). H200 sweeps, 8192^2 bf16 (`python bench_nvfp4.py
# --rows_sweep`, results/h200_run9/call2, call3 and call4): RTN 66 us at (128, 4, 4) and (256, 8, 2) against 72-73 us with
# one chunk ((256, 8, 1) was the default; other settings 68-87 us, unsteady between the two runs); SR + Hadamard
# 162-166 us with one chunk, 170-192 us with more (80 registers with one chunk, 128 and a stack with four);
# RTN 4/6 134-137 us with one chunk, 138-173 us with more.
ROWS_LAUNCH = (128, 4, 4)
ROWS_LAUNCH_SR = (128, 4, 1)  # SR or 4/6
ROWS_UNROLL = True  # the chunk loop unrolled (False: a runtime loop, the same prefetch)
DEQUANT_ROWS_LAUNCH = (256, 8)  # (blocks per program, num_warps) of _dequantize_rows_kernel


def _use_rows(x3, block):
    # the rows kernel: 1x16 blocks of a contiguous x (a TILE_OVERRIDE forces the tile kernel: the sweep)
    return tuple(block) == (1, 16) and x3.is_contiguous() and TILE_OVERRIDE is None


COLS_WARPS = 4  # _quantize_cols_kernel: (16, 64 * warps) tiles, 2 column blocks per thread
# Its register cap: uncapped, SR + Hadamard takes 189 registers (2 CTAs of 4 warps per SM); 168 fits 3 without
# spilling (Triton's maxnreg; None: the compiler's choice)
COLS_MAXNREG = 168


def _use_cols(x3, block):
    # the cols kernel: 16x1 blocks of a row-major x
    return tuple(block) == (16, 1) and x3.stride(-1) == 1 and TILE_OVERRIDE is None


def _cols_launch(x3, amax, hadamard, noise, four_over_six, seed, rounding="rtn", codes=None, scales=None,
                 values=None, gs_out=None, amax_only=False, plain_too=False, source_dtype=None):
    """Launch _quantize_cols_kernel over x3: a (B, M, N) tensor, or a packed 1x16 nvfp4.NVFP4Tensor read as its
    dequantize(source_dtype) values. amax_only: returns (max |H^T x|,) or with plain_too (max |H^T x|, max |x|)."""
    packed = not torch.is_tensor(x3)
    if packed:
        M, N = x3.shape[-2:]
        B = x3.codes.numel() // (M * N // 2)
        x, xs, xgs = x3.codes.contiguous(), x3.scales.contiguous().view(torch.uint8), x3.global_scale.reshape(1)
        stride_b, stride_m = 0, 0  # unused: packed rows are contiguous
    else:
        (B, M, N), x, xs, xgs = x3.shape, x3, None, None
        stride_b, stride_m = x3.stride(0), x3.stride(1)
    C = 32 * COLS_WARPS
    grid = (M // 16, triton.cdiv(N, 2 * C), B)
    n = grid[0] * grid[1] * grid[2]
    partial = torch.empty((2 if plain_too else 1) * n, device=x.device, dtype=torch.float32) if amax_only else None
    dummy = partial if amax_only else gs_out  # an fp32 tensor for unused pointers
    _quantize_cols_kernel[grid](
        x, xs if packed else dummy, xgs if packed else dummy, hadamard if hadamard is not None else dummy,
        noise if noise is not None else dummy, amax if amax is not None else dummy,
        gs_out if gs_out is not None else dummy, codes if codes is not None else dummy,
        scales if scales is not None else dummy, values if values is not None else dummy,
        partial if partial is not None else dummy, M, N, stride_b, stride_m, int(seed),
        C=C, FP8_BOUND=256.0 if four_over_six else 448.0, FOUR_OVER_SIX=bool(four_over_six), SR=rounding == "sr",
        USE_NOISE=noise is not None, HADAMARD=hadamard is not None, WRITE_CODES=codes is not None,
        WRITE_VALUES=values is not None, EXACT_FMA=_exact_fma(), AMAX_ONLY=amax_only, PLAIN_TOO=plain_too,
        PACKED_X=packed, X_BF16=source_dtype == torch.bfloat16, num_warps=COLS_WARPS, maxnreg=COLS_MAXNREG,
        enable_fp_fusion=False)
    return partial.view(-1, n).amax(1).unbind() if amax_only else None


def _tiles(block, x):
    """Tile shape: 16 rows keeps every block shape whole. From the H200 sweep of 13 tiles (scripts/gpu_diag.py,
    16384 x 4096 bf16, results/h200_run3/g0_diag.log): 16 x 128 on 4 warps is the fastest for 1-D blocks (RTN
    142 us, 4/6 285 us vs 341 us at 16 x 256, SR + Hadamard 506 us vs 588 us), 16 x 256 for 16 x 16 blocks
    (132 us vs 144 us). For inputs contiguous along rows instead (a transposed view such as dY.t()), 64 x 64 tiles
    keep the column reads at 128 bytes."""
    if TILE_OVERRIDE is not None:
        return TILE_OVERRIDE
    if x.stride(-1) != 1 and x.stride(-2) == 1:
        return 64, 64, 4
    return (16, 256, 4) if tuple(block) == (16, 16) else (16, 128, 4)


def _check_options(block, rounding, hadamard, device, name):
    """-> block as a tuple, the Hadamard's dim (0: none, 1: along rows' 16-element blocks, 2: along columns') and
    the Hadamard as contiguous fp32 on device."""
    block = tuple(block)
    if rounding not in ("rtn", "sr"):
        raise ValueError(f"{name}: rounding must be 'rtn' or 'sr', got {rounding!r}")
    had_dim = 0
    if hadamard is not None:
        if block == (16, 16):
            raise ValueError(f"{name}: a Hadamard rotation needs a 1-D block, (1, 16) or (16, 1)")
        if tuple(hadamard.shape) != (16, 16):
            raise ValueError(f"{name}: hadamard must be a (16, 16) matrix, got {tuple(hadamard.shape)}")
        had_dim = 1 if block == (1, 16) else 2
        hadamard = hadamard.to(device=device, dtype=torch.float32).contiguous()
    return block, had_dim, hadamard


def _prepare(x, block, rounding, hadamard, name):
    """Checks (shared with the reference: same messages) -> x as (B, M, N), block, the Hadamard's dim (0: none,
    1: along rows' 16-element blocks, 2: along columns') and the Hadamard as fp32."""
    import nvfp4
    block, had_dim, hadamard = _check_options(block, rounding, hadamard, x.device, name)
    nvfp4._check(x, block, name)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: expected an fp32/bf16/fp16 tensor, got {x.dtype}")
    M, N = x.shape[-2:]
    if x.dtype == torch.float16:
        x = x.float()
    x3 = x.reshape(-1, M, N)  # a view when the leading dims allow (keeps dY.t()'s strides), else a copy
    return x3, block, had_dim, hadamard


def _exact_fma():
    # Markstein division needs a true fma (the GPU); NANOFP4_DIV_RN=1 forces tl.div_rn there too
    return os.environ.get("TRITON_INTERPRET") != "1" and os.environ.get("NANOFP4_DIV_RN", "0") != "1"


def _global_amax(x3, hadamard, had_dim, tiles):
    """max |x| (of x·H when rotating): one read of x, per-program partial maxima, then a tiny torch max. Without
    a rotation in x's dtype (exact: a maximum of x's values; the kernels read either dtype)."""
    if had_dim == 0:  # max |x| without an |x| temporary
        return torch.linalg.vector_norm(x3, ord=float("inf"))
    if _use_rows(x3, (1, 16) if had_dim == 1 else (16, 1)):  # the quantize kernel's own pass over x
        return _rows_launch(x3, None, hadamard, None, False, 0, amax_only=True)
    if _use_cols(x3, (16, 1) if had_dim == 2 else (1, 16)):
        return _cols_launch(x3, None, hadamard, None, False, 0, amax_only=True)[0]
    return _amax_launch(x3, hadamard, had_dim, tiles, plain_too=False)[0]


def _amax_launch(x3, hadamard, had_dim, tiles, plain_too):
    """_amax_kernel over x3 -> (max |x H|,) or with plain_too (max |x H|, max |x|). Every kernel rotates with
    the same butterfly (_hadamard16), so any kernel and tiling gives the quantize pass's maximum."""
    B, M, N = x3.shape
    BM, BN, warps = tiles
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN), B)
    n = grid[0] * grid[1] * grid[2]
    partial = torch.empty((2 if plain_too else 1) * n, device=x3.device, dtype=torch.float32)
    _amax_kernel[grid](x3, hadamard, partial, M, N, x3.stride(0), x3.stride(1), x3.stride(2),
                       BM=BM, BN=BN, HAD_DIM=had_dim, PLAIN_TOO=plain_too,
                       num_warps=warps)
    return partial.view(-1, n).amax(1).unbind()


def global_amax_pair(x, hadamard, name="x"):
    """(max |x|, max |H^T x| over groups of 16 rows) of a 2-D x in one read: the global amaxes of Q1x16(dY) (dX)
    and of eq. 2's Q16x1(H^T dY) (dW), which the backward would otherwise read dY twice for. Each equals what
    quantize(x, ...) computes itself."""
    x3, block, had_dim, hadamard = _prepare(x, (16, 1), "sr", hadamard, name)
    if _use_cols(x3, block):
        rotated, plain = _cols_launch(x3, None, hadamard, None, False, 0, amax_only=True, plain_too=True)
    else:
        rotated, plain = _amax_launch(x3, hadamard, had_dim, _tiles(block, x3), plain_too=True)
    return plain, rotated


def _rows_launch(x3, amax, hadamard, noise, four_over_six, seed, rounding="rtn", codes=None,
                 scales=None, values=None, gs_out=None, amax_only=False):
    """Launch _quantize_rows_kernel over x3's B*M*N/16 blocks (or its amax pre-pass: returns the global amax)."""
    NB, warps, chunks = ROWS_LAUNCH_SR if rounding == "sr" or four_over_six else ROWS_LAUNCH
    unroll = chunks if ROWS_UNROLL else 1
    n_blocks = x3.numel() // 16
    grid = (triton.cdiv(n_blocks, NB * chunks),)
    partial = torch.empty(grid[0], device=x3.device, dtype=torch.float32) if amax_only else None
    dummy = partial if amax_only else gs_out  # an fp32 tensor for unused pointers
    _quantize_rows_kernel[grid](
        x3, hadamard if hadamard is not None else dummy, noise if noise is not None else dummy,
        amax if amax is not None else dummy, gs_out if gs_out is not None else dummy,
        codes.view(torch.int32) if codes is not None else dummy, scales if scales is not None else dummy,
        values if values is not None else dummy, partial if partial is not None else dummy, n_blocks, int(seed),
        NB=NB, CHUNKS=chunks, UNROLL=unroll, FP8_BOUND=256.0 if four_over_six else 448.0,
        FOUR_OVER_SIX=bool(four_over_six), SR=rounding == "sr",
        USE_NOISE=noise is not None, HADAMARD=hadamard is not None,
        WRITE_CODES=codes is not None, WRITE_VALUES=values is not None, EXACT_FMA=_exact_fma(),
        AMAX_ONLY=amax_only, num_warps=warps, enable_fp_fusion=False)  # no FMA contraction, as _quantize_kernel
    return partial.amax() if amax_only else None


# Eq. 2's Q16x1(H^T Q1x16(X)) from the saved packed X: True decodes it inside the cols kernel (no bf16 X-hat
# temporary in the backward: 2 bytes/element less transient memory), False dequantizes it first (one more pass).
# The H200 timed the separate pass faster, 0.302-0.305 vs 0.340-0.342 ms at 8192^2 (bench_nvfp4.py,
# results/h200_run8/call1 and call6: the cols kernel is instruction-bound and the decode adds to it).
READ_PACKED_X = False


def _reads_packed(t, block, noise):
    # the cols kernel decodes a packed 1x16 source in registers (eq. 2's Q16x1(H^T Q1x16(X))); else dequantize first
    return READ_PACKED_X and tuple(t.block) == (1, 16) and tuple(block) == (16, 1) and noise is None \
        and TILE_OVERRIDE is None and t.shape[-2] % 16 == 0


def _run(x, block, rounding, four_over_six, seed, hadamard, global_amax, noise, write_codes, write_values, name,
         source_dtype=torch.bfloat16):
    """Shared host side of quantize / quantize_dequant."""
    import nvfp4  # the NVFP4Tensor container lives with the reference
    packed = isinstance(x, nvfp4.NVFP4Tensor) and _reads_packed(x, block, noise)
    if isinstance(x, nvfp4.NVFP4Tensor) and not packed:
        x = x.dequantize(source_dtype)
    shape = x.shape
    if packed:  # the kernels read x's codes and scales (x3: the NVFP4Tensor itself)
        x3, device = x, x.codes.device
        block, had_dim, hadamard = _check_options(block, rounding, hadamard, device, name)
    else:
        x3, block, had_dim, hadamard = _prepare(x, block, rounding, hadamard, name)
        device = x3.device
    M, N = shape[-2:]
    if global_amax is None and packed:
        global_amax = _cols_launch(x3, None, hadamard, None, False, 0, amax_only=True, source_dtype=source_dtype)[0]
    elif global_amax is None:
        global_amax = _global_amax(x3, hadamard, had_dim, _tiles(block, x3))
    if not (torch.is_tensor(global_amax) and global_amax.device == device and global_amax.dtype in AMAX_DTYPES):
        global_amax = torch.as_tensor(global_amax, dtype=torch.float32, device=device)
    amax = global_amax.reshape(1)
    gs_out = torch.empty((), device=device, dtype=torch.float32)
    if noise is not None:
        if tuple(noise.shape) != tuple(shape):
            raise ValueError(f"{name}: noise must have x's shape {tuple(shape)}, got {tuple(noise.shape)}")
        noise = noise.to(device=device, dtype=torch.float32).contiguous()
    bm, bn = block
    lead = shape[:-2]  # outputs allocated in their final shapes (contiguous: the kernels see (B, M, .) rows)
    codes = torch.empty((*lead, M, N // 2), device=device, dtype=torch.uint8) if write_codes else None
    scales = torch.empty((*lead, M // bm, N // bn), device=device, dtype=torch.uint8) if write_codes else None
    values = torch.empty(shape, device=device, dtype=torch.bfloat16) if write_values else None
    dummy = gs_out  # an fp32 tensor for unused pointers
    if packed or _use_cols(x3, block):
        _cols_launch(x3, amax, hadamard, noise, four_over_six, seed, rounding, codes, scales, values, gs_out,
                     source_dtype=source_dtype)
    elif _use_rows(x3, block):
        _rows_launch(x3, amax, hadamard, noise, four_over_six, seed, rounding, codes, scales, values, gs_out)
    else:
        BM, BN, warps = _tiles(block, x3)
        _quantize_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), x3.shape[0])](
            x3, hadamard if hadamard is not None else dummy, noise if noise is not None else dummy, amax, gs_out,
            codes if codes is not None else dummy, scales if scales is not None else dummy,
            values if values is not None else dummy,
            M, N, x3.stride(0), x3.stride(1), x3.stride(2), int(seed),
            BM=BM, BN=BN, SBM=bm, SBN=bn, FP8_BOUND=256.0 if four_over_six else 448.0,
            FOUR_OVER_SIX=bool(four_over_six), SR=rounding == "sr", USE_NOISE=noise is not None, HAD_DIM=had_dim,
            WRITE_CODES=write_codes, WRITE_VALUES=write_values, EXACT_FMA=_exact_fma(),
            num_warps=warps, enable_fp_fusion=False)  # no FMA contraction: every rounding as in the reference
    s_g = gs_out  # amax / (bound * 6) by tl.div_rn (a true division, like nvfp4.global_scale on the CPU), or 1
    t = nvfp4.NVFP4Tensor(codes, scales.view(torch.float8_e4m3fn), s_g, shape, block) if write_codes else None
    return t, values, s_g


def quantize(x, block=(1, 16), rounding="rtn", four_over_six=False, seed=0, hadamard=None, global_amax=None,
             noise=None, name="x", source_dtype=torch.bfloat16):
    """Fused NVFP4 quantization -> nvfp4.NVFP4Tensor (codes uint8 (*, M, N/2), scales float8_e4m3fn
    (*, M/bm, N/bn), global_scale fp32 0-d). block (1, 16) | (16, 1) | (16, 16) on the last two dims.
    rounding "rtn" | "sr" (Philox uniforms keyed by (seed, element index), or the uniforms in `noise`, x's shape,
    for tests).
    hadamard: (16, 16) matrix of nvfp4.random_hadamard's form (diag(+-1) H16 / 4) applied first along the
    block's 16-long dim (x·H for 1x16, H^T·x for 16x1).
    global_amax: max |x| (of x·H with hadamard) if the caller already has it; else one extra read pass.
    x may also be a packed 1x16 nvfp4.NVFP4Tensor: its values x.dequantize(source_dtype) are quantized; with a
    (16, 1) block and READ_PACKED_X the kernel decodes them in registers (eq. 2's Q16x1(H^T Q1x16(X)))."""
    t, _, _ = _run(x, block, rounding, four_over_six, seed, hadamard, global_amax, noise, True, False, name,
                   source_dtype)
    return t


def quantize_dequant(x, block=(1, 16), rounding="rtn", four_over_six=False, seed=0, hadamard=None,
                     global_amax=None, noise=None, return_tensor=False, name="x", source_dtype=torch.bfloat16):
    """Same quantization, but writes the bf16 values q * s_b (exactly on the NVFP4 grid, without the global
    scale) for a bf16 GEMM: returns (values_bf16, global_scale), plus the packed NVFP4Tensor from the same pass
    when return_tensor=True (the forward keeps the packed X for the backward and multiplies the bf16 values)."""
    t, values, s_g = _run(x, block, rounding, four_over_six, seed, hadamard, global_amax, noise,
                          return_tensor, True, name, source_dtype)
    return (values, s_g, t) if return_tensor else (values, s_g)


def dequantize(t, dtype=torch.float32, apply_global_scale=True):
    """Packed NVFP4Tensor -> dense tensor of t.shape in one pass: (q * s_b) * s_g rounded once to `dtype`, as
    NVFP4Tensor.dequantize computes it (bit-exact; bf16 rounding done explicitly, ties to even).
    apply_global_scale=False gives q * s_b, exact in bf16 (the cuBLAS route's operand)."""
    M, N = t.shape[-2:]
    bm, bn = t.block
    codes = t.codes.reshape(-1, M, N // 2).contiguous()
    scales = t.scales.reshape(-1, M // bm, N // bn).contiguous().view(torch.uint8)
    out = torch.empty((codes.shape[0], M, N), device=codes.device, dtype=dtype)
    gs = t.global_scale.float().reshape(1)
    flags = dict(APPLY_GLOBAL=apply_global_scale, ROUND_BF16=dtype == torch.bfloat16)
    if bm == 1:  # 1x16
        NB, warps = DEQUANT_ROWS_LAUNCH
        codes = codes if codes.storage_offset() % 4 == 0 else codes.clone()  # an int32 view needs 4-byte alignment
        n_blocks = out.numel() // 16
        _dequantize_rows_kernel[(triton.cdiv(n_blocks, NB),)](codes.view(torch.int32), scales, gs, out, n_blocks,
                                                            NB=NB, **flags, num_warps=warps)
    else:
        BN = 256
        grid = (M // 16, triton.cdiv(N, BN), codes.shape[0])
        _dequantize_kernel[grid](codes, scales, gs, out, M, N, BN=BN, SBN=bn, **flags, num_warps=4)
    return out.reshape(t.shape)


def grid_values_bf16(t):
    """Packed NVFP4Tensor -> its q * s_b as bf16 (exact), in the stored layout (*, M, N)."""
    return dequantize(t, torch.bfloat16, apply_global_scale=False)
