"""
Flash attention kernels for attention.py (paper §3.5, App. 11 Algorithm 8). A forward pass, and a
backward in two passes: dK/dV (one key tile of one kv head; it loops over the G query heads of its
group and all their query tiles) and dQ (one query tile of one query head, recomputing S, P and dP:
7 matmuls instead of FlashAttention-2's 5 with atomic dQ, and deterministic). Causal or not, any T;
GQA without repeating K/V (query head h reads kv head h // G).

Operands are plain tensors. With an NVFP4 policy Q, K, V arrive as their grid values q * s_b in bf16
(exact: at most 6 significant bits) and the per-tensor global scales s_g multiply the fp32
accumulators afterwards: on Hopper, which has no FP4 tensor cores, the arithmetic of a native NVFP4
GEMM up to summation order.

On Blackwell (nvfp4_gemm.use_dot_scaled: 10.x and 12.x, kernels/targets.py; attention.py passes the
packed tensors too) the same kernels, with the constexpr FP4_MMA, take the products whose two
operands are blocked 1x16 along the contraction to tl.dot_scaled on e2m1 codes + E4M3 scales
(kind::mxf4nvf4: tcgen05.mma on 10.x, mma.sync on 12.x): Q K^T in the forward and both backward
passes (Q, K as attention.py packed them), dO V^T for fp4_dov / fp4_all (dO 1x16 along D, V), and
P^T dO for fp4_all (P^T quantized to codes in registers by _quant_rows16, dO 16x1 along T re-packed
K-major by nvfp4_gemm._k_major). Same numbers as the grid-value route up to fp32 summation order.
P V, dS K and dS^T Q stay on the bf16 MMA: they contract over T, where V, K, Q are blocked along D,
and an E2M1 x E4M3 operand needs one scale per 16 elements of the contraction; a second quantization
along T would change the numbers and break forward-backward consistency (docs/blackwell.md). Tiles:
SM100_CONFIGS (they fit 12.x's ~100 KB too). Hopper compiles FP4_MMA=False.

In-register quantization (`_fake_quant_rows16`): tiles of dS (and of P in the fp4_pv / fp4_all
variants) are quantized in 1x16 blocks along the tile's last dim with nvfp4_math's block scaling
and E2M1 rounding, the helpers of every quantize kernel, so nvfp4.quantize_reference (which
attention.py's reference calls with the same global amax and uniforms) gives the same values (dS's
zeros may carry x's sign: the same products). SR
draws 16 random bits per element from a counter hash of its (head, query, key) position
(`_ds_random_words`), so the draw does not depend on the tiling and the reference reproduces it.

Scores live in the log2 domain (S * sm_scale * log2 e), as in Triton's fused-attention tutorial; the
forward saves lse2 = m + log2(l) per row and the backward recomputes P = exp2(S2 - lse2).
"""


import math

import torch
import triton
import triton.language as tl

from kernels import nvfp4_math, targets
from kernels.nvfp4_gemm import _k_major, use_dot_scaled

LOG2E = 1.4426950408889634


def _interpreting():
    return not nvfp4_math.on_gpu()


# P's encode scale: amax(P) <= 1 (attention.P_GLOBAL_SCALE is its S_dec)
P_S_ENC = tl.constexpr(nvfp4_math.E4M3_MAX * nvfp4_math.FP4_MAX)
# Triton 3.6 fails to compile, for sm_100a, a block-scaled MMA into a fresh zero accumulator inside
# a loop (TritonGPUOptimizeAccumulatorInit: "'ttng.tmem_alloc' op uninitialized alloc must have a
# mutable memdesc type"; also with no accumulator); a zero it cannot fold compiles. 3.9 takes the
# plain zero (3.7 and 3.8 not checked: they keep the workaround).
OPAQUE_ZERO = tl.constexpr(nvfp4_math.TRITON_VERSION < (3, 9))


# --------------------------------------------------------------------------------------------------
# helpers

@triton.jit
def _load_tile(ptr, rows, T, D: tl.constexpr, MASK_ROWS: tl.constexpr, DTYPE: tl.constexpr):
    """(R, D) tile of rows `rows` of a row-major (T, D) operand, in DTYPE; rows >= T read as 0 when
    MASK_ROWS."""
    cols = tl.arange(0, D)
    if MASK_ROWS:
        x = tl.load(ptr + rows[:, None] * D + cols[None, :], mask=rows[:, None] < T, other=0.0)
    else:
        x = tl.load(ptr + rows[:, None] * D + cols[None, :])
    return x.to(DTYPE)


@triton.jit
def _head_rows(X, bh, H, T, D: tl.constexpr, stride_h):
    """Head bh = b * H + h of a (B, H, T, D) tensor X stored heads-outer (stride_h = T * D: (B, H,
    T, D) contiguous, its rows D apart) or heads-inner (stride_h = D: (B, T, H, D) contiguous, as a
    linear layer's output seen as heads, its rows H * D apart): the pointer to its row 0."""
    b = bh // H
    return X + b.to(tl.int64) * H * T * D + (bh - b * H).to(tl.int64) * stride_h


@triton.jit
def _load_packed(C, S, rows, T, D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """FP4_MMA: rows `rows` of a packed (T, D) operand blocked 1x16 along D (its codes (T, D / 2),
    E4M3 scales (T, D / 16)) as tl.dot_scaled reads a product over D: codes (R, D / 2), two per
    byte along D, and scales (R, D / 16); rows >= T read as 0 when MASK_ROWS."""
    return (_load_tile(C, rows, T, D // 2, MASK_ROWS, tl.uint8),
            _load_tile(S, rows, T, D // 16, MASK_ROWS, tl.float8e4nv))


@triton.jit
def _load_packed_t(C, S, r0, T, D: tl.constexpr, R: tl.constexpr):
    """FP4_MMA: rows r0 + arange(R) (r0 a multiple of 16) of a packed (T, D) operand
    blocked 16x1 along T (codes (T, D / 2), scales (T / 16, D)) as the right operand of a product
    over T: codes (R / 2, D), two per byte along T (re-packed in registers by nvfp4_gemm._k_major:
    the FP4 MMA reads K-major operands only), and scales (D, R / 16); rows >= T read as 0."""
    c = _load_tile(C, r0 + tl.arange(0, R), T, D // 2, True, tl.uint8)          # (R, D / 2)
    srows = r0 // 16 + tl.arange(0, R // 16)
    s = _load_tile(S, srows, tl.cdiv(T, 16), D, True, tl.float8e4nv)            # (R / 16, D)
    return tl.trans(_k_major(c, D, R)), tl.trans(s)


@triton.jit
def _dot_fp4(a, sa, b, sb, T):
    """FP4_MMA: a_hat b_hat^T (fp32) for packed tiles a (M, K / 2), b (N, K / 2) blocked 1x16 along
    K, with E4M3 scales sa (M, K / 16), sb (N, K / 16): tl.dot_scaled, which lowers to the
    block-scaled FP4 MMA (tcgen05.mma kind::mxf4nvf4, one scale per 16 elements). T: any runtime
    int (see OPAQUE_ZERO)."""
    acc = tl.zeros((a.shape[0], b.shape[0]), dtype=tl.float32)
    if OPAQUE_ZERO:
        acc += T * 0.0    # exactly 0, and not a constant the compiler can see
    return tl.dot_scaled(a, sa, "e2m1", b.T, sb, "e2m1", acc)


@triton.jit
def _head(C, S, head, T, D: tl.constexpr, ALONG_T: tl.constexpr):
    """FP4_MMA: one head's codes and scales in a packed (heads, T, D) operand blocked 1x16 along D,
    or with ALONG_T 16x1 along T (T zero-padded to a multiple of 16, as attention.py quantizes dO
    for P^T dO)."""
    if ALONG_T:
        Tp = tl.cdiv(T, 16) * 16
        c, s = C + head.to(tl.int64) * Tp * (D // 2), S + head.to(tl.int64) * (Tp // 16) * D
    else:
        c, s = C + head.to(tl.int64) * T * (D // 2), S + head.to(tl.int64) * T * (D // 16)
    return c, s


@triton.jit
def _load_head(C, S, head, rows, T, D: tl.constexpr, MASK_ROWS: tl.constexpr):
    """FP4_MMA: _load_packed of rows `rows` of one head of a packed 1x16 operand (_head)."""
    c, s = _head(C, S, head, T, D, False)
    return _load_packed(c, s, rows, T, D, MASK_ROWS)


@triton.jit
def _schedule(n_tiles, n_heads, group):
    """(head, rank) of this program on a 1-D grid of n_heads * n_tiles; rank 0 is a head's heaviest
    causal tile. A GPU starts programs in grid order, so the heads go in groups of `group` and,
    inside a group, every head's rank r starts before any rank r + 1: the heaviest tiles first and
    light ones in the last wave (longest processing time first), while the running programs share
    one group's heads in L2 (FlashAttention's SingleTileLPTScheduler orders its tiles so). Which
    program computes a tile changes no bit of it."""
    pid = tl.program_id(0)
    first = pid // (group * n_tiles) * group
    size = tl.minimum(n_heads - first, group)   # the last group may hold fewer heads
    r = pid - first * n_tiles
    return first + r % size, r // size


@triton.jit
def _quant_rows16(x, s_enc, s_dec, R: tl.constexpr, C: tl.constexpr):
    """FP4_MMA: _fake_quant_rows16's RTN quantization of an (R, C) fp32 tile as tl.dot_scaled reads
    it: E2M1 codes (R, C / 2), two per byte along C (the even element low), and E4M3 scales
    (R, C / 16). code * scale is _fake_quant_rows16's q * s_b bit for bit (the same nvfp4_math
    helpers)."""
    xb = tl.reshape(x, (R, 1, C // 16, 16))
    a, _, bits, q = nvfp4_math._scale_blocks(tl.abs(xb), s_enc, s_dec, R, 1, C // 16, 16, False)
    codes = nvfp4_math._pack_codes(q, nvfp4_math._sign_bits(xb, a), R, C // 2, 2).to(tl.uint8)
    return codes, bits.to(tl.float8e4nv, bitcast=True)


@triton.jit
def _op(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """A computed tile (P, dS, an output) in DTYPE. EMULATE_BF16 (the interpreter only): fp32
    rounded to the nearest bf16 first, still in fp32 (the interpreter's own fp32 -> bf16 cast
    truncates, and its tl.dot multiplies bf16 bit patterns as integers, so bf16 runs there multiply
    bf16-valued fp32 tiles instead: the same products)."""
    if EMULATE_BF16:
        x = nvfp4_math._round_to_bf16(x)
    return x.to(DTYPE)


@triton.jit
def _fmix32(x):
    # MurmurHash3's finalizer: a bijection of uint32 with full avalanche
    x = x ^ (x >> 16)
    x = x * 0x85EBCA6B
    x = x ^ (x >> 13)
    x = x * 0xC2B2AE35
    return x ^ (x >> 16)


@triton.jit
def _ds_random_words(key, rows, c0, T, R: tl.constexpr, C: tl.constexpr, QUERY_PAIRS: tl.constexpr):
    """(R, C) random words for SR (nvfp4_math._sr_word's: 16 random bits h, the uniform
    h * 2^-16) for a dS tile whose rows are `rows` and whose last
    dim runs over c0 + arange(C) (c0 even), of the head whose stream key is `key` (uint32). 16
    random bits per element: the elements 2j and 2j + 1 along the last dim share one hash of the
    pair's (query, key) counter, the even one taking its low half and the odd one its high half
    (half the hashing; u is then a multiple of 2^-16, which biases a rounding decision by < 2^-16
    of an E2M1 step).
    The tile is (queries, keys), or (keys, queries) when QUERY_PAIRS (dS^T in the dK/dV pass).
    attention.sr_uniforms draws the same u."""
    cols = c0 + 2 * tl.arange(0, C // 2)
    if QUERY_PAIRS:
        counter = cols[None, :] * T + rows[:, None]
    else:
        counter = rows[:, None] * T + cols[None, :]
    w = _fmix32(counter.to(tl.uint32) * 0x9E3779B1 + key)                          # (R, C / 2)
    return tl.reshape(nvfp4_math._word_halves(w), (R, C))


@triton.jit
def _fake_quant_rows16(x, s_enc, s_dec, r, R: tl.constexpr, C: tl.constexpr, SR: tl.constexpr,
                       SIGNED: tl.constexpr, inv_table=None):
    """NVFP4 quantize-dequantize of an (R, C) fp32 tile in 1x16 blocks along its last dim, with
    global scales (S_enc, S_dec): returns q * s_b (the caller applies S_dec). nvfp4_math's block
    scaling and E2M1 rounding (nvfp4.quantize's formulas, bit for bit): RTN ties-to-even, or SR
    from the random words r (R, C) (nvfp4_math._sr_word's: up iff h * 2^-16 < the fractional
    distance).
    SIGNED: x may be negative (dS; P >= 0 is not): x's sign bit is set on q * s_b >= 0, one bit
    operation instead of a compare and select (docs/performance.md), so an x < 0 that rounds to
    zero gives -0.0 where the reference gives +0.0: the same products in the dots the tile feeds.
    inv_table: None, or the (128,) element scales of s_dec by E4M3 code (_ds_setup_kernel),
    looked up instead of a division per block in each of the four threads holding it."""
    xb = tl.reshape(x, (R, 1, C // 16, 16))
    a, s_b, _, q = nvfp4_math._scale_blocks(tl.abs(xb), s_enc, s_dec, R, 1, C // 16, 16, False,
                                            inv_table=inv_table)
    if SR:
        q = nvfp4_math._sr_e2m1_value(a, tl.reshape(r, (R, 1, C // 16, 16)))
    v = q * s_b[:, None, :, None]
    if SIGNED:
        v = nvfp4_math._with_sign(v, xb.to(tl.uint32, bitcast=True) & 0x80000000)
    return tl.reshape(v, (R, C))


# --------------------------------------------------------------------------------------------------
# forward

@triton.jit
def _fwd_inner(acc, l_i, m_i, q, qs, K, KC, KS, V, start, end, offs_m, T, s_scale, sg_p,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               CAUSAL: tl.constexpr, QUANT_P: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr,
               EMU: tl.constexpr, FP4_MMA: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if FP4_MMA:   # q, qs: Q's codes and scales; Q K^T on the FP4 MMA (blocks along D)
            kc, ks = _load_packed(KC, KS, offs_n, T, D, MASK)
            s = _dot_fp4(q, qs, kc, ks, T) * s_scale
        else:
            k = _load_tile(K, offs_n, T, D, MASK, DTYPE)                               # (N, D)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * s_scale  # (M, N) log2 domain
        if MASK:
            ok = offs_n[None, :] < T
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])  # P~ = exp(S - m)
        alpha = tl.math.exp2(m_i - m_new)
        # the normalizer uses the exact P~ (quantized P breaks the simplex)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = _load_tile(V, offs_n, T, D, MASK, DTYPE)                                   # (N, D)
        if QUANT_P:
            # 1x16 along keys, RTN
            p = _fake_quant_rows16(p, P_S_ENC, sg_p, p, BLOCK_M, BLOCK_N, False, False)
        acc = tl.dot(_op(p, DTYPE, EMU), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, SGQ, SGK, SGV, sg_p, O, LSE, T, H, G, qk_scale, QC, QS, KC, KS, head_group,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              QUANT_P: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
              FP4_MMA: tl.constexpr):
    n_m = tl.cdiv(T, BLOCK_M)
    bh, rank = _schedule(n_m, tl.num_programs(0) // n_m, head_group)
    pid_m = n_m - 1 - rank                                # causal: the last query tile is heaviest
    bkv = (bh // H) * (H // G) + (bh % H) // G            # the kv head of query head h: h // G
    K += bkv.to(tl.int64) * T * D
    V += bkv.to(tl.int64) * T * D
    sg_q, sg_k, sg_v = tl.load(SGQ), tl.load(SGK), tl.load(SGV)   # global scales s_g
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if FP4_MMA:
        KC, KS = _head(KC, KS, bkv, T, D, False)
        q, qs = _load_head(QC, QS, bh, offs_m, T, D, True)
    else:
        q = _load_tile(Q + bh.to(tl.int64) * T * D, offs_m, T, D, True, DTYPE)        # (M, D)
        qs = None
    s_scale = qk_scale * sg_q * sg_k
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if CAUSAL:
        lo = pid_m * BLOCK_M                      # keys < lo are visible to every row of the tile
        hi = tl.minimum(lo + BLOCK_M, T)
    else:
        lo = (T // BLOCK_N) * BLOCK_N
        hi = T
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, qs, K, KC, KS, V, 0, lo, offs_m, T, s_scale,
                               sg_p, D, BLOCK_M, BLOCK_N, False, CAUSAL, QUANT_P, DTYPE, PREC, EMU,
                               FP4_MMA)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, qs, K, KC, KS, V, lo, hi, offs_m, T, s_scale,
                               sg_p, D, BLOCK_M, BLOCK_N, True, CAUSAL, QUANT_P, DTYPE, PREC, EMU,
                               FP4_MMA)
    o = acc * ((sg_v * sg_p) / l_i)[:, None]   # s_g(P) is 1 unless QUANT_P
    rmask = offs_m < T
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.math.log2(l_i), mask=rmask)
    cols = tl.arange(0, D)
    # O heads-inner (flash_forward): rows H * D apart
    tl.store(_head_rows(O, bh, H, T, D, D) + offs_m[:, None] * (H * D) + cols[None, :],
             _op(o, O.dtype.element_ty, EMU), mask=rmask[:, None])


# --------------------------------------------------------------------------------------------------
# backward: dK, dV for one key tile of one kv head (loops over its G query heads and all query
# tiles)

@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, DO, sdo_t: tl.constexpr, DOQ, DOT, LSE, DELTA, key, start, end,
                offs_n, T, s_scale,
                sg_dp, se_ds, sg_ds, ds_inv, sg_p, kc, ks, vc, vs, QC, QS, DOQC, DOQS, DOTC, DOTS,
                bh, D: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, MASK: tl.constexpr, CAUSAL: tl.constexpr,
                QUANT_DS: tl.constexpr, QUANT_DOV: tl.constexpr, QUANT_PDO: tl.constexpr,
                DTYPE: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr, FP4_MMA: tl.constexpr):
    cols = tl.arange(0, D)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rmask = offs_m < T
        q = _load_tile(Q, offs_m, T, D, MASK, DTYPE)                                   # (M, D)
        if MASK:  # rows >= T read as 0, lse as inf: P = 0
            do = tl.load(DO + offs_m[:, None] * sdo_t + cols[None, :], mask=rmask[:, None],
                         other=0.0).to(DTYPE)
            lse = tl.load(LSE + offs_m, mask=rmask, other=float("inf"))
            delta = tl.load(DELTA + offs_m, mask=rmask, other=0.0)
        else:  # whole query tiles, all rows < T
            do = tl.load(DO + offs_m[:, None] * sdo_t + cols[None, :]).to(DTYPE)
            lse, delta = tl.load(LSE + offs_m), tl.load(DELTA + offs_m)
        if FP4_MMA:   # S^T = K Q^T on the FP4 MMA (both blocked along D, its contraction)
            qc, qs = _load_head(QC, QS, bh, offs_m, T, D, True)
            sT = _dot_fp4(kc, ks, qc, qs, T) * s_scale
        else:
            sT = tl.dot(k, tl.trans(q), input_precision=PREC) * s_scale              # (N, M)
        pT = tl.math.exp2(sT - lse[None, :])
        if MASK:
            if CAUSAL:
                pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        if not CAUSAL:  # keys >= T (zero rows of a partial key tile) must not reach dS's block amax
            pT = tl.where(offs_n[:, None] < T, pT, 0.0)
        # fp4_all: P^T dO with P in 1x16 blocks along the queries (its contraction dim)
        if QUANT_PDO and FP4_MMA:   # P^T quantized to codes in registers, dO packed 16x1 along T
            pc, ps = _quant_rows16(pT, P_S_ENC, sg_p, BLOCK_N, BLOCK_M)
            dtc, dts = _head(DOTC, DOTS, bh, T, D, True)
            dtc, dts = _load_packed_t(dtc, dts, start_m, T, D, BLOCK_M)
            dv = tl.dot_scaled(pc, ps, "e2m1", dtc, dts, "e2m1", dv)
        elif QUANT_PDO:
            doT = tl.load(DOT + offs_m[:, None] * D + cols[None, :], mask=rmask[:, None],
                          other=0.0).to(DTYPE)
            pq = _fake_quant_rows16(pT, P_S_ENC, sg_p, pT, BLOCK_N, BLOCK_M, False, False)
            dv = tl.dot(_op(pq, DTYPE, EMU), doT, dv, input_precision=PREC)
        else:
            dv = tl.dot(_op(pT, DTYPE, EMU), do, dv, input_precision=PREC)  # dV += P^T dO
        if QUANT_DOV and FP4_MMA:   # dP^T = V dO^T on the FP4 MMA (both blocked along D)
            doc, dos = _load_head(DOQC, DOQS, bh, offs_m, T, D, True)
            dpT = _dot_fp4(vc, vs, doc, dos, T) * sg_dp
        elif QUANT_DOV:
            doq = tl.load(DOQ + offs_m[:, None] * D + cols[None, :], mask=rmask[:, None],
                          other=0.0).to(DTYPE)
            dpT = tl.dot(v, tl.trans(doq), input_precision=PREC) * sg_dp
        else:
            dpT = tl.dot(v, tl.trans(do), input_precision=PREC) * sg_dp              # dP^T = V dO^T
        dsT = pT * (dpT - delta[None, :])  # dS = P (dP - D)
        # dK = dS^T Q contracts over queries: 1x16 blocks of dS^T along the queries, SR
        if QUANT_DS:
            r = _ds_random_words(key, offs_n, start_m, T, BLOCK_N, BLOCK_M, True)
            dsT = _fake_quant_rows16(dsT, se_ds, sg_ds, r, BLOCK_N, BLOCK_M, True, True, ds_inv)
        dk = tl.dot(_op(dsT, DTYPE, EMU), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, K, V, SGQ, SGK, SGV, sg_p, SGDOV, SGPDO, DO, DOQ, DOT, LSE, DELTA,
                   SGDS, DSINV, KEYS, DK, DV, T, H, G, qk_scale, sm_scale, QC, QS, KC, KS, VC, VS,
                   DOQC, DOQS, DOTC, DOTS, head_group, sdo_t: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   QUANT_DS: tl.constexpr, QUANT_DOV: tl.constexpr, QUANT_PDO: tl.constexpr,
                   DTYPE: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr,
                   FP4_MMA: tl.constexpr):
    n_n = tl.cdiv(T, BLOCK_N)
    # bkv: b * Hkv + kv head; causal: the first key tile is heaviest (every query sees it)
    bkv, pid_n = _schedule(n_n, tl.num_programs(0) // n_n, head_group)
    Hkv = H // G
    b = bkv // Hkv
    g0 = (bkv % Hkv) * G                      # first query head of this kv head
    sg_q, sg_k, sg_v = tl.load(SGQ), tl.load(SGK), tl.load(SGV)   # global scales s_g
    # dO's s_g in dO V^T and in P^T dO: 1 where dO stays BF16
    sg_dov = tl.load(SGDOV) if QUANT_DOV else 1.0
    sg_pdo = tl.load(SGPDO) if QUANT_PDO else 1.0
    sg_dp = sg_v * sg_dov
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_tile(K + bkv.to(tl.int64) * T * D, offs_n, T, D, True, DTYPE)
    v = _load_tile(V + bkv.to(tl.int64) * T * D, offs_n, T, D, True, DTYPE)
    kc, ks, vc, vs = None, None, None, None
    if FP4_MMA:   # the packed K (and V) tiles of the FP4 products
        kc, ks = _load_head(KC, KS, bkv, offs_n, T, D, True)
        if QUANT_DOV:
            vc, vs = _load_head(VC, VS, bkv, offs_n, T, D, True)
    s_scale = qk_scale * sg_q * sg_k
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    if CAUSAL:
        lo = pid_n * BLOCK_N                  # queries < lo see none of these keys
        # the diagonal band (queries < lo + BLOCK_N, rounded up to whole query tiles) needs the
        # causal mask
        mid = tl.minimum(lo + tl.cdiv(BLOCK_N, BLOCK_M) * BLOCK_M, T)
    else:
        lo = 0
        mid = 0
    n_full = mid + ((T - mid) // BLOCK_M) * BLOCK_M
    # dK = sum_g s_g(dS_g) (dS_g^T Q_g) over the G query heads of this kv head. One accumulator for
    # all of them (a second BLOCK_N x D fp32 one makes the kernel spill): dk holds the sum in units
    # of the current head's s_g(dS), rescaled by s_g(previous) / s_g(current) at each head boundary.
    _, sg_prev = nvfp4_math._global_scales(tl.load(SGDS + b * H + g0), nvfp4_math.E4M3_MAX)
    for g in range(G):
        bh = b * H + g0 + g
        q_ptr = Q + bh.to(tl.int64) * T * D
        row = bh.to(tl.int64) * T * D
        # dO heads-outer (rows sdo_t = D apart) or heads-inner (H * D): a constant in the loop
        do_ptr = DO + row if sdo_t == D else _head_rows(DO, bh, H, T, D, D)
        # from dS's bound
        se_ds, sg_ds = nvfp4_math._global_scales(tl.load(SGDS + bh), nvfp4_math.E4M3_MAX)
        ds_inv = None
        if QUANT_DS:  # its element scales by E4M3 code (_ds_setup_kernel)
            ds_inv = tl.load(DSINV + bh * 128 + tl.arange(0, 128))
        key = tl.load(KEYS + 2 * bh + 1).to(tl.uint32, bitcast=True)
        dk = dk * tl.div_rn(sg_prev, sg_ds)
        sg_prev = sg_ds
        # the queries of the causal band (masked), then whole query tiles, then a partial last tile
        # (masked)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, sdo_t, DOQ + row, DOT + row,
                             LSE + bh * T, DELTA + bh * T, key, lo, mid, offs_n, T, s_scale,
                             sg_dp, se_ds, sg_ds, ds_inv, sg_p, kc, ks, vc, vs, QC, QS, DOQC,
                             DOQS, DOTC, DOTS, bh, D, BLOCK_M, BLOCK_N, True, CAUSAL, QUANT_DS,
                             QUANT_DOV, QUANT_PDO, DTYPE, PREC, EMU, FP4_MMA)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, sdo_t, DOQ + row, DOT + row,
                             LSE + bh * T, DELTA + bh * T, key, mid, n_full, offs_n, T, s_scale,
                             sg_dp, se_ds, sg_ds, ds_inv, sg_p, kc, ks, vc, vs, QC, QS, DOQC,
                             DOQS, DOTC, DOTS, bh, D, BLOCK_M, BLOCK_N, False, CAUSAL, QUANT_DS,
                             QUANT_DOV, QUANT_PDO, DTYPE, PREC, EMU, FP4_MMA)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, do_ptr, sdo_t, DOQ + row, DOT + row,
                             LSE + bh * T, DELTA + bh * T, key, n_full, T, offs_n, T, s_scale,
                             sg_dp, se_ds, sg_ds, ds_inv, sg_p, kc, ks, vc, vs, QC, QS, DOQC,
                             DOQS, DOTC, DOTS, bh, D, BLOCK_M, BLOCK_N, True, CAUSAL, QUANT_DS,
                             QUANT_DOV, QUANT_PDO, DTYPE, PREC, EMU, FP4_MMA)
    dk = dk * (sg_prev * sm_scale * sg_q)
    dv = dv * (sg_p * sg_pdo)                 # 1 unless QUANT_PDO
    cols, nmask = tl.arange(0, D), offs_n[:, None] < T
    dk_rows = DK + bkv.to(tl.int64) * T * D + offs_n[:, None] * D
    tl.store(dk_rows + cols[None, :], _op(dk, DK.dtype.element_ty, EMU), mask=nmask)
    dv_rows = _head_rows(DV, bkv, Hkv, T, D, D) + offs_n[:, None] * (Hkv * D)  # heads-inner
    tl.store(dv_rows + cols[None, :], _op(dv, DV.dtype.element_ty, EMU), mask=nmask)


# --------------------------------------------------------------------------------------------------
# backward: dQ for one query tile of one query head

@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, V, key, start, end, offs_m, T, s_scale, sg_dp, se_ds, sg_ds,
              ds_inv, qc, qs, doc, dos, KC, KS, VC, VS,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
              CAUSAL: tl.constexpr, QUANT_DS: tl.constexpr, DTYPE: tl.constexpr, PREC: tl.constexpr,
              EMU: tl.constexpr, QUANT_DOV: tl.constexpr, FP4_MMA: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, offs_n, T, D, MASK, DTYPE)
        if FP4_MMA:   # S = Q K^T on the FP4 MMA (both blocked along D, its contraction)
            kc, ks = _load_packed(KC, KS, offs_n, T, D, MASK)
            s = _dot_fp4(qc, qs, kc, ks, T) * s_scale
        else:
            v = _load_tile(V, offs_n, T, D, MASK, DTYPE)
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * s_scale               # (M, N)
        p = tl.math.exp2(s - lse[:, None])
        if MASK:
            ok = offs_n[None, :] < T
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(ok, p, 0.0)
        if FP4_MMA and QUANT_DOV:   # dP = dO V^T on the FP4 MMA (both blocked along D)
            vc, vs = _load_packed(VC, VS, offs_n, T, D, MASK)
            dp = _dot_fp4(doc, dos, vc, vs, T) * sg_dp
        else:
            if FP4_MMA:
                v = _load_tile(V, offs_n, T, D, MASK, DTYPE)
            dp = tl.dot(do, tl.trans(v), input_precision=PREC) * sg_dp               # dP = dO V^T
        ds = p * (dp - delta[:, None])
        if QUANT_DS:   # dQ = dS K contracts over keys: 1x16 blocks of dS along the keys, SR
            r = _ds_random_words(key, offs_m, start_n, T, BLOCK_M, BLOCK_N, False)
            ds = _fake_quant_rows16(ds, se_ds, sg_ds, r, BLOCK_M, BLOCK_N, True, True, ds_inv)
        dq = tl.dot(_op(ds, DTYPE, EMU), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, K, V, SGQ, SGK, SGV, SGDOV, DO, sdo_h, sdo_t, LSE, DELTA, SGDS, DSINV, KEYS, DQ,
                 T, H, G, qk_scale, sm_scale, QC, QS, KC, KS, VC, VS, DOC, DOS, head_group,
                 D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, QUANT_DS: tl.constexpr, DTYPE: tl.constexpr,
                 PREC: tl.constexpr, EMU: tl.constexpr, QUANT_DOV: tl.constexpr,
                 FP4_MMA: tl.constexpr):
    n_m = tl.cdiv(T, BLOCK_M)
    bh, rank = _schedule(n_m, tl.num_programs(0) // n_m, head_group)
    pid_m = n_m - 1 - rank
    bkv = (bh // H) * (H // G) + (bh % H) // G
    sg_q, sg_k, sg_v = tl.load(SGQ), tl.load(SGK), tl.load(SGV)   # global scales s_g
    sg_dov = tl.load(SGDOV) if QUANT_DOV else 1.0   # dO's s_g in dO V^T: 1 where dO stays BF16
    sg_dp = sg_v * sg_dov
    # (1, 1) unless QUANT_DS
    se_ds, sg_ds = nvfp4_math._global_scales(tl.load(SGDS + bh), nvfp4_math.E4M3_MAX)
    key = tl.load(KEYS + 2 * bh).to(tl.uint32, bitcast=True)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = offs_m < T
    cols = tl.arange(0, D)
    row = bh.to(tl.int64) * T * D
    q = _load_tile(Q + row, offs_m, T, D, True, DTYPE)
    # DO: the incoming dO, or its NVFP4 grid values for fp4_dov / fp4_all (1x16 along D)
    do = tl.load(_head_rows(DO, bh, H, T, D, sdo_h) + offs_m[:, None] * sdo_t + cols[None, :],
                 mask=rmask[:, None], other=0.0).to(DTYPE)
    lse = tl.load(LSE + bh * T + offs_m, mask=rmask, other=float("inf"))
    delta = tl.load(DELTA + bh * T + offs_m, mask=rmask, other=0.0)
    K += bkv.to(tl.int64) * T * D
    V += bkv.to(tl.int64) * T * D
    qc, qs, doc, dos = None, None, None, None
    if FP4_MMA:   # the packed Q (and dO) tiles and K's (and V's) head of the FP4 products
        qc, qs = _load_head(QC, QS, bh, offs_m, T, D, True)
        KC, KS = _head(KC, KS, bkv, T, D, False)
        if QUANT_DOV:
            doc, dos = _load_head(DOC, DOS, bh, offs_m, T, D, True)
            VC, VS = _head(VC, VS, bkv, T, D, False)
    s_scale = qk_scale * sg_q * sg_k
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if CAUSAL:
        lo = pid_m * BLOCK_M
        hi = tl.minimum(lo + BLOCK_M, T)
    else:
        lo = (T // BLOCK_N) * BLOCK_N
        hi = T
    ds_inv = None
    if QUANT_DS:  # dS's element scales by E4M3 code (_ds_setup_kernel)
        ds_inv = tl.load(DSINV + bh * 128 + tl.arange(0, 128))
    dq = _dq_inner(dq, q, do, lse, delta, K, V, key, 0, lo, offs_m, T, s_scale, sg_dp, se_ds, sg_ds,
                   ds_inv, qc, qs, doc, dos, KC, KS, VC, VS, D, BLOCK_M, BLOCK_N, False, CAUSAL,
                   QUANT_DS, DTYPE, PREC, EMU, QUANT_DOV, FP4_MMA)
    dq = _dq_inner(dq, q, do, lse, delta, K, V, key, lo, hi, offs_m, T, s_scale, sg_dp, se_ds,
                   sg_ds, ds_inv, qc, qs, doc, dos, KC, KS, VC, VS, D, BLOCK_M, BLOCK_N, True,
                   CAUSAL, QUANT_DS, DTYPE, PREC, EMU, QUANT_DOV, FP4_MMA)
    dq = dq * (sm_scale * sg_k * sg_ds)
    tl.store(DQ + row + offs_m[:, None] * D + cols[None, :],
             _op(dq, DQ.dtype.element_ty, EMU), mask=rmask[:, None])


@triton.jit
def _ds_setup_kernel(SEED, DONORM, DELTA, SGV, SGDS, KEYS, DSINV, T, sqrt_d,
                     BLOCK_T: tl.constexpr):
    """What dS's SR quantization needs before the passes, per (batch, head), in one launch instead
    of about twenty small torch ops (their launches cost more than their work):
    - SGDS: dS's bound (attention.ds_bound), max_i ||dO_i|| * (sqrt(D) * amax(V)) + max_i |D_i|,
      amax(V) = s_g(V) * 448 * 6 >= every |V_hat|; the same fp32 products and sum (the launch
      disables FMA contraction), maxima that propagate NaN as torch's amax does;
    - KEYS: the two SR stream keys (attention.sr_keys), fmix32(seed * golden + i), i = 2 bh and
      2 bh + 1;
    - DSINV: the element scale for each of the 128 E4M3 block-scale codes from the bound's S_dec
      (nvfp4_math._element_scale: the same correctly rounded reciprocal); the passes look a block's
      up by its code (_fake_quant_rows16's inv_table) where the four threads holding the block
      would each divide (docs/performance.md counts the loops)."""
    bh = tl.program_id(0)
    row = bh.to(tl.int64) * T
    norm_max = tl.zeros((BLOCK_T,), tl.float32)
    delta_max = tl.zeros((BLOCK_T,), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        norm = tl.load(DONORM + row + t, mask=t < T, other=0.0)
        delta = tl.abs(tl.load(DELTA + row + t, mask=t < T, other=0.0))
        norm_max = nvfp4_math._max_nan(norm_max, norm)
        delta_max = nvfp4_math._max_nan(delta_max, delta)
    v_amax = tl.load(SGV) * P_S_ENC
    bound = (nvfp4_math._amax_nan(norm_max, 0) * (sqrt_d * v_amax)
             + nvfp4_math._amax_nan(delta_max, 0))
    tl.store(SGDS + bh, bound)
    i = 2 * bh + tl.arange(0, 2)
    keys = _fmix32(tl.load(SEED).to(tl.uint32) * 0x9E3779B9 + i.to(tl.uint32))
    tl.store(KEYS + i, keys.to(tl.int32, bitcast=True))
    _, s_dec = nvfp4_math._global_scales(bound, nvfp4_math.E4M3_MAX)
    codes = tl.arange(0, 128)
    _, inv = nvfp4_math._element_scale(nvfp4_math._e4m3_value(codes.to(tl.uint8)), s_dec)
    tl.store(DSINV + bh * 128 + codes, inv)


@triton.jit
def _bwd_preprocess(O, so_h, so_t, DO, sdo_h, sdo_t, DELTA, DONORM, N, T, H, D: tl.constexpr,
                    ROWS: tl.constexpr):
    """Per row: D_i = rowsum(dO o O) (App. 11) and ||dO_i||, in one read of O and dO (each stored
    heads-outer or heads-inner: _head_rows)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)       # b * H * T + h * T + t
    cols = tl.arange(0, D)
    m = rows[:, None] < N
    bh, t = rows // T, (rows % T).to(tl.int64)
    o = tl.load(_head_rows(O, bh, H, T, D, so_h)[:, None] + t[:, None] * so_t + cols[None, :],
                mask=m, other=0.0).to(tl.float32)
    do = tl.load(_head_rows(DO, bh, H, T, D, sdo_h)[:, None] + t[:, None] * sdo_t + cols[None, :],
                 mask=m, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=rows < N)
    tl.store(DONORM + rows, tl.sqrt(tl.sum(do * do, 1)), mask=rows < N)


# --------------------------------------------------------------------------------------------------
# launchers

# (BLOCK_M, BLOCK_N, num_warps, num_stages); BLOCK_M is the query tile, BLOCK_N the key tile. The
# causal bands need the larger of the two to be a multiple of the smaller. Chosen by timing on an
# H200 (docs/attention.md).
FWD_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
DKDV_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)
DQ_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
# GPUs with ~100 KB of shared memory a block (kernels/targets.py: sm_86, sm_89, 12.x): DQ_CONFIG
# needs 128 KB at D = 128 (the compiled kernel's metadata), this 72 KB. Untuned: not run there.
DQ_CONFIG_100KB = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2)
# Passes that quantize dS in registers take smaller tiles on 4 warps: the quantizer's temporaries
# next to large dK/dV accumulators spill, and a thread holds 4 elements of every 16-element block
# whatever the tile size. The dQ pass is latency-bound at two programs an SM: its register cap
# (maxnreg, 166 used, nothing spilled on sm_90) and two stages (66 KB of shared memory) fit three.
DKDV_CONFIG_QUANT_DS = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)
DQ_CONFIG_QUANT_DS = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=2, maxnreg=168)
# FP4_MMA (Blackwell): tl.dot_scaled lowers to the block-scaled FP4 MMA only for 128 rows (tiles of
# 64 rows compile to a bf16 MMA on upcast operands), and P^T dO (fp4_all) contracts over the query
# tile, which must hold the MMA's K step (64). Untuned: not run on a Blackwell GPU.
SM100_CONFIGS = {"fwd": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
                 "dkdv": dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
                 "dq": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2)}
# The forward's key tile is part of the fp4_pv / fp4_all numbers (P~ = exp(S - running max) is
# quantized per tile), so the reference uses it too. Every other policy's values do not depend on
# the tiles, its bits do: another forward tile changes O's last bits on the H200 (the MMA's shape
# sets its summation order; docs/performance.md).
P_BLOCK_N = FWD_CONFIG["BLOCK_N"]
# The interpreter (CPU tests) runs small tiles: the same numbers, much faster. Chosen by
# TRITON_INTERPRET (_interpreting), not by the tensors' device: Triton takes the interpreter for the
# whole process when the kernels are decorated, and tests/compile_for_target.py launches on CPU
# tensors what it compiles for a GPU, which must get the GPU's tiles.
INTERPRET_CONFIGS = {"fwd": dict(BLOCK_M=32, BLOCK_N=16), "dkdv": dict(BLOCK_M=16, BLOCK_N=32),
                     "dq": dict(BLOCK_M=32, BLOCK_N=16)}

# The launch order (_schedule) takes the heads in groups: as many kv heads as fit this much L2 with
# what a pass streams of each (its G query heads' Q and dO in the dK/dV pass, more than the K and V
# the forward and dQ pass stream), a power of two, as FlashAttention's scheduler sizes its sections
# (H100 and H200 have 50 MB).
SCHEDULE_L2_BYTES = 32 * 2**20


def _kv_head_group(T, D, G, itemsize):
    """kv heads a group of _schedule takes (the passes over query heads take their G * as many)."""
    fit = max(1, SCHEDULE_L2_BYTES // (2 * G * T * D * itemsize))
    return 1 << (fit.bit_length() - 1)


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _meta(dtype, kind, config, D):
    cfg = dict(config)
    emulate = False
    if _interpreting():
        cfg.update(INTERPRET_CONFIGS[kind])
        emulate = dtype == torch.bfloat16
    return dict(DTYPE=tl.float32 if emulate else _TL_DTYPE[dtype], EMU=emulate,
                PREC="ieee" if dtype == torch.float32 else "tf32", D=D, **cfg)


def _packed(*tensors):
    """FP4_MMA's operand arguments: (codes, scales) of each packed tensor (nvfp4.NVFP4Tensor), or
    (None, None) for a product this call does not take to the FP4 MMA."""
    return [x for t in tensors
            for x in ((None, None) if t is None else (t.codes.contiguous(), t.scales.contiguous()))]


def heads_strides(x):
    """x (B, H, T, D) with its (head stride, row stride) in elements where it is stored heads-outer
    ((B, H, T, D) contiguous) or heads-inner ((B, T, H, D) contiguous: a linear layer's output seen
    as heads), which the kernels read and write in place (_head_rows); in any other layout, a
    heads-outer copy."""
    B, H, T, D = x.shape
    for sh, st in ((T * D, D), (D, H * D)):
        if (x.stride(3) == 1 and (B == 1 or x.stride(0) == H * T * D)
                and (H == 1 or x.stride(1) == sh) and (T == 1 or x.stride(2) == st)):
            return x, sh, st
    return x.contiguous(), T * D, D


def ds_setup(seed, do_norm, delta, v_global_scale, D):
    """dS's SR quantization inputs (_ds_setup_kernel): seed, a 0-d int64 tensor on the device
    (nvfp4.sr_seed); do_norm (B, H, T) fp32: the row norms of the dO that enters dP; delta
    (B, H, T) fp32; v_global_scale: V's 0-d fp32 s_g; D: the head dim. -> (ds_amax (B*H,) fp32,
    the bounds attention.ds_bound gives; keys (B*H, 2) int32, the bits of attention.sr_keys;
    ds_inv (B*H, 128) fp32, the element scales by block-scale code)."""
    B, H, T = delta.shape
    dev = delta.device
    ds_amax = torch.empty(B * H, device=dev, dtype=torch.float32)
    keys = torch.empty(B * H, 2, device=dev, dtype=torch.int32)
    ds_inv = torch.empty(B * H, 128, device=dev, dtype=torch.float32)
    _ds_setup_kernel[(B * H,)](seed, do_norm.contiguous(), delta.contiguous(), v_global_scale,
                               ds_amax, keys, ds_inv, T, math.sqrt(D),
                               BLOCK_T=256 if _interpreting() else 1024, enable_fp_fusion=False)
    return ds_amax, keys, ds_inv


def flash_forward(q, k, v, sg, causal, sm_scale, sg_p, dtype, packed=None):
    """q (B, H, T, D), k, v (B, Hkv, T, D): operand values (bf16 grid values q * s_b for NVFP4
    operands).
    sg: their global scales (s_g(Q), s_g(K), s_g(V)), 0-d fp32 tensors (ones for BF16 operands).
    sg_p: P's global scale (a float) where P V quantizes P (fp4_pv, fp4_all), else None.
    packed: the NVFP4Tensors (Q, K, V) whose grid values q, k, v are, or None; on a GPU with FP4
    tensor cores (use_dot_scaled) Q K^T multiplies their codes and scales.
    Returns o (B, H, T, D) in dtype, stored heads-inner ((B, T, H, D) memory: the output projection
    reads it as (B, T, H * D) without a copy), and lse2 (B, H, T) fp32 (log2 domain)."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty(B, T, H, D, device=q.device, dtype=dtype).transpose(1, 2)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    fp4_mma = packed is not None and use_dot_scaled(q.device)
    meta = _meta(dtype, "fwd", SM100_CONFIGS["fwd"] if fp4_mma else FWD_CONFIG, D)
    # the numbers depend on the key tile: keep the reference's (and a query tile it divides)
    if sg_p is not None:
        meta["BLOCK_N"] = P_BLOCK_N
        meta["BLOCK_M"] = max(meta["BLOCK_M"], P_BLOCK_N)
    G = H // Hkv
    grid = (triton.cdiv(T, meta["BLOCK_M"]) * B * H,)
    _attn_fwd[grid](q, k, v, *sg, 1.0 if sg_p is None else sg_p, o, lse, T, H, G,
                    sm_scale * LOG2E, *_packed(*(packed[:2] if fp4_mma else (None, None))),
                    G * _kv_head_group(T, D, G, q.element_size()), CAUSAL=causal,
                    QUANT_P=sg_p is not None, FP4_MMA=fp4_mma, **meta)
    return o, lse


def flash_backward(q, k, v, sg, do, lse, delta, do_dov, do_pdo, ds, causal, sm_scale, dtype,
                   packed=None):
    """dq (B, H, T, D), dk, dv (B, Hkv, T, D) in dtype, dv stored heads-inner ((B, T, Hkv, D)
    memory: the V projection's backward reads it as (B, T, Hkv * D) without a copy). q, k, v: as
    flash_forward's; do: dO,
    heads-outer or heads-inner (heads_strides: read in place), as the output's gradient arrives;
    sg: their
    global scales, then dO's in dO V^T and in P^T dO (None where unused), then P's in P^T dO (a
    float, None where unused). do_dov / do_pdo: dO's NVFP4 grid values (q * s_b) for dO V^T /
    P^T dO (fp4_dov, fp4_all), or None; ds: what ds_setup returns (dS's bounds, from which its
    global scales derive, the SR streams' keys of the dQ and dK passes, the element-scale tables),
    or None (dS in BF16).
    packed: the NVFP4Tensors (Q, K, V, dO for dO V^T or None, dO for P^T dO (T zero-padded to a
    multiple of 16) or None) behind those grid values, or None; on a GPU with FP4 tensor cores
    (use_dot_scaled) the products whose operands are all blocked along the contraction multiply
    their codes and scales."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    do, sdo_h, sdo_t = heads_strides(do)
    dev = q.device
    quant_ds, quant_dov, quant_pdo = ds is not None, do_dov is not None, do_pdo is not None
    do_dov = do_dov.contiguous() if quant_dov else do
    do_pdo = do_pdo.contiguous() if quant_pdo else do
    sg_q, sg_k, sg_v, sg_dov, sg_pdo, sg_p = sg
    sg_dov = sg_dov if quant_dov else sg_q     # any fp32 pointer where the kernels do not load it
    sg_pdo = sg_pdo if quant_pdo else sg_q
    if quant_ds:
        ds_amax, keys, ds_inv = ds
    else:
        ds_amax = torch.full((B * H,), P_S_ENC.value, device=dev)  # 448 * 6: scales (1, 1)
        keys = torch.zeros(B * H, 2, device=dev, dtype=torch.int32)
        ds_inv = ds_amax  # not read
    dq = torch.empty(B, H, T, D, device=dev, dtype=dtype)
    dk = torch.empty(B, Hkv, T, D, device=dev, dtype=dtype)
    dv = torch.empty(B, T, Hkv, D, device=dev, dtype=dtype).transpose(1, 2)  # heads-inner
    fp4_mma = packed is not None and use_dot_scaled(dev)
    qp, kp, vp, dovp, pdop = packed if fp4_mma else (None,) * 5
    vp = vp if dovp is not None else None            # V's codes: only for dO V^T (fp4_dov, fp4_all)
    meta = _meta(dtype, "dkdv", SM100_CONFIGS["dkdv"] if fp4_mma else
                 DKDV_CONFIG_QUANT_DS if quant_ds else DKDV_CONFIG, D)
    G = H // Hkv
    kv_group = _kv_head_group(T, D, G, q.element_size())
    grid = (triton.cdiv(T, meta["BLOCK_N"]) * B * Hkv,)
    _attn_bwd_dkdv[grid](q, k, v, sg_q, sg_k, sg_v, 1.0 if sg_p is None else sg_p, sg_dov, sg_pdo,
                         do, do_dov, do_pdo, lse, delta, ds_amax, ds_inv, keys,
                         dk, dv, T, H, G, sm_scale * LOG2E, sm_scale,
                         *_packed(qp, kp, vp, dovp, pdop), kv_group, sdo_t=sdo_t, CAUSAL=causal,
                         QUANT_DS=quant_ds, QUANT_DOV=quant_dov, QUANT_PDO=quant_pdo,
                         FP4_MMA=fp4_mma, **meta)
    meta = _meta(dtype, "dq", SM100_CONFIGS["dq"] if fp4_mma else
                 DQ_CONFIG_QUANT_DS if quant_ds else
                 DQ_CONFIG_100KB if 0 < targets.of(dev).shared <= 101376 else DQ_CONFIG, D)
    grid = (triton.cdiv(T, meta["BLOCK_M"]) * B * H,)
    # the dO of dP = dO V^T: its NVFP4 grid values (contiguous) for fp4_dov / fp4_all, else dO
    sdov = (T * D, D) if quant_dov else (sdo_h, sdo_t)
    _attn_bwd_dq[grid](q, k, v, sg_q, sg_k, sg_v, sg_dov, do_dov, *sdov, lse, delta, ds_amax,
                       ds_inv, keys, dq, T, H, G, sm_scale * LOG2E, sm_scale,
                       *_packed(qp, kp, vp, dovp), G * kv_group, CAUSAL=causal, QUANT_DS=quant_ds,
                       QUANT_DOV=quant_dov, FP4_MMA=fp4_mma, **meta)
    return dq, dk, dv


def bwd_preprocess(o, do):
    """delta (B, H, T) = rowsum(dO o O) and ||dO|| per row (B, H, T), fp32; o and do each
    heads-outer or heads-inner (heads_strides: read in place)."""
    B, H, T, D = o.shape
    (o, *so), (do, *sdo) = heads_strides(o), heads_strides(do)
    delta = torch.empty(B, H, T, device=o.device, dtype=torch.float32)
    donorm = torch.empty_like(delta)
    rows = 16 if _interpreting() else 64
    _bwd_preprocess[(triton.cdiv(B * H * T, rows),)](o, *so, do, *sdo, delta, donorm, B * H * T, T,
                                                     H, D=D, ROWS=rows)
    return delta, donorm
