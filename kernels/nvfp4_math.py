"""
NVFP4 arithmetic as Triton device functions (paper §2; the numerics of the reference nvfp4.py, bit
for bit): Transformer Engine's global and block scales (one reciprocal per block, a multiply per
element), E4M3 rounding, E2M1 round-to-nearest and stochastic rounding from fp32 bits, SR's random
bits (16 per element, from Philox), the 16-point Hadamard butterfly, and the fixed summation tree
4/6 compares errors with.
Every quantizing kernel (nvfp4_quant, flash_attention, optim_fused) builds on these, so they all
round alike; every decoding kernel (nvfp4_dequant, nvfp4_quant's packed source, optim_fused) reads
codes through the one decoder, _decode_e2m1.
"""

import os

import torch
import triton
import triton.language as tl

from kernels import targets

# (major, minor) of the Triton that compiles the kernels: where its versions lay out or compile a
# kernel differently (kernels/nvfp4_quant.TIES_TO_HIGHER, kernels/flash_attention.OPAQUE_ZERO)
TRITON_VERSION = tuple(int(v) for v in triton.__version__.split(".")[:2])

FP4_MAX = tl.constexpr(6.0)          # largest E2M1 magnitude
E4M3_MAX = tl.constexpr(448.0)       # largest E4M3 block scale
# the global scale's bound with 4/6: the x1.5 candidate (max -> 4) must still fit E4M3
E4M3_MAX_46 = tl.constexpr(256.0)


def on_gpu():
    """Do the kernels run on a GPU, not in Triton's interpreter (TRITON_INTERPRET=1)? Where the two
    round differently (the interpreter's casts, its fma), the kernels take exact integer arithmetic
    in the interpreter and the hardware instruction on a GPU: the same bits."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def hw_e4m3():
    """E4M3 conversions by the hardware (sm_89+: cvt.rn.satfinite.e4m3x2.f32, nearest ties to even,
    subnormals kept: nvfp4.to_e4m3 exactly, which a GPU test checks on every tie; the fp8e4nv type
    itself): on a GPU whose row of kernels/targets.py says so (the current CUDA device's). Triton's
    interpreter converts otherwise (its subnormal ties do not round to even) and Ampere has no fp8
    type, so there integer arithmetic: the same bits."""
    return on_gpu() and torch.cuda.is_available() and targets.of(torch.device("cuda")).hw_e4m3


# Read once, at import: a fact of the machine (its GPU, or the interpreter, which TRITON_INTERPRET
# picks for the whole process when kernels are decorated), and a constexpr global rather than a
# kernel argument so that the device functions deep in every kernel (_round_to_e4m3, _e4m3_value)
# see it without each launcher passing it down. Triton folds it into each kernel as it compiles;
# tests/compile_for_target.py sets it per target before compiling.
HW_E4M3 = tl.constexpr(hw_e4m3())
ON_GPU = tl.constexpr(on_gpu())


@triton.jit
def _round_to_e4m3(s, UP: tl.constexpr = False):
    """fp32 s in [0, 448] -> (the nearest E4M3 value, ties to even, as fp32; its uint8 bit pattern).
    Rounds to a multiple of the E4M3 quantum at s's binade (2^(e-3), but at least 2^-9 for
    subnormals) with the 2^23 magic-number trick, which is exact RNE for 0 <= t < 2^22 (on a GPU
    the hardware conversion instead, HW_E4M3). UP: the smallest E4M3 value >= s instead
    (nvfp4.to_e4m3(s, up=True)), always by the arithmetic (no hardware rounding mode for it)."""
    if HW_E4M3 and not UP:  # one conversion instead of the arithmetic below (no rounding up)
        f8 = s.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        return f8.to(tl.float32), f8.to(tl.uint8, bitcast=True)
    bits = s.to(tl.int32, bitcast=True)
    e = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased fp32 exponent, floored at 2^-6
    quantum = ((e - 3) << 23).to(tl.float32, bitcast=True)             # 2^(e-127-3)
    # s / quantum, exact (a power of two)
    t = s * ((254 - (e - 3)) << 23).to(tl.float32, bitcast=True)
    if UP:
        t = tl.ceil(t)
    else:
        t = (t + 2.0 ** 23) - 2.0 ** 23                                # RNE to an integer (0..16)
    v = t * quantum
    # E4M3 bit pattern of v: normal (exp >= 1): (biased exp << 3) | top 3 mantissa bits;
    # subnormal: v / 2^-9
    vbits = v.to(tl.int32, bitcast=True)
    ve = (vbits >> 23) & 0xFF
    normal = ((ve - 120) << 3) | ((vbits >> 20) & 7)
    sub = (v * 2.0 ** 9).to(tl.int32)
    code = tl.where(ve >= 127 - 6, normal, sub)
    code = tl.where(ve == 255, 0x7F, code)  # a NaN s (its block held a NaN): E4M3's NaN
    return v, code.to(tl.uint8)


@triton.jit
def _binade_bits(a):
    """fp32 bits of p = 2^floor(log2 max(a, 1)) for a in [0, 6], read off the exponent: E2M1's grid
    step is p / 2 (0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6])."""
    return tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000


@triton.jit
def _rtn_e2m1_value(a):
    """The nearest E2M1 magnitude to a in [0, 6], ties to even (nvfp4.rtn_e2m1's grid value), as
    fp32: adding c = 2^22 p, whose ulp is the grid step p / 2 (_binade_bits), and subtracting it
    again rounds a to the grid, ties to even, exactly (a < c). Equals the reference's compare tree
    on every fp32 (tested on every tie and its neighbours)."""
    c = (_binade_bits(a) + (22 << 23)).to(tl.float32, bitcast=True)
    return (a + c) - c


@triton.jit
def _e2m1_index(q):
    """Index 0..7 of an E2M1 magnitude q (fp32), the code's low 3 bits: q * 2^-126 holds it in bits
    24..22 (_decode_e2m1's placement inverted; exact: 0.5 becomes the subnormal 2^-127)."""
    return (q * 2.0 ** -126).to(tl.int32, bitcast=True) >> 22


@triton.jit
def _e4m3_value(bits):
    """E4M3 bit patterns (uint8, as the block scales are stored) -> their fp32 values: the hardware
    conversion (HW_E4M3), else exact integer arithmetic (no sign: block scales are >= 0)."""
    if HW_E4M3:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = bits.to(tl.int32)
    e, m = (b >> 3) & 15, b & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)  # 2^(e-7) (1 + m/8)
    normal = tl.where(b == 0x7F, float("nan"), normal)                    # E4M3's NaN
    return tl.where(e == 0, m.to(tl.float32) * 2.0 ** -9, normal)         # subnormal: m 2^-9


# the element scale's cap (TE's: an all-zero block's 1/0)
FLT_MAX = tl.constexpr(3.4028234663852886e38)
RCP_6 = tl.constexpr(0.1666666716337204)       # RN(1/6) in fp32 (0x3E2AAAAB), Transformer Engine's


@triton.jit
def _max_nan(a, b):
    """The maximum that keeps a NaN, as torch's amax does (Triton's default max skips it on a GPU,
    and a NaN would then come out of a quantization as a finite value)."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _amax_nan(x, axis: tl.constexpr):
    """max of x over axis, keeping a NaN (_max_nan). The interpreter's tl.reduce calls a combine
    function element by element (~100x slower than its tl.max, which skips NaN as the GPU's
    does), so there the NaN is put back by a mask."""
    if ON_GPU:
        return tl.reduce(x, axis, _max_nan)
    else:
        return tl.where(tl.max((x != x).to(tl.int32), axis) > 0, float("nan"), tl.max(x, axis))


@triton.jit
def _global_scales(amax, FP8_BOUND: tl.constexpr):
    """Transformer Engine's global scales from a tensor's amax: the encode scale
    S_enc = RN(bound * 6 / amax), capped at FLT_MAX (1 when amax is 0: zeros encode to zeros with
    any scale), and the decode scale S_dec = RN(1 / S_enc), the NVFP4Tensor's global_scale
    (nvfp4.global_scales)."""
    s_enc = tl.where(amax > 0,
                     tl.minimum(tl.div_rn(FP8_BOUND * FP4_MAX, tl.where(amax > 0, amax, 1.0)),
                                FLT_MAX),
                     1.0)
    return s_enc, tl.div_rn(1.0, s_enc)


@triton.jit
def _element_scale(s, s_dec):
    """Transformer Engine's element scale of block scales s (nvfp4.element_scale): den = s * S_dec
    (fp32) and inv = min(RN(1 / den), FLT_MAX), by which every element of the block is multiplied
    (FLT_MAX for an all-zero block's den = 0)."""
    den = s * s_dec
    inv = tl.where(den > 0, tl.div_rn(1.0, tl.where(den > 0, den, 1.0)), FLT_MAX)
    return den, tl.minimum(inv, FLT_MAX)


@triton.jit
def _block_scale(block_amax, s_enc, s_dec, MAX_Q: tl.constexpr, UP: tl.constexpr = False,
                 inv_table=None):
    """A block scale candidate with the block's max mapped to MAX_Q (6; 4 for 4/6's second
    candidate), in Transformer Engine's arithmetic (nvfp4.block_scale, nvfp4.element_scale):
    s_b = e4m3(min(amax_b * (S_enc * RN(1 / MAX_Q)), 448)) (RNE, or up with UP: nvfp4's "sr_up"),
    its uint8 bits, den and the element scale inv (_element_scale): one correctly rounded
    reciprocal per block, a multiply per element. inv_table: None, or a (128,) tensor of
    _element_scale of every E4M3 code for this S_dec, from which s_b's code gathers its inv instead
    of dividing (the attention passes, where four threads hold each block and would each divide)."""
    if MAX_Q == FP4_MAX:
        rcp: tl.constexpr = RCP_6
    else:
        rcp: tl.constexpr = 1.0 / MAX_Q   # 1/4: exact
    s, bits = _round_to_e4m3(tl.minimum(block_amax * (s_enc * rcp), E4M3_MAX,
                                        propagate_nan=tl.PropagateNan.ALL), UP)
    if inv_table is None:
        den, inv = _element_scale(s, s_dec)
    else:
        idx = tl.reshape(bits.to(tl.int32), (bits.numel,))
        den, inv = s * s_dec, tl.reshape(tl.gather(inv_table, idx, 0), bits.shape)
    return s, bits, den, inv


@triton.jit
def _div_by(x, den, inv, EXACT_FMA: tl.constexpr):
    """x / den rounded to nearest (what tl.div_rn and torch give) for x >= 0, with inv = RN(1 / den)
    given (the AdamW update's division by a per-program value). On the GPU, Markstein's correction
    step: q = RN(x * inv) is within an ulp, r = x - q * den is exact with an fma, and
    RN(q + r * inv) is the correctly rounded quotient (Markstein 1990; Muller et al., Handbook of
    Floating-Point Arithmetic, ch. 4). The interpreter's fma rounds twice, so there it is
    tl.div_rn."""
    if EXACT_FMA:
        q = x * inv
        r = tl.fma(q, -den, x)
        return tl.fma(r, inv, q)
    else:
        return tl.div_rn(x, den)


@triton.jit
def _decode_e2m1(top, s_b, s_g):
    """The one E2M1 decoder: codes held in bits 31..28 of int32 `top` (lower bits ignored: callers
    shift a nibble there in one instruction), their block scales s_b and global scale s_g (fp32,
    broadcastable; s_g = 1 for the grid values q * s_b) -> (q * s_b) * s_g, rounded once as
    nvfp4.NVFP4Tensor.dequantize rounds it, signed as the reference (-0.0 for code 8). An
    arithmetic shift by 6 and a mask leave sign, exponent (2 bits) and mantissa (1 bit) where fp32
    keeps them: q * 2^-126 (exponent 0 lands in fp32's subnormal range: 0.5 -> 2^-127, exactly
    E2M1's subnormal), no fp8 -> fp32 conversion per element. Then (q 2^-126) (s_b 2^119) =
    q s_b 2^-7 is exact (6 significant bits, none below 2^-17), and so are s_b 2^119
    (<= 448 * 2^119 < FLT_MAX) and s_g 2^7 (a quantize pass's s_g is at most FLT_MAX / 1536), so the
    second product is the exact q s_b s_g rounded once. Two multiplies per element."""
    q = ((top >> 6) & -2118123520).to(tl.float32, bitcast=True)                      # 0x81C00000
    return (q * (s_b * 2.0 ** 119)) * (s_g * 2.0 ** 7)


@triton.jit
def _sign_bits(x, a):
    """uint32 with bit 31 set where x < 0 and a > 0 (a code's sign bit: a negative x that scales to
    a > 0; -0.0, and an x whose a is 0, get a + code, as nvfp4.quantize). a >= 0 is +0.0 or
    positive, so 0 - a's bits has bit 31 set exactly where a > 0, and there x's bit 31 is x < 0:
    a negation and one bit operation instead of two compares."""
    return x.to(tl.uint32, bitcast=True) & (0 - a.to(tl.uint32, bitcast=True)) & 0x80000000


@triton.jit
def _with_sign(v, sign):
    """v >= 0 with the fp32 sign bit set from sign (_sign_bits): -v is 0 - v in Triton, which turns
    a negative code's -0.0 into +0.0."""
    return (v.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _pack_codes(q, sign, S0: tl.constexpr, S1: tl.constexpr, N: tl.constexpr):
    """The stored codes of S0 * S1 * N elements (q, sign: any shapes holding them in row-major
    order): the E2M1 index of the magnitude q (_e2m1_index) with bit 3 from sign (_sign_bits),
    N (2, 8 or 16) consecutive codes along the last dim packed into one integer, element k in
    nibble k (the even element in a byte's low nibble, as stored) -> (S0, S1) uint32 (N = 2: a
    byte; 8: a word) or int64 (16). Pair by pair, by splits: a block's codes stay in the thread
    that holds them."""
    code = (_e2m1_index(q.reshape(S0, S1 * N // 2, 2)).to(tl.uint32)
            | (sign.reshape(S0, S1 * N // 2, 2) >> 28))
    for i in tl.static_range(4):  # pairs of nibbles, of bytes, of half-words, of words
        if (2 << i) <= N:
            lo, hi = tl.split(code.reshape(S0, S1 * (N >> (i + 1)), 2))
            if i == 3:
                lo, hi = lo.to(tl.int64), hi.to(tl.int64)
            code = lo | (hi << (4 << i))
    return code.reshape(S0, S1)


@triton.jit
def _sr_e2m1_value(a, r):
    """Stochastic rounding of a in [0, 6] to an E2M1 magnitude (nvfp4.sr_e2m1's grid value, as
    fp32: up to the next grid value iff u < (a - lo) / step), for the SR contract's words r: 16
    random bits h as the fp32 1 + h 2^-23 (_sr_word), and u = h 2^-16, nvfp4.sr_uniforms' u, is
    (r - 1) 2^7 in one fma, exact (128 + h 2^-16 has 24 significant bits).
    In units of the step p / 2 (_binade_bits), y = a / (p / 2) in [0, 4) is exact (a power of two),
    and so is y - u: at y >= 1 both are multiples of y's ulp (>= 2^-23) below 4; at y < 1 only its
    sign matters. So ceil(y - u) is floor(y) + 1 exactly when u < y - floor(y), else floor(y): the
    reference's decision for every 16-bit u, bit for bit (tested on every half-word, at u = f too,
    where "up" must not be taken). Times the step plus 0.0 in one fma: ceil's -0.0 (y < u < 1)
    comes out +0.0 (-0 + 0 is +0), every other product is exact (so the fma rounds nothing, in the
    interpreter's two steps too). At a = 6: never up."""
    pbits = _binade_bits(a)
    y = a * ((255 << 23) - pbits).to(tl.float32, bitcast=True)                        # 2 / p
    u = tl.fma(r.to(tl.float32, bitcast=True), 128.0, -128.0)                        # exact
    step = (pbits - (1 << 23)).to(tl.float32, bitcast=True)                          # p / 2
    return tl.fma(tl.ceil(y - u), step, 0.0)


# SR's random bits (nvfp4.sr_uniforms): 16 per element, one Philox4x32-10 call (tl.randint4x,
# 10 rounds, key = the seed) per 8 neighbouring elements along the block. Element 8c + 2k + h takes
# half h (0: low, 1: high) of word k of counter c: 2k + h = 4a + 2b + h for the word index
# k = 2a + b, so the words, joined as join(join(r0, r2), join(r1, r3)), then split in halves
# (_word_halves), reshape straight into element order in registers.

@triton.jit
def _sr_word(h):
    """16 random bits h (uint32 below 2^16) -> the SR word _sr_e2m1_value reads: the fp32 bit
    pattern of 1 + h 2^-23, one bit operation (u is then one fma away)."""
    return h | 0x3F800000


@triton.jit
def _word_halves(w):
    """uint32 words (any shape S) -> S + (2,) SR words (_sr_word): [..., 0] of the low half's 16
    bits, [..., 1] of the high half's. Every SR draw splits its words here (Philox's, and
    flash_attention's hashed dS words)."""
    return tl.join(_sr_word(w & 0xFFFF), _sr_word(w >> 16))


@triton.jit
def _philox_halves(seed, counters):
    """The 8 random half-words of each counter (any shape S) -> S + (2, 2, 2): [..., a, b, h] is
    element 4a + 2b + h of the counter's 8, half h of word 2a + b."""
    r0, r1, r2, r3 = tl.randint4x(seed, counters.to(tl.uint32))
    return _word_halves(tl.join(tl.join(r0, r2), tl.join(r1, r3)))


@triton.jit
def _random_words(seed, rows, n0, N, BM: tl.constexpr, BN: tl.constexpr):
    """(BM, BN) random words (for _sr_e2m1_value) for the elements (rows[i], n0 + j) of a row-major
    tensor with N columns, for 1x16 blocks: counter = element index // 8, so an eighth of tl.rand's
    Philox work and a draw that does not depend on the tiling. Raw bits, not tl.rand's floats
    (SR words, _sr_word: _sr_e2m1_value builds its exact u from them). n0 and N are multiples of 8
    (of 16, in fact)."""
    offs8 = rows[:, None] * (N // 8) + (n0 // 8 + tl.arange(0, BN // 8))[None, :]
    return _philox_halves(seed, offs8).reshape(BM, BN)


@triton.jit
def _column_random_words(seed, offs8):
    """Random words for 16x1 and 16x16 blocks: one Philox call per 8 rows of a column, counter =
    (row // 8) * N + column, half h of word k for row 8i + 2k + h (eight rows of one column, not
    eight columns of one row as _random_words for 1x16 blocks: a kernel holding whole column blocks
    per thread then uses every word of a call).
    offs8: the counters, any shape S; returns S + (2, 2, 2) with [..., a, b, h] the word of row
    offset 4a + 2b + h; callers permute it into their tiles. The draw depends on (seed, row,
    column) only, not on the tiling."""
    return _philox_halves(seed, offs8)


@triton.jit
def _block_random_words(seed, blocks, NB: tl.constexpr):
    """_random_words for whole 1x16 blocks of a flat tensor, as the rows kernel's (NB, 2, 8) tile:
    the same Philox counters (element index // 8 = block * 2 + half) and the same assignment,
    generated in the tile's own arrangement (a reshape of _random_words' (NB, 16) cost a layout
    shuffle)."""
    offs8 = blocks[:, None] * 2 + tl.arange(0, 2)[None, :]                         # (NB, 2)
    return _philox_halves(seed, offs8).reshape(NB, 2, 8)


@triton.jit
def _pairwise_block_sum(e, GM: tl.constexpr, SBM: tl.constexpr, GN: tl.constexpr,
                        SBN: tl.constexpr):
    """Per-block sum of e (GM, SBM, GN, SBN) -> (GM, GN) as a fixed binary tree: neighbours along
    the row are added pairwise (16 -> 8 -> 4 -> 2 -> 1), then along the column. Every step adds
    exactly two fp32 values (a + b == b + a), so the result does not depend on the compiler's
    reduction order and equals the reference's nvfp4._pairwise_block_sum bit for bit (4/6's error
    comparison must pick the same candidate)."""
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
def _scale_blocks(ax, s_enc, s_dec, GM: tl.constexpr, SBM: tl.constexpr, GN: tl.constexpr,
                  SBN: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, UP: tl.constexpr = False,
                  inv_table=None):
    """§2's block scaling of |x| held as (GM, SBM, GN, SBN), GM x GN blocks of SBM x SBN, given the
    global scales (nvfp4.scale_blocks, bit for bit): the block scale s_b with the block max mapped
    to 6 and the scaled magnitudes a = min(|x| * RN(1 / (s_b * S_dec)), 6); with FOUR_OVER_SIX
    also the candidate "max -> 4" (its own E4M3 rounding), kept per block where its RTN
    reconstruction has the lower squared error (summed in the fixed tree), ties to 6 (paper §2;
    docs/nvfp4_format.md). The choice uses the RTN error also under SR, so the random draw does not
    pick the scale. -> (a, s_b (GM, GN), its E4M3 bits, _rtn_e2m1_value(a)); the last costs nothing
    where a caller rounds otherwise (the compiler drops it). inv_table: _block_scale's (the
    max -> 6 candidate's only)."""
    block_amax = _amax_nan(_amax_nan(ax, 3), 1)                                        # (GM, GN)
    s_b, bits, den, inv = _block_scale(block_amax, s_enc, s_dec, FP4_MAX, UP, inv_table)
    a = tl.minimum(ax * inv[:, None, :, None], FP4_MAX)
    q = _rtn_e2m1_value(a)
    if FOUR_OVER_SIX:
        s4, bits4, den4, inv4 = _block_scale(block_amax, s_enc, s_dec, 4.0, UP)
        a4 = tl.minimum(ax * inv4[:, None, :, None], FP4_MAX)
        q4 = _rtn_e2m1_value(a4)
        d6 = q * den[:, None, :, None] - ax
        d4 = q4 * den4[:, None, :, None] - ax
        use4 = (_pairwise_block_sum(d4 * d4, GM, SBM, GN, SBN)
                < _pairwise_block_sum(d6 * d6, GM, SBM, GN, SBN))
        s_b = tl.where(use4, s4, s_b)
        bits = tl.where(use4, bits4, bits)
        a = tl.where(use4[:, None, :, None], a4, a)
        q = tl.where(use4[:, None, :, None], q4, q)
    return a, s_b, bits, q


@triton.jit
def _butterfly_stage(y, P: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr, W: tl.constexpr):
    """(P, 16, W): in each of the G groups of 2 * HALF along dim 1, (a, b) -> (a + b, a - b) across
    its halves."""
    a, b = tl.split(tl.permute(y.reshape(P, G, 2, HALF, W), (0, 1, 3, 4, 2)))  # the pair dim last
    return tl.permute(tl.join(a + b, a - b), (0, 1, 4, 2, 3)).reshape(P, 16, W)


@triton.jit
def _butterfly16(y, P: tl.constexpr, W: tl.constexpr):
    """y (P, 16, W) -> y . H16 along dim 1 for Sylvester's unnormalized H16 = [[H8, H8], [H8, -H8]]:
    4 stages of (a, b) -> (a + b, a - b), halves 8, 4, 2, 1 (optim.fwht16's order, stage for
    stage). The one 16-point Hadamard of every kernel."""
    y = _butterfly_stage(y, P, 1, 8, W)
    y = _butterfly_stage(y, P, 2, 4, W)
    y = _butterfly_stage(y, P, 4, 2, W)
    return _butterfly_stage(y, P, 8, 1, W)


@triton.jit
def _hadamard16(x, h_ptr, P: tl.constexpr, W: tl.constexpr):
    """x (P, 16, W) fp32 -> x . H along dim 1, for H = diag(s) . H16 / 4 (nvfp4.random_hadamard's
    form: its column 0 is s / 4). The products x_i * H_ij are exact (a sign and a power of two), so
    this is x * H[:, 0] then _butterfly16: 5 operations per element instead of a 16-term dot
    product. One fixed order of additions in every kernel that rotates (quantize passes and amax
    pre-passes see the same bits); the reference's matmul sums the same products in its own order:
    equal where the sums are exact, else within an ulp of the rotated value."""
    return _butterfly16(x * tl.load(h_ptr + tl.arange(0, 16) * 16)[None, :, None], P, W)


@triton.jit
def _rotate(x, h_ptr, BM: tl.constexpr, BN: tl.constexpr, HAD_DIM: tl.constexpr):
    """fp32 (BM, BN) tile. HAD_DIM 1: x·H on groups of 16 along the columns; 2: H^T·x on groups of
    16 along the rows (the reference's hadamard_transform with dim=-1 / -2; H^T x = x'H
    column-wise); 0: x unchanged."""
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
def _round_to_bf16(v, HW: tl.constexpr = False):
    """fp32 -> the nearest bf16 value (ties to even), kept in fp32. Explicit because the
    interpreter's fp32 -> bf16 cast truncates; HW (a GPU, on_gpu()): the cast itself,
    cvt.rn.bf16.f32, the same rounding in one instruction per two values instead of three per value
    (tests/test_kernels_nvfp4.py's GPU tests compare it with the reference). Finite inputs."""
    if HW:
        return v.to(tl.bfloat16).to(tl.float32)
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)
