"""
Flash attention kernels for attention.py (paper §3.5, App. 11): forward, and a backward whose dK/dV pass (one
key tile of one kv head) either leaves dQ to a dQ pass per query tile that recomputes S, P, dP (DQ_MODE
"separate", the default: 7 matmuls, deterministic, and faster for fp4) or also adds dS K into an fp32 dQ with
atomics ("atomic", 5 matmuls as in FlashAttention-2). Causal or not, any T; GQA without repeating K/V (query
head h reads kv head h // G; the dK/dV pass loops over the G query heads of its kv head and sums in registers).

FP4 operands (PACKED): Q, K, V arrive as packed E2M1 codes (two per byte) + E4M3 1x16 block scales, quantized
once by nvfp4.quantize. Every pass loads the 4-bit codes (the IO saving: a quarter of BF16's bytes, on every
one of the 3 passes that reads Q, K and V) and dequantizes in registers to q * s_b, which is exact in BF16
(at most 6 significant bits); the per-tensor global scales multiply the fp32 accumulators afterwards. On Hopper
this is the same arithmetic a native NVFP4 tensor-core GEMM does, up to summation order (DESIGN.md). On
Blackwell, `tl.dot_scaled` with e2m1 operands and e4m3 scales would be the native path; untested here.
attention.QKV_OPERANDS chooses between these packed operands and bf16 grid values q * s_b written by the quantize
pass (PACKED=False: the bf16 kernels with the global scales applied): the default on Hopper, where the decode
competes with the matmuls for issue slots (H200 fp4 fwd+bwd 3.1 vs 5.0 ms).

In-register quantization (`_fake_quant_rows16`): tiles of P (fp4_pv / fp4_all) and dS are quantized in 1x16
blocks along the tile's last dim with nvfp4_quant's block scale and correctly rounded divisions (nvfp4.quantize's
formulas), so the torch mirror in attention.py gives the same bits. SR draws 16 random bits per element from a
counter hash of its (head, query, key) position (`_ds_random_words`), so it does not depend on tile sizes and the
reference reproduces it. In the MMA tiles a thread holds 4 elements of each 16-element block, so the per-block
work (amax, E4M3 scale, reciprocal) counts as much as the per-element work.

Scores live in the log2 domain (S * sm_scale * log2 e), as in Triton's fused-attention tutorial; the forward
saves lse2 = m + log2(l) per row, the backward recomputes P = exp2(S2 - lse2).
"""

import torch
import triton
import triton.language as tl

from kernels import nvfp4_quant

LOG2E = 1.4426950408889634


def _interpreting():
    import os
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _patch_interpreter_loop_bounds():
    """Triton 3.6's interpreter holds scalars as shape-(1,) numpy arrays and turns them into loop bounds with
    int(array), which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted"): every `range(lo, hi)`
    with runtime bounds fails. Convert through .item() instead. Interpreter only; a no-op on older NumPy."""
    import triton.runtime.interpreter as interp
    if getattr(interp, "_nanofp4_index_patch", False):
        return
    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    interp._nanofp4_index_patch = True


if _interpreting():
    _patch_interpreter_loop_bounds()
# Markstein's fma-corrected division (nvfp4_quant._div_by) needs a true fma: the GPU, not the interpreter
EXACT_FMA = tl.constexpr(nvfp4_quant._exact_fma())


# ----------------------------------------------------------------------------------------------------------
# helpers

@triton.jit
def _load_tile(ptr, scale_ptr, rows, T, R: tl.constexpr, D: tl.constexpr, PACKED: tl.constexpr,
               MASK_ROWS: tl.constexpr, DTYPE: tl.constexpr):
    """(R, D) tile of rows `rows` of a (T, D) operand, in DTYPE. PACKED: codes (T, D/2) uint8 + scales (T, D/16)
    e4m3, returned as q * s_b (no global scale). Rows >= T read as 0 when MASK_ROWS."""
    cols = tl.arange(0, D)
    rmask = rows[:, None] < T
    if PACKED:
        half = tl.arange(0, D // 2)
        if MASK_ROWS:
            c = tl.load(ptr + rows[:, None] * (D // 2) + half[None, :], mask=rmask, other=0)
            s = tl.load(scale_ptr + rows[:, None] * (D // 16) + cols[None, :] // 16, mask=rmask, other=0.0)
        else:
            c = tl.load(ptr + rows[:, None] * (D // 2) + half[None, :])
            s = tl.load(scale_ptr + rows[:, None] * (D // 16) + cols[None, :] // 16)
        # E2M1 code -> the E4M3 bit pattern of (its value * 2^-6): sign to bit 7, exponent+mantissa to bits 4..2
        # (exact for the subnormal 0.5 too); the hardware's fp8 -> fp16 convert then does the decoding. Both
        # nibbles of a byte at once; the even element is the low nibble.
        lo = ((c & 0x08) << 4) | ((c & 0x07) << 2)
        hi = (c & 0x80) | ((c & 0x70) >> 2)
        fp8 = tl.reshape(tl.join(lo, hi), (R, D)).to(tl.float8e4nv, bitcast=True)
        # q * s_b in fp16 is exact (<= 6 significant bits, 2^-10 <= |q s_b| <= 2688) and so is the cast to DTYPE
        x = (fp8.to(tl.float16) * (s.to(tl.float16) * 64.0)).to(DTYPE)
    else:
        if MASK_ROWS:
            x = tl.load(ptr + rows[:, None] * D + cols[None, :], mask=rmask, other=0.0).to(DTYPE)
        else:
            x = tl.load(ptr + rows[:, None] * D + cols[None, :]).to(DTYPE)
    return x


@triton.jit
def _round_bf16(x, EMULATE_BF16: tl.constexpr):
    """Interpreter only (EMULATE_BF16): fp32 rounded to the nearest bf16, ties to even, still in fp32. The
    interpreter's own fp32 -> bf16 cast truncates, and its tl.dot multiplies bf16 bit patterns as integers, so
    bf16 runs there multiply bf16-valued fp32 tiles instead: the same products. A no-op on the GPU."""
    if EMULATE_BF16:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x


@triton.jit
def _op(x, DTYPE: tl.constexpr, EMULATE_BF16: tl.constexpr):
    """A computed tile (P, dS) as a matmul operand in DTYPE (fp32 holding bf16 values when emulating)."""
    return _round_bf16(x, EMULATE_BF16).to(DTYPE)


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
    """(R, C) random words for SR (nvfp4_quant's convention: the uniform is (word >> 8) * 2^-24) for a dS tile
    whose rows are `rows` and whose last dim runs over c0 + arange(C) (c0 even), of the head whose stream key is
    `key` (uint32). 16 random bits per element: the elements 2j and 2j + 1 along the last dim share one hash of
    the pair's (query, key) counter, the even one taking its low half and the odd one its high half (half the
    hashing of a word per element; u is then a multiple of 2^-16, which biases a rounding decision by < 2^-16 of
    an E2M1 step). The tile is (queries, keys), or (keys, queries) when QUERY_PAIRS (dS^T in the dK/dV pass).
    attention.sr_uniforms draws the same u."""
    cols = c0 + 2 * tl.arange(0, C // 2)
    if QUERY_PAIRS:
        counter = cols[None, :] * T + rows[:, None]
    else:
        counter = rows[:, None] * T + cols[None, :]
    w = _fmix32(counter.to(tl.uint32) * 0x9E3779B1 + key)                          # (R, C / 2)
    return tl.reshape(tl.join(w << 16, w & 0xFFFF0000), (R, C))


@triton.jit
def _fake_quant_rows16(x, s_g, r, R: tl.constexpr, C: tl.constexpr, SR: tl.constexpr):
    """NVFP4 quantize-dequantize of an (R, C) fp32 tile in 1x16 blocks along its last dim, with global scale
    s_g: returns q * s_b (the caller applies s_g). nvfp4_quant's own block scale, division and E2M1 rounding
    (so the formulas are nvfp4.quantize's): s_b = e4m3(min(amax/6/s_g, 448)), a = |x| / (s_b s_g) clamped to 6,
    RTN ties-to-even or SR from the random words r (R, C) (up iff (r >> 8) * 2^-24 < the fractional distance)."""
    xb = tl.reshape(x, (R, C // 16, 16))
    s_b, _, den, inv = nvfp4_quant._block_scale(tl.max(tl.abs(xb), axis=2), s_g, 6.0, EXACT_FMA)
    a = tl.minimum(nvfp4_quant._div_by(tl.abs(xb), den[:, :, None], inv[:, :, None], EXACT_FMA), 6.0)
    # Rounded in the value domain (nvfp4_quant's _sr_e2m1 / _rtn_e2m1 make code indices, which a tile that is
    # multiplied right away would have to decode again). E2M1's grid has step p / 2 with p = 2^floor(log2 max(a, 1)),
    # read off the exponent bits: 0.5 on [0, 2), 1 on [2, 4), 2 on [4, 6].
    pbits = tl.maximum(a, 1.0).to(tl.int32, bitcast=True) & 0x7F800000
    if SR:   # up iff u = (r >> 8) * 2^-24 < y - floor(y) for y = a / step (exact: step is a power of two)
        y = a * ((255 << 23) - pbits).to(tl.float32, bitcast=True)                # 2 / p
        fl = tl.floor(y)
        up = (tl.reshape(r, (R, C // 16, 16)) >> 8).to(tl.float32) < (y - fl) * 16777216.0   # both sides exact
        v = (fl + up.to(tl.float32)) * (pbits - (1 << 23)).to(tl.float32, bitcast=True)   # * p / 2
    else:    # RTN ties-to-even: adding c = 2^22 p leaves exactly the grid's bits (ulp(c) = step)
        c = (pbits + (22 << 23)).to(tl.float32, bitcast=True)
        v = (a + c) - c
    v = v * s_b[:, :, None]
    v = tl.where(xb < 0, -v, v)
    return tl.reshape(v, (R, C))


# ----------------------------------------------------------------------------------------------------------
# forward

@triton.jit
def _fwd_inner(acc, l_i, m_i, q, K, Ks, V, Vs, start, end, offs_m, T, s_scale, sg_p,
               D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
               CAUSAL: tl.constexpr, PACKED: tl.constexpr, QUANT_P: tl.constexpr, DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr,
               PREC: tl.constexpr, EMU: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, Ks, offs_n, T, BLOCK_N, D, PACKED, MASK, QK_DTYPE)            # (N, D)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * s_scale                   # (M, N) log2 domain
        if MASK:
            ok = offs_n[None, :] < T
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])                                         # P~ = exp(S - m)
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)   # the normalizer uses the exact P~ (quantized P breaks the simplex)
        acc = acc * alpha[:, None]
        v = _load_tile(V, Vs, offs_n, T, BLOCK_N, D, PACKED, MASK, DTYPE)            # (N, D)
        if QUANT_P:
            p = _fake_quant_rows16(p, sg_p, p, BLOCK_M, BLOCK_N, False)              # 1x16 along keys, RTN
        acc = tl.dot(_op(p, DTYPE, EMU), v, acc, input_precision=PREC)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, Qs, K, Ks, V, Vs, SG, O, LSE, T, H, G, qk_scale,
              D: tl.constexpr, QD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, PACKED: tl.constexpr, QUANT_P: tl.constexpr, DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr,
              PREC: tl.constexpr, EMU: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)   # heaviest causal tiles first
    bh = tl.program_id(1)
    bkv = (bh // H) * (H // G) + (bh % H) // G            # the kv head of query head h: h // G
    Q += bh.to(tl.int64) * T * QD
    K += bkv.to(tl.int64) * T * QD
    V += bkv.to(tl.int64) * T * QD
    Qs += bh.to(tl.int64) * T * (D // 16)
    Ks += bkv.to(tl.int64) * T * (D // 16)
    Vs += bkv.to(tl.int64) * T * (D // 16)
    sg_q = tl.load(SG)
    sg_k = tl.load(SG + 1)
    sg_v = tl.load(SG + 2)
    sg_p = tl.load(SG + 3)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    q = _load_tile(Q, Qs, offs_m, T, BLOCK_M, D, PACKED, True, QK_DTYPE)                 # (M, D)
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
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, Ks, V, Vs, 0, lo, offs_m, T, s_scale, sg_p,
                               D, BLOCK_M, BLOCK_N, False, CAUSAL, PACKED, QUANT_P, DTYPE, QK_DTYPE, PREC, EMU)
    acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, K, Ks, V, Vs, lo, hi, offs_m, T, s_scale, sg_p,
                               D, BLOCK_M, BLOCK_N, True, CAUSAL, PACKED, QUANT_P, DTYPE, QK_DTYPE, PREC, EMU)
    o = acc * ((sg_v * sg_p) / l_i)[:, None]   # s_g(P) is 1 unless QUANT_P
    rmask = offs_m < T
    tl.store(LSE + bh.to(tl.int64) * T + offs_m, m_i + tl.math.log2(l_i), mask=rmask)
    cols = tl.arange(0, D)
    tl.store(O + bh.to(tl.int64) * T * D + offs_m[:, None] * D + cols[None, :],
             _round_bf16(o, EMU).to(O.dtype.element_ty),
             mask=rmask[:, None])


# ----------------------------------------------------------------------------------------------------------
# backward: dK, dV for one key tile of one kv head (loops over its G query heads and all query tiles)

@triton.jit
def _dkdv_inner(dk, dv, k, v, Q, Qs, DO, DOQ, DOT, LSE, DELTA, DQ, key, key_dq, dq_scale, start, end, offs_n,
                T, s_scale, sg_dp, sg_ds, sg_p, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, PACKED: tl.constexpr, QUANT_DS: tl.constexpr,
                QUANT_DOV: tl.constexpr, QUANT_PDO: tl.constexpr, ATOMIC_DQ: tl.constexpr, DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr,
                PREC: tl.constexpr, EMU: tl.constexpr):
    cols = tl.arange(0, D)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        rmask = offs_m < T
        q = _load_tile(Q, Qs, offs_m, T, BLOCK_M, D, PACKED, True, QK_DTYPE)             # (M, D)
        do = tl.load(DO + offs_m[:, None] * D + cols[None, :], mask=rmask[:, None], other=0.0).to(DTYPE)
        lse = tl.load(LSE + offs_m, mask=rmask, other=float("inf"))                  # rows >= T: P = 0
        delta = tl.load(DELTA + offs_m, mask=rmask, other=0.0)
        sT = tl.dot(k, tl.trans(q), input_precision=PREC) * s_scale                  # (N, M)
        pT = tl.math.exp2(sT - lse[None, :])
        if MASK:
            if CAUSAL:
                pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        if not CAUSAL:   # keys >= T (zero rows of a partial key tile) must not reach dS's block amax
            pT = tl.where(offs_n[:, None] < T, pT, 0.0)
        if QUANT_PDO:   # fp4_all: P^T dO with P in 1x16 blocks along the queries (its contraction dim)
            doT = tl.load(DOT + offs_m[:, None] * D + cols[None, :], mask=rmask[:, None], other=0.0).to(DTYPE)
            pq = _fake_quant_rows16(pT, sg_p, pT, BLOCK_N, BLOCK_M, False)
            dv = tl.dot(_op(pq, DTYPE, EMU), doT, dv, input_precision=PREC)
        else:
            dv = tl.dot(_op(pT, DTYPE, EMU), do, dv, input_precision=PREC)                  # dV += P^T dO
        if QUANT_DOV:
            doq = tl.load(DOQ + offs_m[:, None] * D + cols[None, :], mask=rmask[:, None], other=0.0).to(DTYPE)
            dpT = tl.dot(v, tl.trans(doq), input_precision=PREC) * sg_dp
        else:
            dpT = tl.dot(v, tl.trans(do), input_precision=PREC) * sg_dp              # dP^T = V dO^T
        dsT = pT * (dpT - delta[None, :])                                            # dS = P (dP - D)
        if ATOMIC_DQ:  # dQ += dS K here (fp32 atomics) instead of recomputing S, P, dP in a dQ pass
            if QUANT_DS:   # dQ = dS K contracts over keys: 1x16 blocks of dS along the keys, SR
                r = _ds_random_words(key_dq, offs_m, tl.program_id(0) * BLOCK_N, T, BLOCK_M, BLOCK_N, False)  # n0
                ds = _fake_quant_rows16(tl.trans(dsT), sg_ds, r, BLOCK_M, BLOCK_N, True)   # (M, N)
                ds = _op(ds, QK_DTYPE, EMU)
            else:
                ds = tl.trans(_op(dsT, QK_DTYPE, EMU))   # transpose the 16-bit operand, not the fp32 tile
            dq = tl.dot(ds, k, input_precision=PREC) * dq_scale
            tl.atomic_add(DQ + offs_m[:, None] * D + cols[None, :], dq, mask=rmask[:, None], sem="relaxed")
        if QUANT_DS:   # dK = dS^T Q contracts over queries: 1x16 blocks of dS^T along the queries, SR
            r = _ds_random_words(key, offs_n, start_m, T, BLOCK_N, BLOCK_M, True)
            dsT = _fake_quant_rows16(dsT, sg_ds, r, BLOCK_N, BLOCK_M, True)
        dk = tl.dot(_op(dsT, QK_DTYPE, EMU), q, dk, input_precision=PREC)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q, Qs, K, Ks, V, Vs, SG, DO, DOQ, DOT, LSE, DELTA, SGDS, KEYS, DK, DV, DQ, T, H, G,
                   qk_scale, sm_scale, D: tl.constexpr, QD: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, PACKED: tl.constexpr, QUANT_DS: tl.constexpr,
                   QUANT_DOV: tl.constexpr, QUANT_PDO: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                   DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr, PREC: tl.constexpr, EMU: tl.constexpr):
    pid_n = tl.program_id(0)
    bkv = tl.program_id(1)                    # b * Hkv + kv head
    Hkv = H // G
    b = bkv // Hkv
    g0 = (bkv % Hkv) * G                      # first query head of this kv head
    sg_q = tl.load(SG)
    sg_k = tl.load(SG + 1)
    sg_v = tl.load(SG + 2)
    sg_p = tl.load(SG + 3)
    sg_dov = tl.load(SG + 4)
    sg_pdo = tl.load(SG + 5)
    sg_dp = sg_v * sg_dov                     # s_g(dO) is 1 unless QUANT_DOV
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k = _load_tile(K + bkv.to(tl.int64) * T * QD, Ks + bkv.to(tl.int64) * T * (D // 16), offs_n, T,
                   BLOCK_N, D, PACKED, True, QK_DTYPE)
    v = _load_tile(V + bkv.to(tl.int64) * T * QD, Vs + bkv.to(tl.int64) * T * (D // 16), offs_n, T,
                   BLOCK_N, D, PACKED, True, DTYPE)
    s_scale = qk_scale * sg_q * sg_k
    dk = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, D], dtype=tl.float32)
    if CAUSAL:
        lo = pid_n * BLOCK_N                  # queries < lo see none of these keys
        # the diagonal band (queries < lo + BLOCK_N, rounded up to whole query tiles) needs the causal mask
        mid = tl.minimum(lo + tl.cdiv(BLOCK_N, BLOCK_M) * BLOCK_M, T)
    else:
        lo = 0
        mid = 0
    n_full = mid + ((T - mid) // BLOCK_M) * BLOCK_M
    # dK = sum_g s_g(dS_g) (dS_g^T Q_g) over the G query heads of this kv head. One accumulator for all of them
    # (a second 128 x 128 fp32 one pushed this kernel into ~600 spill stores): dk holds the sum in units of the
    # current head's s_g(dS), rescaled by s_g(previous) / s_g(current) at each head boundary.
    sg_prev = tl.load(SGDS + b * H + g0)
    for g in range(G):
        bh = b * H + g0 + g
        q_ptr = Q + bh.to(tl.int64) * T * QD
        qs_ptr = Qs + bh.to(tl.int64) * T * (D // 16)
        row = bh.to(tl.int64) * T * D
        sg_ds = tl.load(SGDS + bh)
        key = tl.load(KEYS + 2 * bh + 1).to(tl.uint32, bitcast=True)
        key_dq = tl.load(KEYS + 2 * bh).to(tl.uint32, bitcast=True)
        dq_scale = sm_scale * sg_k * sg_ds
        dk = dk * tl.div_rn(sg_prev, sg_ds)
        sg_prev = sg_ds
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, qs_ptr, DO + row, DOQ + row, DOT + row,
                             LSE + bh * T, DELTA + bh * T, DQ + row, key, key_dq, dq_scale,
                             lo, mid, offs_n, T, s_scale,
                             sg_dp, sg_ds, sg_p, D, BLOCK_M, BLOCK_N, True, CAUSAL, PACKED, QUANT_DS,
                             QUANT_DOV, QUANT_PDO, ATOMIC_DQ, DTYPE, QK_DTYPE, PREC, EMU)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, qs_ptr, DO + row, DOQ + row, DOT + row,
                             LSE + bh * T, DELTA + bh * T, DQ + row, key, key_dq, dq_scale,
                             mid, n_full, offs_n, T, s_scale,
                             sg_dp, sg_ds, sg_p, D, BLOCK_M, BLOCK_N, False, CAUSAL, PACKED, QUANT_DS,
                             QUANT_DOV, QUANT_PDO, ATOMIC_DQ, DTYPE, QK_DTYPE, PREC, EMU)
        dk, dv = _dkdv_inner(dk, dv, k, v, q_ptr, qs_ptr, DO + row, DOQ + row, DOT + row,
                             LSE + bh * T, DELTA + bh * T, DQ + row, key, key_dq, dq_scale,
                             n_full, T, offs_n, T, s_scale,
                             sg_dp, sg_ds, sg_p, D, BLOCK_M, BLOCK_N, True, CAUSAL, PACKED, QUANT_DS,
                             QUANT_DOV, QUANT_PDO, ATOMIC_DQ, DTYPE, QK_DTYPE, PREC, EMU)
    dk = dk * (sg_prev * sm_scale * sg_q)
    dv = dv * (sg_p * sg_pdo)                 # 1 unless QUANT_PDO
    cols = tl.arange(0, D)
    out = bkv.to(tl.int64) * T * D + offs_n[:, None] * D + cols[None, :]
    nmask = offs_n[:, None] < T
    tl.store(DK + out, _round_bf16(dk, EMU).to(DK.dtype.element_ty), mask=nmask)
    tl.store(DV + out, _round_bf16(dv, EMU).to(DV.dtype.element_ty), mask=nmask)


# ----------------------------------------------------------------------------------------------------------
# backward: dQ for one query tile of one query head

@triton.jit
def _dq_inner(dq, q, do, lse, delta, K, Ks, V, Vs, key, start, end, offs_m, T, s_scale, sg_dp, sg_ds,
              D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
              CAUSAL: tl.constexpr, PACKED: tl.constexpr, QUANT_DS: tl.constexpr, DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr,
              PREC: tl.constexpr, EMU: tl.constexpr):
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(K, Ks, offs_n, T, BLOCK_N, D, PACKED, MASK, QK_DTYPE)
        v = _load_tile(V, Vs, offs_n, T, BLOCK_N, D, PACKED, MASK, DTYPE)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * s_scale                   # (M, N)
        p = tl.math.exp2(s - lse[:, None])
        if MASK:
            ok = offs_n[None, :] < T
            if CAUSAL:
                ok = ok & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(ok, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC) * sg_dp                   # dP = dO V^T
        ds = p * (dp - delta[:, None])
        if QUANT_DS:   # dQ = dS K contracts over keys: 1x16 blocks of dS along the keys, SR
            r = _ds_random_words(key, offs_m, start_n, T, BLOCK_M, BLOCK_N, False)
            ds = _fake_quant_rows16(ds, sg_ds, r, BLOCK_M, BLOCK_N, True)
        dq = tl.dot(_op(ds, QK_DTYPE, EMU), k, dq, input_precision=PREC)
    return dq


@triton.jit
def _attn_bwd_dq(Q, Qs, K, Ks, V, Vs, SG, DO, DOQ, LSE, DELTA, SGDS, KEYS, DQ, T, H, G, qk_scale, sm_scale,
                 D: tl.constexpr, QD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, PACKED: tl.constexpr, QUANT_DS: tl.constexpr, QUANT_DOV: tl.constexpr, DTYPE: tl.constexpr, QK_DTYPE: tl.constexpr,
                 PREC: tl.constexpr, EMU: tl.constexpr):
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    bkv = (bh // H) * (H // G) + (bh % H) // G
    sg_q = tl.load(SG)
    sg_k = tl.load(SG + 1)
    sg_v = tl.load(SG + 2)
    sg_dov = tl.load(SG + 4)
    sg_dp = sg_v * sg_dov
    sg_ds = tl.load(SGDS + bh)                # 1 unless QUANT_DS
    key = tl.load(KEYS + 2 * bh).to(tl.uint32, bitcast=True)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = offs_m < T
    cols = tl.arange(0, D)
    row = bh.to(tl.int64) * T * D
    q = _load_tile(Q + bh.to(tl.int64) * T * QD, Qs + bh.to(tl.int64) * T * (D // 16), offs_m, T,
                   BLOCK_M, D, PACKED, True, QK_DTYPE)
    if QUANT_DOV:   # dO V^T with dO in NVFP4 (1x16 along D, passed as q * s_b)
        do = tl.load(DOQ + row + offs_m[:, None] * D + cols[None, :], mask=rmask[:, None], other=0.0).to(DTYPE)
    else:
        do = tl.load(DO + row + offs_m[:, None] * D + cols[None, :], mask=rmask[:, None], other=0.0).to(DTYPE)
    lse = tl.load(LSE + bh * T + offs_m, mask=rmask, other=float("inf"))
    delta = tl.load(DELTA + bh * T + offs_m, mask=rmask, other=0.0)
    K += bkv.to(tl.int64) * T * QD
    V += bkv.to(tl.int64) * T * QD
    Ks += bkv.to(tl.int64) * T * (D // 16)
    Vs += bkv.to(tl.int64) * T * (D // 16)
    s_scale = qk_scale * sg_q * sg_k
    dq = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if CAUSAL:
        lo = pid_m * BLOCK_M
        hi = tl.minimum(lo + BLOCK_M, T)
    else:
        lo = (T // BLOCK_N) * BLOCK_N
        hi = T
    dq = _dq_inner(dq, q, do, lse, delta, K, Ks, V, Vs, key, 0, lo, offs_m, T, s_scale, sg_dp, sg_ds,
                   D, BLOCK_M, BLOCK_N, False, CAUSAL, PACKED, QUANT_DS, DTYPE, QK_DTYPE, PREC, EMU)
    dq = _dq_inner(dq, q, do, lse, delta, K, Ks, V, Vs, key, lo, hi, offs_m, T, s_scale, sg_dp, sg_ds,
                   D, BLOCK_M, BLOCK_N, True, CAUSAL, PACKED, QUANT_DS, DTYPE, QK_DTYPE, PREC, EMU)
    dq = dq * (sm_scale * sg_k * sg_ds)
    tl.store(DQ + row + offs_m[:, None] * D + cols[None, :], _round_bf16(dq, EMU).to(DQ.dtype.element_ty),
             mask=rmask[:, None])


# ----------------------------------------------------------------------------------------------------------
# launchers

# (BLOCK_M, BLOCK_N, num_warps, num_stages). BLOCK_M is the query tile, BLOCK_N the key tile; the causal
# bands need the larger of the two to be a multiple of the smaller. The forward's BLOCK_N is also the tile
# the reference uses for quantized P (fp4_pv, fp4_all), where it changes the numbers (P~ is relative to the
# running max); every other policy gives the same numbers for any tiles (up to summation order).
# bf16 operands (the bf16 policy, and fp4's grid values): 0.343 vs 0.376 ms at 128 x 64 / 8 warps (H200 sweep,
# results/h200_run8/call2); dQ pass with 3 stages 1.18 vs 1.27 ms with 2 (whole bf16 backward, h200_run6/call1)
FWD_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)
# packed (NVFP4) Q, K, V: 4 warps, 0.755 vs 0.861 ms at the benchmark shape on the H200 (config sweep, 2026-11-29)
FWD_CONFIG_PACKED = dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3)
DKDV_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2)
DQ_CONFIG = dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3)
# dS quantized in registers: smaller tiles, 4 warps. The quantization's temporaries next to a 128-key tile's dK
# and dV accumulators spill, and each thread holds 4 elements of every 16-element block whatever the tile, so
# small tiles lose nothing (H200 sweep, bench_attention.py, results/h200_run8/call2: whole fp4 backward with
# grid-value operands 2.64 ms at 32 x 64 vs 2.92 at 32 x 128 / 8 warps; dQ pass 64 x 32 2.67 vs 2.89 at 128 x 64)
DKDV_CONFIG_QUANT_DS = dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3)
DQ_CONFIG_QUANT_DS = dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=4)
P_BLOCK_N = FWD_CONFIG["BLOCK_N"]
# "separate": the fp4 backward kernels 4.33 vs 5.26 ms with atomic dQ on the H200 (bf16 1.26 vs 1.31), deterministic
DQ_MODE = "separate"
# the interpreter (CPU tests) runs small tiles: same numbers, much faster
INTERPRET_CONFIGS = {"fwd": dict(BLOCK_M=32, BLOCK_N=16), "dkdv": dict(BLOCK_M=16, BLOCK_N=32),
                     "dq": dict(BLOCK_M=32, BLOCK_N=16)}


_TL_DTYPE = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _operand(x):
    """Kernel arguments for an operand: packed (codes, scales) or a plain tensor (scales unused)."""
    if isinstance(x, tuple):
        return x[0].contiguous(), x[1].contiguous()
    x = x.contiguous()
    return x, x


def _meta(dtype, kind, config, D, packed, quant_ds=True):
    cfg = dict(config)
    emulate = False
    if _interpreting():
        cfg.update(INTERPRET_CONFIGS[kind])
        emulate = dtype == torch.bfloat16
    dot_dtype = tl.float32 if emulate else _TL_DTYPE[dtype]
    # NVFP4 Q and K (and the quantized dS they meet) are exact in fp16, whose convert from the fp8 decode is
    # cheaper than bf16's: the QK^T, dS K and dS^T Q matmuls then run in fp16 with the same products
    fp16_qk = packed and quant_ds and dtype != torch.float32
    return dict(DTYPE=dot_dtype, QK_DTYPE=tl.float16 if fp16_qk else dot_dtype, EMU=emulate,
                PREC="ieee" if dtype == torch.float32 else "tf32", D=D, QD=D // 2 if packed else D, PACKED=packed,
                **cfg)


def flash_forward(q, k, v, scales, shape, causal, sm_scale, quant_p, dtype, config=None):
    """q, k, v: plain (B, H|Hkv, T, D) tensors, or (codes, e4m3 scales) pairs when packed. scales: fp32 (6,)
    [s_g(Q), s_g(K), s_g(V), s_g(P), s_g(dO for dO V^T), s_g(dO for P^T dO)], 1 where unused. Returns
    o (B, H, T, D) in dtype and lse2 (B, H, T) fp32 (log2 domain)."""
    B, H, Hkv, T, D = shape
    packed = isinstance(q, tuple)
    (qc, qs), (kc, ks), (vc, vs) = _operand(q), _operand(k), _operand(v)
    o = torch.empty(B, H, T, D, device=qc.device, dtype=dtype)
    lse = torch.empty(B, H, T, device=qc.device, dtype=torch.float32)
    meta = _meta(dtype, "fwd", config or (FWD_CONFIG_PACKED if packed else FWD_CONFIG), D, packed)
    if quant_p:   # the numbers depend on the key tile: keep the reference's (and a query tile it divides)
        meta["BLOCK_N"] = P_BLOCK_N
        meta["BLOCK_M"] = max(meta["BLOCK_M"], P_BLOCK_N)
    grid = (triton.cdiv(T, meta["BLOCK_M"]), B * H)
    _attn_fwd[grid](qc, qs, kc, ks, vc, vs, scales, o, lse, T, H, H // Hkv, sm_scale * LOG2E,
                    CAUSAL=causal, QUANT_P=quant_p, **meta)
    return o, lse


def flash_backward(q, k, v, scales, shape, do, lse, delta, do_dov, do_pdo, ds_scale, keys, causal, sm_scale,
                   dtype, dkdv_config=None, dq_config=None, dq_mode=None):
    """dq (B, H, T, D), dk, dv (B, Hkv, T, D) in dtype. do_dov / do_pdo: dO's NVFP4 grid values (q * s_b)
    for the fp4_dov / fp4_all variants or None; ds_scale: (B*H,) fp32 global scales of dS or None (dS in
    BF16); keys: (B*H, 2) int32 SR stream keys (dQ pass, dK pass). dq_mode: "atomic" (the dK/dV pass also
    adds dS K into an fp32 dQ with atomics: 5 matmuls, like FlashAttention-2; the summation order, and so the
    last bits of dQ, vary run to run) or "separate" (a dQ pass recomputes S, P, dP: 7 matmuls, deterministic)."""
    B, H, Hkv, T, D = shape
    packed = isinstance(q, tuple)
    (qc, qs), (kc, ks), (vc, vs) = _operand(q), _operand(k), _operand(v)
    dev = qc.device
    do = do.contiguous()
    quant_ds, quant_dov, quant_pdo = ds_scale is not None, do_dov is not None, do_pdo is not None
    do_dov = do_dov.contiguous() if quant_dov else do
    do_pdo = do_pdo.contiguous() if quant_pdo else do
    if not quant_ds:
        ds_scale = torch.ones(B * H, device=dev, dtype=torch.float32)
        keys = torch.zeros(B * H, 2, device=dev, dtype=torch.int32)
    dq = torch.empty(B, H, T, D, device=dev, dtype=dtype)
    dk = torch.empty(B, Hkv, T, D, device=dev, dtype=dtype)
    dv = torch.empty(B, Hkv, T, D, device=dev, dtype=dtype)
    flags = dict(CAUSAL=causal, QUANT_DS=quant_ds, QUANT_DOV=quant_dov)
    meta = _meta(dtype, "dkdv", dkdv_config or (DKDV_CONFIG_QUANT_DS if quant_ds else DKDV_CONFIG), D,
                 packed, quant_ds)
    grid = (triton.cdiv(T, meta["BLOCK_N"]), B * Hkv)
    atomic = (dq_mode or DQ_MODE) == "atomic"
    dq_acc = torch.zeros(B, H, T, D, device=dev, dtype=torch.float32) if atomic else dk
    _attn_bwd_dkdv[grid](qc, qs, kc, ks, vc, vs, scales, do, do_dov, do_pdo, lse, delta, ds_scale, keys, dk, dv,
                         dq_acc, T, H, H // Hkv, sm_scale * LOG2E, sm_scale, QUANT_PDO=quant_pdo, ATOMIC_DQ=atomic,
                         **flags, **meta)
    if atomic:
        return dq_acc.to(dtype), dk, dv
    meta = _meta(dtype, "dq", dq_config or (DQ_CONFIG_QUANT_DS if quant_ds else DQ_CONFIG), D, packed, quant_ds)
    grid = (triton.cdiv(T, meta["BLOCK_M"]), B * H)
    _attn_bwd_dq[grid](qc, qs, kc, ks, vc, vs, scales, do, do_dov, lse, delta, ds_scale, keys, dq,
                       T, H, H // Hkv, sm_scale * LOG2E, sm_scale, **flags, **meta)
    return dq, dk, dv


@triton.jit
def _bwd_preprocess(O, DO, DELTA, DONORM, N, D: tl.constexpr, ROWS: tl.constexpr):
    """Per row: D_i = rowsum(dO o O) (App. 11) and ||dO_i||, in one read of O and dO."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, D)
    m = rows[:, None] < N
    o = tl.load(O + rows[:, None].to(tl.int64) * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    do = tl.load(DO + rows[:, None].to(tl.int64) * D + cols[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(DELTA + rows, tl.sum(o * do, 1), mask=rows < N)
    tl.store(DONORM + rows, tl.sqrt(tl.sum(do * do, 1)), mask=rows < N)


def bwd_preprocess(o, do):
    """delta (B, H, T) = rowsum(dO o O) and ||dO|| per row (B, H, T), fp32."""
    B, H, T, D = o.shape
    o, do = o.contiguous(), do.contiguous()
    delta = torch.empty(B, H, T, device=o.device, dtype=torch.float32)
    donorm = torch.empty_like(delta)
    rows = 16 if _interpreting() else 64
    _bwd_preprocess[(triton.cdiv(B * H * T, rows),)](o, do, delta, donorm, B * H * T, D=D, ROWS=rows)
    return delta, donorm
