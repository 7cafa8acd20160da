"""
Triton NVFP4 quantization (paper §2): one pass that reads bf16/fp32 and writes packed E2M1 codes +
E4M3 block scales and/or the bf16 grid values q * s_b, for 1x16, 16x1 and 16x16 blocks, RTN or SR,
optional 4/6, optional fused 16-point (random) Hadamard rotation. Tensors in, tensors out: nvfp4.py
wraps the codes, scales and global scale into its NVFP4Tensor. (Decoding lives in
kernels/nvfp4_dequant.py.)

It reproduces the reference `nvfp4.quantize` (the spec: Transformer Engine's arithmetic) bit for
bit, with the device arithmetic of kernels/nvfp4_math.py:
  S_enc = min(bound * 6 / amax, FLT_MAX), S_dec = 1 / S_enc   correctly rounded (tl.div_rn);
                                                              1, 1 if amax == 0
  s_b = e4m3(min(amax_b * (S_enc * RN(1/6)), 448))            RNE to E4M3 (up for "sr_up") with
                                                              explicit arithmetic (the interpreter's
                                                              fp32->fp8 cast is wrong on ties)
  a   = min(|x| * min(RN(1 / (s_b * S_dec)), FLT_MAX), 6)     one reciprocal per block, a multiply
                                                              per element
  q   = RTN ties-to-even on the E2M1 grid, or SR: up iff u < (a - lo) / (hi - lo), u from Philox
        (nvfp4.sr_uniforms)
  sign = x * scale < 0                                        (-0.0 and underflow to -0.0 get
                                                              a + code)
SR's uniforms are 16 random bits per element, u = h * 2^-16 (a bias below 2^-16 of a grid step):
one tl.randint4x call (Philox4x32-10, key = the seed) serves 8 neighbours, each 32-bit word two of
them, the even element its low half (1x16 blocks: counter element index // 8, 8 neighbours in a
row; 16x1 and 16x16 blocks: counter (row // 8) * N + column, 8 neighbours in a column). The
reference's nvfp4.sr_uniforms draws the same bits in PyTorch, so a seed gives the same codes on
both routes. 16 bits, not 32: Philox is most of an SR kernel's instructions (these kernels are
bound by instruction issue) and 16 bits keep the bias negligible; Blackwell's own SR conversion
(cvt.rs.satfinite.e2m1x4.f32) takes one 32-bit word of random bits per 4 values.
Where it can differ from the reference:
  * With `hadamard`, x·H sums 16 exact products in one fixed butterfly order (_hadamard16, the same
    in every kernel), the reference's torch matmul in its own: bit-exact where the sums are exact,
    else within an ulp.

Three quantize kernels, each the fastest layout for its case (the same arithmetic, the same bits):
  _quantize_rows_kernel  1x16 blocks of a contiguous x: one block per thread
  _quantize_cols_kernel  16x1 blocks of a row-major x (eq. 2's wgrad operands): two column blocks
                         per thread
  _quantize_kernel       everything else (16x16 weight blocks, transposed views): (BM, BN) tiles
"""

import collections
import math

import torch
import triton
import triton.language as tl

from kernels.nvfp4_dequant import dequantize
from kernels.nvfp4_math import (
    E4M3_MAX, E4M3_MAX_46, TRITON_VERSION, _amax_nan, _block_random_words, _column_random_words,
    _decode_e2m1, _e4m3_value, _global_scales, _hadamard16, _load_tile, _max_nan, _pack_codes,
    _random_words, _rotate, _round_to_bf16, _scale_blocks, _sign_bits, _sr_e2m1_value, _with_sign,
    ON_GPU, on_gpu)

# The block shapes these kernels lay out and the roundings they take: the spec's nvfp4.BLOCKS and
# nvfp4.ROUNDINGS (nvfp4.quantize checks the rounding; the input's shape and values are checked
# here, _check_input, as nvfp4.check_blocks does on the reference route). "sr_up": SR with the
# block scale rounded up to E4M3 (nvfp4.quantize says why).
LAYOUTS = ((1, 16), (16, 1), (16, 16))
SR_MODES = ("sr", "sr_up")


def seed_tensor(seed, device):
    """SR's seed as the kernels read it: an int64 tensor on `device`. The step draws its seeds on
    the device (nvfp4.sr_seed), so a captured CUDA graph reads fresh ones each replay; a host int
    (tests, analysis) is copied over, a 0 by a fill (no copy, no sync; made per call: a cached one
    first made inside a CUDA graph would stay in its pool)."""
    if torch.is_tensor(seed):
        return seed.to(device=device, dtype=torch.int64)
    if seed == 0:
        return torch.zeros((), dtype=torch.int64, device=device)
    return torch.tensor(seed, dtype=torch.int64, device=device)


def _seed_arg(seed, rounding, device, unused):
    """The launches' seed pointer: seed_tensor where SR reads it; RTN and the amax passes never
    load it, so they take `unused` (a tensor the launch has anyway) and launch no fill kernel."""
    return seed_tensor(seed, device) if rounding in SR_MODES else unused


@triton.jit
def _signed_hadamard_kernel(signs_ptr, out_ptr):
    """out (16, 16) = (signs * 0.5 - 0.25) * H16 for signs (16, 1) in {0, 1}: +-1/4, negative where
    exactly one of s_i (negative for 0) and H16[i, j] = (-1)^popcount(i & j) is; 0x6996's bit b is
    the parity of the 4-bit b."""
    i = tl.arange(0, 16)
    parity = (0x6996 >> (i[:, None] & i[None, :])) & 1
    negative = parity ^ (1 - tl.load(signs_ptr + i).to(tl.int32))[:, None]
    tl.store(out_ptr + i[:, None] * 16 + i[None, :], tl.where(negative == 1, -0.25, 0.25))


def signed_hadamard(signs):
    """nvfp4.signed_hadamard (eq. 2's diag(s) H16 / 4 from the drawn signs (16, 1) in {0, 1}) in
    one launch instead of ~13 small torch kernels: the same entries, exactly +-1/4."""
    out = torch.empty(16, 16, device=signs.device, dtype=torch.float32)
    _signed_hadamard_kernel[(1,)](signs.contiguous(), out)
    return out


def _check_input(x, block, name):
    """What a launch needs: a float x whose last two dims hold whole blocks of one of LAYOUTS, and
    (off CUDA, where it costs no sync) finite values; one clear error naming the tensor."""
    fits = x.is_floating_point() and x.dim() >= 2 and block in LAYOUTS
    if not fits or x.shape[-2] % block[0] or x.shape[-1] % max(block[1], 2):
        raise ValueError(f"{name}: {x.dtype} shape {tuple(x.shape)} does not fit NVFP4 block "
                         f"{block} (one of {LAYOUTS}, on the last two dims)")
    if not x.is_cuda and not torch.isfinite(x).all():
        raise ValueError(f"{name}: non-finite values (NaN/Inf) in tensor of shape {tuple(x.shape)}")


def _exact_fma():
    # Markstein's division step needs a true fma: the GPU has one, the interpreter's rounds twice
    # (tl.div_rn there)
    return on_gpu()


# --------------------------------------------------------------------------------------------------
# Kernels

# A program's partial maximum of a 2-D / 3-D tile, keeping a NaN (_amax_nan): a NaN input then
# makes the global amax NaN, as torch's amax does on the reference route
@triton.jit
def _amax2(x):
    return _amax_nan(_amax_nan(x, 1), 0)


@triton.jit
def _amax3(x):
    return _amax2(_amax_nan(x, 2))


@triton.jit
def _amax_kernel(x_ptr, h_ptr, part_ptr, M, N, stride_xb, stride_xm, stride_xn,
                 BM: tl.constexpr, BN: tl.constexpr, HAD_DIM: tl.constexpr,
                 PLAIN_TOO: tl.constexpr):
    """Per-program max |x| (of the rotated x if HAD_DIM): the global amax is the max of these
    partials. Same rotation code as the quantize pass, so both see bit-identical rotated values.
    PLAIN_TOO: also the unrotated max |x|, stored after the rotated partials (one read of x for both
    global amaxes)."""
    # rows on axis 0: no 65535 cap
    pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    x, _, _, _ = _load_tile(x_ptr, h_ptr, pid_b, pid_m * BM, pid_n * BN, M, N,
                            stride_xb, stride_xm, stride_xn, BM, BN, 0)  # fp32, not rotated
    n_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    pid = (pid_b * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_m
    if PLAIN_TOO:
        tl.store(part_ptr + n_programs + pid, _amax2(tl.abs(x)))
    x = _rotate(x, h_ptr, BM, BN, HAD_DIM)
    tl.store(part_ptr + pid, _amax2(tl.abs(x)))


# seed_ptr: SR's seed as a device int64 (seed_tensor), loaded by every program: a captured CUDA
# graph then replays each call with the seed the step drew on the device, not one baked in.
@triton.jit
def _quantize_kernel(x_ptr, h_ptr, amax_ptr, gs_out_ptr, codes_ptr, scales_ptr, values_ptr, M, N,
                     stride_xb, stride_xm, stride_xn, ld_values, seed_ptr, BM: tl.constexpr,
                     BN: tl.constexpr, SBM: tl.constexpr, SBN: tl.constexpr,
                     FP8_BOUND: tl.constexpr, FOUR_OVER_SIX: tl.constexpr, SR: tl.constexpr,
                     SCALE_UP: tl.constexpr, HAD_DIM: tl.constexpr, WRITE_CODES: tl.constexpr,
                     WRITE_VALUES: tl.constexpr):
    """One (BM, BN) tile: block amax -> E4M3 block scale -> E2M1 codes (packed 2/byte, even element
    low) and/or bf16 values q * s_b (rows ld_values apart). Blocks (SBM, SBN): 1x16, 16x1, 16x16."""
    # rows on axis 0: no 65535 cap
    pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m0, n0 = pid_m * BM, pid_n * BN
    x, offs_m, offs_n, mask = _load_tile(x_ptr, h_ptr, pid_b, m0, n0, M, N,
                                         stride_xb, stride_xm, stride_xn, BM, BN, HAD_DIM)
    # global scales S_enc = bound * 6 / amax, S_dec = 1 / S_enc (nvfp4.global_scales)
    amax = tl.load(amax_ptr).to(tl.float32)  # fp32, or bf16 from torch's amax of a bf16 x (exact)
    s_enc, s_dec = _global_scales(amax, FP8_BOUND)
    if (pid_m == 0) & (pid_n == 0) & (pid_b == 0):
        tl.store(gs_out_ptr, s_dec)  # the tensor's S_dec for the host: no extra torch kernels

    # s_b, a = min(|x| * RN(1 / (s_b * S_dec)), 6) and 4/6's choice (nvfp4.scale_blocks)
    a, s_b, bits, q = _scale_blocks(tl.abs(x).reshape(BM // SBM, SBM, BN // SBN, SBN),
                                    s_enc, s_dec, BM // SBM, SBM, BN // SBN, SBN,
                                    FOUR_OVER_SIX, SCALE_UP)
    if SR:
        if SBM == 16:  # 16x1, 16x16: eight rows of a column per Philox call (_column_random_words)
            octs = (pid_b.to(tl.int64) * M + m0) // 8 + tl.arange(0, BM // 8)  # BM % 16 == 0
            # (BM / 8, BN, 2, 2, 2)
            rand = _column_random_words(tl.load(seed_ptr), octs[:, None] * N + offs_n[None, :])
            rand = tl.permute(rand, (0, 2, 3, 4, 1)).reshape(BM, BN)
        else:  # counter-based: independent of the tiling
            rand = _random_words(tl.load(seed_ptr), pid_b * M + offs_m, n0, N, BM, BN)
        q = _sr_e2m1_value(a, rand.reshape(BM // SBM, SBM, BN // SBN, SBN))
    # _sign_bits' bits by compares: a thread here holds up to 64 elements, and keeping x itself
    # until the end instead of its compare spills more with 4/6 (docs/performance.md)
    sign = ((x < 0) & (a.reshape(BM, BN) > 0)).to(tl.uint32) << 31

    if WRITE_CODES:
        packed = _pack_codes(q, sign, BM, BN // 2, 2).to(tl.uint8)  # two per byte along the row
        offs_c = n0 // 2 + tl.arange(0, BN // 2)
        cptrs = codes_ptr + (pid_b.to(tl.int64) * M + offs_m[:, None]) * (N // 2) + offs_c[None, :]
        tl.store(cptrs, packed, mask=(offs_m[:, None] < M) & (offs_c[None, :] < N // 2))
        offs_sm = m0 // SBM + tl.arange(0, BM // SBM)
        offs_sn = n0 // SBN + tl.arange(0, BN // SBN)
        sptrs = (scales_ptr + (pid_b.to(tl.int64) * (M // SBM) + offs_sm[:, None]) * (N // SBN)
                 + offs_sn[None, :])
        tl.store(sptrs, bits, mask=(offs_sm[:, None] < M // SBM) & (offs_sn[None, :] < N // SBN))
    if WRITE_VALUES:
        # q * s_b: at most 6 significant bits and within bf16's range, so the bf16 store is exact
        q = _with_sign((q * s_b[:, None, :, None]).reshape(BM, BN), sign)
        vrows = (pid_b.to(tl.int64) * M + offs_m[:, None]) * ld_values
        tl.store(values_ptr + vrows + offs_n[None, :], q.to(tl.bfloat16), mask=mask)


@triton.jit
def _rows_values_at(values_ptr, base, blk, offs, ld_values, ROW_BLOCKS: tl.constexpr):
    """Where the rows kernel stores the values of blocks base + blk (element offsets offs from block
    base), as a pointer and int32 offsets from it: flat as x (ROW_BLOCKS 0), or in rows ld_values
    elements apart of ROW_BLOCKS blocks each (x's rows in the left columns of a wider buffer:
    LoRA-SVD's [X_hat | branch], kernels/nvfp4_linear.py, written without a concatenation):
    shifted by ld_values - N per row."""
    ptr = values_ptr + base * 16
    if ROW_BLOCKS:
        row0 = base // ROW_BLOCKS  # the chunk's first row (a scalar)
        # the rows after it: int32 and a constant divisor (a multiply and a shift) per block
        rel = ((base - row0 * ROW_BLOCKS).to(tl.int32) + blk) // ROW_BLOCKS
        shift = ld_values - ROW_BLOCKS * 16
        ptr += row0 * shift
        offs += (rel * shift)[:, None, None]
    return ptr, offs


# Triton's coalescing orders a memory access's dims by contiguity; the threads take the dims in
# that order after the vectorized one. The rows and cols kernels want the threads on their blocks
# (a block whole in one thread's registers): dim 0 of their tiles, tied in contiguity with dim 1.
# Triton 3.6 breaks the tie by the lower index (dim 0: the blocks), 3.7 and later by the higher
# (getOrderFromContiguity; with dim 1 the tile goes through shared memory, a 752-byte spill with
# 4/6). So from 3.7 the tiles are accessed with their first two dims swapped, the blocks' dim then
# the higher, and swapped back (free in registers). tests/compile_for_target.py --sass counts the
# shuffles and shared-memory stores a wrong order costs; docs/performance.md has the numbers.
TIES_TO_HIGHER = tl.constexpr(TRITON_VERSION >= (3, 7))


@triton.jit
def _load_by_blocks(ptr, offs, mask, other):
    """tl.load at ptr + offs of a 3-D tile (blocks or column groups, then the rest) with its blocks'
    dim on the threads: the rows kernel's (NB, 2, 8) tile (blocks, halves, elements), the cols
    kernel's (C, 16, W) (column groups, rows, columns). The caller hints the offsets' contiguity
    (tl.max_contiguous where they are computed: Triton 3.6 drops a hint on a function's argument):
    along the last dim only, none across the blocks, or a thread would take several."""
    if TIES_TO_HIGHER:
        x = tl.load(ptr + tl.permute(offs, (1, 0, 2)), mask=tl.permute(mask, (1, 0, 2)),
                    other=other)
        return tl.permute(x, (1, 0, 2))
    else:
        return tl.load(ptr + offs, mask=mask, other=other)


@triton.jit
def _store_by_blocks(ptr, offs, values, mask):
    """_load_by_blocks's store."""
    if TIES_TO_HIGHER:
        tl.store(ptr + tl.permute(offs, (1, 0, 2)), tl.permute(values, (1, 0, 2)),
                 mask=tl.permute(mask, (1, 0, 2)))
    else:
        tl.store(ptr + offs, values, mask=mask)


@triton.jit
def _quantize_rows_kernel(x_ptr, h_ptr, amax_ptr, gs_out_ptr, codes_ptr, scales_ptr, values_ptr,
                          part_ptr, n_blocks, ld_values, seed_ptr, NB: tl.constexpr,
                          CHUNKS: tl.constexpr, FP8_BOUND: tl.constexpr,
                          FOUR_OVER_SIX: tl.constexpr, SR: tl.constexpr, SCALE_UP: tl.constexpr,
                          HADAMARD: tl.constexpr, WRITE_CODES: tl.constexpr,
                          WRITE_VALUES: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                          AMAX_ONLY: tl.constexpr, CAST_BF16: tl.constexpr):
    """_quantize_kernel's arithmetic for the common case, 1x16 blocks of a contiguous x: CHUNKS
    chunks of NB consecutive blocks per program, each held as an (NB, 2, 8) tile (the two 8-element
    halves of each block) so that the compiler puts one block on each thread: both halves of a block
    in one thread's registers, its amax, scale and division constants computed once, its 16 codes
    stored as two int32 words (8 codes each, element 0 in the low nibble: little-endian, the same
    bytes) without a shared-memory shuffle. The unrolled chunk loop issues the next chunk's load
    before this chunk's arithmetic (arithmetic-bound: the loads' latency hides behind it), the
    global scale's two divisions once per program. Same bits (same operations per element; SR: the
    same Philox counters, element index // 8). AMAX_ONLY: the global-amax pre-pass over the same
    (rotated) values; with CAST_BF16 it also writes x rounded to bf16 into values_ptr (flat, as x)
    and takes the maximum of that copy (cast_bf16_amax). ROW_BLOCKS, ld_values: where the values go
    (_rows_values_at)."""
    pid = tl.program_id(0)
    blk = tl.arange(0, NB)
    # (NB, 2, 8) element offsets: the blocks over the threads (_load_by_blocks), both halves of a
    # block in one thread; 8 contiguous (a 16-byte load of bf16), none across halves or blocks
    half = tl.arange(0, 2)[None, :, None]
    offs = tl.max_contiguous(blk[:, None, None] * 16 + half * 8 + tl.arange(0, 8)[None, None, :],
                             [1, 1, 8])
    first = pid.to(tl.int64) * (NB * CHUNKS)  # first block of this program
    if not AMAX_ONLY:  # amax: fp32, or bf16 (torch's amax of a bf16 x, exact)
        s_enc, s_dec = _global_scales(tl.load(amax_ptr).to(tl.float32), FP8_BOUND)
        if pid == 0:
            tl.store(gs_out_ptr, s_dec)
    else:
        run_max = tl.zeros((NB,), dtype=tl.float32)
    x_next = _load_by_blocks(x_ptr + first * 16, offs, (blk < n_blocks - first)[:, None, None],
                             0.0)
    for c in tl.range(0, CHUNKS, loop_unroll_factor=CHUNKS):
        base = first + c * NB
        bmask = blk < n_blocks - base
        mask = bmask[:, None, None]
        x = x_next.to(tl.float32)
        if CAST_BF16:  # autocast's cast on the way (RNE; the interpreter's own cast truncates)
            x = _round_to_bf16(x, ON_GPU)
            _store_by_blocks(values_ptr + base * 16, offs, x.to(tl.bfloat16), mask)
        # prefetch the next chunk (none after the last: an all-false mask moves no data)
        x_next = _load_by_blocks(x_ptr + (base + NB) * 16, offs,
                                 ((blk < n_blocks - base - NB) & (c + 1 < CHUNKS))[:, None, None],
                                 0.0)
        if HADAMARD:  # x . H on each block (the reference's hadamard_transform(x, H, dim=-1))
            x = _hadamard16(x.reshape(NB, 16, 1), h_ptr, NB, 1).reshape(NB, 2, 8)
        if AMAX_ONLY:  # (an else branch, not an early return: Triton would compile the rest anyway)
            run_max = _max_nan(run_max, _amax_nan(_amax_nan(tl.abs(x), 2), 1))
        else:
            # the blocks as (NB, 1, 1, 16) for _scale_blocks (a reshape within each thread)
            a, s_b, bits, q = _scale_blocks(tl.abs(x).reshape(NB, 1, 1, 16), s_enc, s_dec,
                                            NB, 1, 1, 16, FOUR_OVER_SIX, SCALE_UP)
            a, s_b, bits, q = a.reshape(NB, 2, 8), s_b.reshape(NB), bits.reshape(NB), \
                q.reshape(NB, 2, 8)
            if SR:  # the flat tensor as rows of 16 elements: the counters element index // 8
                q = _sr_e2m1_value(a, _block_random_words(tl.load(seed_ptr), base + blk, NB))
            sign = _sign_bits(x, a)
            if WRITE_CODES:
                words = _pack_codes(q, sign, NB, 2, 8).to(tl.int32, bitcast=True)  # (NB, 2)
                tl.store(codes_ptr + base * 2 + blk[:, None] * 2 + tl.arange(0, 2)[None, :], words,
                         mask=bmask[:, None])
                tl.store(scales_ptr + base + blk, bits, mask=bmask)
            if WRITE_VALUES:
                q = _with_sign(q * s_b[:, None, None], sign)
                vptr, voffs = _rows_values_at(values_ptr, base, blk, offs, ld_values, ROW_BLOCKS)
                _store_by_blocks(vptr, voffs, q.to(tl.bfloat16), mask)
    if AMAX_ONLY:
        tl.store(part_ptr + pid, _amax_nan(run_max, 0))


@triton.jit
def _cols_source(x_ptr, xs_ptr, xgs_ptr, pid_b, m0, n0, row, pair, col, mask, M, N, stride_xb,
                 stride_xm, PACKED_X: tl.constexpr, X_BF16: tl.constexpr, HW_BF16: tl.constexpr):
    """The cols kernel's (C, 16, 2) fp32 tile of x: as stored, or with PACKED_X decoded from a
    packed 1x16 x (codes at x_ptr (B * M, N / 2), E4M3 scales at xs_ptr (B * M, N / 16), the global
    scale at xgs_ptr) to exactly the values its dequantize gives, (q * s_b) * s_g (rounded to bf16
    with X_BF16, as dequantize(..., bf16) rounds it): eq. 2's Q16x1(H^T Q1x16(X)) from the saved
    packed X, with no bf16 X_hat written and read twice (amax pre-pass and quantize pass). A
    thread's two columns of a row are one code byte and share one block scale."""
    if PACKED_X:
        byte = n0 // 2 + pair                                                          # (C, 1, 1)
        bmask = (byte < N // 2) & (row < 16)                                           # (C, 16, 1)
        r0 = pid_b.to(tl.int64) * M + m0  # the tile's first row: int64 once, int32 offsets
        # one code byte per thread and row (contiguous bytes along the column groups: one each)
        c8 = _load_by_blocks(x_ptr + r0 * (N // 2),
                             tl.max_contiguous(row * (N // 2) + byte, [1, 1, 1]), bmask, 0)
        s_b = _load_by_blocks(xs_ptr + r0 * (N // 16), row * (N // 16) + (n0 + 2 * pair) // 16,
                              bmask, 0)
        s_b = _e4m3_value(s_b)
        # (C, 16, 2): the even element's nibble shifted to bits 31..28, the odd one's (<< 24)
        x = _decode_e2m1(c8.to(tl.int32) << (28 - 4 * tl.arange(0, 2)), s_b, tl.load(xgs_ptr))
        return _round_to_bf16(x, HW_BF16) if X_BF16 else x
    else:
        base = x_ptr + pid_b.to(tl.int64) * stride_xb + m0.to(tl.int64) * stride_xm
        return _load_by_blocks(base, row * stride_xm + col, mask, 0.0).to(tl.float32)


@triton.jit
def _quantize_cols_kernel(x_ptr, xs_ptr, xgs_ptr, h_ptr, amax_ptr, gs_out_ptr, codes_ptr,
                          scales_ptr, values_ptr, part_ptr, M, N: tl.constexpr, stride_xb,
                          stride_xm: tl.constexpr, ld_values: tl.constexpr,
                          seed_ptr, C: tl.constexpr, FP8_BOUND: tl.constexpr,
                          FOUR_OVER_SIX: tl.constexpr, SR: tl.constexpr, SCALE_UP: tl.constexpr,
                          HADAMARD: tl.constexpr, WRITE_CODES: tl.constexpr,
                          WRITE_VALUES: tl.constexpr, AMAX_ONLY: tl.constexpr,
                          PLAIN_TOO: tl.constexpr, PACKED_X: tl.constexpr, X_BF16: tl.constexpr,
                          HW_BF16: tl.constexpr):
    """_quantize_kernel's arithmetic for 16x1 blocks of a row-major x (eq. 2's wgrad operands,
    Q16x1(H^T dY) and Q16x1(H^T X-hat)): a (16, 2C) tile held as (C, 16, 2), i.e. each thread holds
    two whole column blocks (16 rows x 2 adjacent columns: 4-byte loads, 128 bytes per row and warp,
    one code byte per row). So the rotation H^T x is a butterfly in registers, a block's amax needs
    no shuffle and its scale is computed once; in the (16, BN) tile kernel a column block spanned
    several threads, which each recomputed its scale. Same results bit for bit as the tile kernel
    (same operations per element, same Philox counters: _column_random_words). AMAX_ONLY: the
    global-amax pre-pass over the same rotated values (with PLAIN_TOO also max |x|, stored after the
    rotated partials: dY's two global amaxes in one read). Values rows: ld_values apart.
    PACKED_X, X_BF16, HW_BF16: x is read as a packed 1x16 tensor (_cols_source). N and the row
    strides are constants (one specialization per layer width, a handful a model): each of a
    thread's 16 row loads and stores is then an immediate offset from one address, not its own
    64-bit address arithmetic (docs/performance.md counts it)."""
    # rows on axis 0: no 65535 cap
    pid_m, pid_n, pid_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    m0, n0 = pid_m * 16, pid_n * (2 * C)
    pair = tl.arange(0, C)[:, None, None]
    row = tl.arange(0, 16)[None, :, None]
    col = n0 + pair * 2 + tl.arange(0, 2)[None, None, :]                               # (C, 1, 2)
    mask = (col < N) & (row < 16)                                                      # (C, 16, 2)
    r0 = pid_b.to(tl.int64) * M + m0  # the tile's first row in (B * M, N): int64 once
    x = _cols_source(x_ptr, xs_ptr, xgs_ptr, pid_b, m0, n0, row, pair, col, mask, M, N,
                     stride_xb, stride_xm, PACKED_X, X_BF16, HW_BF16)
    xr = _hadamard16(x, h_ptr, C, 2) if HADAMARD else x  # H^T x along the rows
    ax = tl.abs(xr)
    if AMAX_ONLY:
        n_programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        pid = (pid_b * tl.num_programs(1) + pid_n) * tl.num_programs(0) + pid_m
        if PLAIN_TOO:
            tl.store(part_ptr + n_programs + pid, _amax3(tl.abs(x)))
        tl.store(part_ptr + pid, _amax3(ax))
    else:
        # fp32, or bf16 from torch's amax of a bf16 x (exact)
        amax = tl.load(amax_ptr).to(tl.float32)
        s_enc, s_dec = _global_scales(amax, FP8_BOUND)
        if (pid_m == 0) & (pid_n == 0) & (pid_b == 0):
            tl.store(gs_out_ptr, s_dec)
        # the column blocks as (C, 16, 2, 1) for _scale_blocks: C x 2 blocks of 16 x 1
        a, s_b, bits, q = _scale_blocks(ax.reshape(C, 16, 2, 1), s_enc, s_dec, C, 16, 2, 1,
                                        FOUR_OVER_SIX, SCALE_UP)
        a, q = a.reshape(C, 16, 2), q.reshape(C, 16, 2)
        if SR:
            octs = (pid_b.to(tl.int64) * M + m0) // 8 + tl.arange(0, 2)[None, :, None]  # (1, 2, 1)
            rand = _column_random_words(tl.load(seed_ptr), octs * N + col)  # (C, 2, 2, 2, 2, 2)
            # row 8i + 4a + 2b + h
            rand = tl.permute(rand, (0, 1, 3, 4, 5, 2)).reshape(C, 16, 2)
            q = _sr_e2m1_value(a, rand)
        sign = _sign_bits(xr, a)
        if WRITE_CODES:
            packed = _pack_codes(q, sign, C, 16, 2).to(tl.uint8)  # even / odd column: (C, 16)
            _store_by_blocks(codes_ptr + r0 * (N // 2),
                             tl.max_contiguous(row * (N // 2) + (n0 // 2 + pair), [1, 1, 1]),
                             packed.reshape(C, 16, 1), (n0 // 2 + pair < N // 2) & (row < 16))
            scol = col.reshape(C, 2)
            tl.store(scales_ptr + (pid_b.to(tl.int64) * (M // 16) + pid_m) * N + scol, bits,
                     mask=scol < N)
        if WRITE_VALUES:  # q * s_b, exact in bf16
            q = _with_sign(q * s_b[:, None, :], sign)
            _store_by_blocks(values_ptr + r0 * ld_values, row * ld_values + col,
                             q.to(tl.bfloat16), mask)


# --------------------------------------------------------------------------------------------------
# Host side

# global amaxes the kernels read as they are (no conversion op)
AMAX_DTYPES = (torch.float32, torch.bfloat16)
# The launch configurations, chosen by bench/quantize_tiles.py at the 1b step's shapes (every
# candidate gives the same bits: a configuration moves blocks between programs, not arithmetic).
# _quantize_rows_kernel: (blocks per chunk, num_warps, chunks per program, register cap or None).
# The unrolled chunk loop issues the next chunk's load before this chunk's arithmetic: four chunks for
# RTN (the amax pre-passes), two for SR and 4/6, whose longer code per element runs slower with more.
ROWS_LAUNCH = (128, 4, 4, None)
ROWS_LAUNCH_SR = (128, 4, 2, None)
COLS_WARPS = 4  # _quantize_cols_kernel: (16, 64 * warps) tiles, 2 column blocks per thread
# Its register cap: 128 fits four programs of 4 warps an SM where the 4/6 passes would take 144-168
# (three); faster under Triton 3.6 though X_hat's pass spills a little. Later Tritons spill under it
# (unmeasured there): no cap.
COLS_MAXNREG = 128 if TRITON_VERSION < (3, 7) else None


def _tiles(block, x):
    """_quantize_kernel's (BM, BN, num_warps): 16 rows keep every block shape whole; 16 x 128 tiles
    for 1-D blocks and 16 x 256 for 16x16 blocks were the fastest measured; 64 x 64 for inputs
    contiguous along rows (a transposed view such as dY.t()) keep the column reads at 128 bytes."""
    if x.stride(-1) != 1 and x.stride(-2) == 1:
        return 64, 64, 4
    return (16, 256, 4) if tuple(block) == (16, 16) else (16, 128, 4)


def _use_rows(x3, block):
    return tuple(block) == (1, 16) and x3.is_contiguous()


def _use_cols(x3, block):  # a _Packed1x16 source too
    return tuple(block) == (16, 1) and (not torch.is_tensor(x3) or x3.stride(-1) == 1)


# A packed 1x16 source that _quantize_cols_kernel decodes in registers (PACKED_X): codes
# (B * M, N / 2) uint8, E4M3 scales (B * M, N / 16) as uint8, the global scale (1,) fp32, the
# tensor's shape (*, M, N), its device, and whether the values are rounded to bf16
_Packed1x16 = collections.namedtuple("_Packed1x16", "codes scales global_scale shape device bf16")


def _packed_source(t, block, dtype):
    """x given packed (t: codes, scales, global_scale, shape, block, as nvfp4.NVFP4Tensor), to be
    quantized as its values dequantize(..., dtype) -> a _Packed1x16 where the cols kernel decodes it
    itself (a 1x16 source quantized in 16x1 blocks: eq. 2's Q16x1(H^T Q1x16(X)), in fp32 or bf16),
    else the dequantized tensor."""
    shape = tuple(t.shape)
    if (tuple(t.block) != (1, 16) or tuple(block) != (16, 1) or len(shape) < 2
            or shape[-2] % 16 or dtype not in (torch.float32, torch.bfloat16)):
        return dequantize(t.codes, t.scales, t.global_scale, t.shape, t.block, dtype)
    M, N = shape[-2:]
    codes = t.codes.reshape(-1, N // 2).contiguous()
    scales = t.scales.reshape(-1, N // 16).contiguous().view(torch.uint8)
    return _Packed1x16(codes, scales, t.global_scale.float().reshape(1), shape, codes.device,
                       dtype == torch.bfloat16)


def _options(block, rounding, hadamard, device, name):
    """Checks -> block, the Hadamard's dim (0: none, 1: along rows' 16-element blocks, 2: along
    columns') and the Hadamard as contiguous fp32 on the device."""
    block = tuple(block)
    if rounding != "rtn" and rounding not in SR_MODES:
        raise ValueError(f"{name}: rounding must be 'rtn' or one of {SR_MODES}, got {rounding!r}")
    had_dim = 0
    if hadamard is not None:
        if block == (16, 16):
            raise ValueError(f"{name}: a Hadamard rotation needs a 1-D block, (1, 16) or (16, 1)")
        if tuple(hadamard.shape) != (16, 16):
            raise ValueError(f"{name}: hadamard must be a (16, 16) matrix, "
                             f"got {tuple(hadamard.shape)}")
        had_dim = 1 if block == (1, 16) else 2
        hadamard = hadamard.to(device=device, dtype=torch.float32).contiguous()
    return block, had_dim, hadamard


def _prepare(x, block, rounding, hadamard, name):
    """Checks -> x as (B, M, N), then _options' block, Hadamard dim and Hadamard."""
    block, had_dim, hadamard = _options(block, rounding, hadamard, x.device, name)
    _check_input(x, block, name)
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name}: expected an fp32/bf16/fp16 tensor, got {x.dtype}")
    M, N = x.shape[-2:]
    if x.dtype == torch.float16:
        x = x.float()
    # a view when the leading dims allow (keeps dY.t()'s strides), else a copy
    x3 = x.reshape(-1, M, N)
    return x3, block, had_dim, hadamard


def _row_stride(values, x3):
    """The values output's row stride in elements (x's width N unless it is a wider buffer's left
    columns)."""
    return x3.shape[-1] if values is None else values.view(-1, x3.shape[-1]).stride(0)


def _values_out(out, shape, device, name):
    """quantize_dequant's values output: a new contiguous bf16 tensor, or the caller's `out` (x's
    shape, bf16, unit column stride, rows any fixed stride apart: e.g. out=buf[:, :K] of a
    (T, K + r) buffer)."""
    if out is None:
        return torch.empty(shape, device=device, dtype=torch.bfloat16)
    N = shape[-1]
    ok = (tuple(out.shape) == tuple(shape) and out.dtype == torch.bfloat16
          and out.device == device and out.stride(-1) == 1)
    try:
        ok = ok and out.view(-1, N).stride(0) >= N
    except RuntimeError:  # rows not evenly strided
        ok = False
    if not ok:
        raise ValueError(f"{name}: out must be a bf16 tensor of shape {tuple(shape)} on {device}, "
                         f"unit column stride, evenly strided rows; got {tuple(out.shape)} "
                         f"{out.dtype} strides {out.stride()}")
    return out


def _fp8_bound(four_over_six):
    return (E4M3_MAX_46 if four_over_six else E4M3_MAX).value  # the kernels' constexpr, as a float


def _rows_launch(x3, amax, hadamard, four_over_six, seed, rounding="rtn", codes=None,
                 scales=None, values=None, gs_out=None, amax_only=False, cast=None):
    """_quantize_rows_kernel over x3's B*M*N/16 blocks (or its amax pre-pass: returns the global
    amax; cast: a bf16 tensor like x3 that the pre-pass writes x3's bf16 copy into)."""
    NB, warps, chunks, maxnreg = (ROWS_LAUNCH_SR if rounding in SR_MODES or four_over_six
                                  else ROWS_LAUNCH)
    n_blocks = x3.numel() // 16
    grid = (triton.cdiv(n_blocks, NB * chunks),)
    partial = torch.empty(grid[0], device=x3.device, dtype=torch.float32) if amax_only else None
    dummy = partial if amax_only else gs_out  # an fp32 tensor for unused pointers
    N, ld = x3.shape[-1], _row_stride(values, x3)
    _quantize_rows_kernel[grid](
        x3, hadamard if hadamard is not None else dummy,
        amax if amax is not None else dummy, gs_out if gs_out is not None else dummy,
        codes.view(torch.int32) if codes is not None else dummy,
        scales if scales is not None else dummy,
        values if values is not None else cast if cast is not None else dummy,
        partial if partial is not None else dummy,
        n_blocks, ld, _seed_arg(seed, rounding, x3.device, dummy),
        NB=NB, CHUNKS=chunks, FP8_BOUND=_fp8_bound(four_over_six),
        FOUR_OVER_SIX=bool(four_over_six),
        SR=rounding in SR_MODES, SCALE_UP=rounding == "sr_up",
        HADAMARD=hadamard is not None,
        WRITE_CODES=codes is not None, WRITE_VALUES=values is not None,
        ROW_BLOCKS=0 if ld == N else N // 16,
        # no FMA contraction: roundings as the reference
        AMAX_ONLY=amax_only, CAST_BF16=cast is not None, num_warps=warps, maxnreg=maxnreg,
        enable_fp_fusion=False)
    return partial.amax() if amax_only else None


def cast_bf16_amax(x):
    """(x.to(torch.bfloat16), max |x| of that copy as a 0-d fp32 tensor) for a contiguous fp32 x
    whose last dim is a multiple of 16, in one read of x: autocast's cast of a linear layer's input
    and the global amax its Q1x16 quantization (RTN, no rotation) needs, which the quantize pass's
    own amax pass would otherwise read the copy again for (the same maximum: of the same values).
    The rows kernel's amax pass, writing the copy on the way."""
    if x.dtype != torch.float32 or not x.is_contiguous() or x.shape[-1] % 16:
        raise ValueError(f"cast_bf16_amax: a contiguous fp32 x with its last dim a multiple of 16, "
                         f"got {x.dtype} {tuple(x.shape)}")
    cast = torch.empty_like(x, dtype=torch.bfloat16)
    amax = _rows_launch(x.view(1, -1, x.shape[-1]), None, None, False, 0, amax_only=True,
                        cast=cast)
    return cast, amax


def _cols_launch(x3, amax, hadamard, four_over_six, seed, rounding="rtn", codes=None, scales=None,
                 values=None, gs_out=None, amax_only=False, plain_too=False):
    """_quantize_cols_kernel over x3 (B, M, N), or a _Packed1x16 source. amax_only: returns
    (max |H^T x|,) or with plain_too (max |H^T x|, max |x|)."""
    packed = not torch.is_tensor(x3)
    *lead, M, N = x3.shape
    C = 32 * COLS_WARPS
    grid = (M // 16, triton.cdiv(N, 2 * C), math.prod(lead))
    n = grid[0] * grid[1] * grid[2]
    partial = (torch.empty((2 if plain_too else 1) * n, device=x3.device, dtype=torch.float32)
               if amax_only else None)
    dummy = partial if amax_only else gs_out  # an fp32 tensor for unused pointers
    x, xs, xgs = (x3.codes, x3.scales, x3.global_scale) if packed else (x3, dummy, dummy)
    strides = (0, 0) if packed else (x3.stride(0), x3.stride(1))  # packed: contiguous rows
    _quantize_cols_kernel[grid](
        x, xs, xgs, hadamard if hadamard is not None else dummy,
        amax if amax is not None else dummy, gs_out if gs_out is not None else dummy,
        codes if codes is not None else dummy, scales if scales is not None else dummy,
        values if values is not None else dummy, partial if partial is not None else dummy,
        M, N, *strides, _row_stride(values, x3), _seed_arg(seed, rounding, x3.device, dummy),
        C=C, FP8_BOUND=_fp8_bound(four_over_six), FOUR_OVER_SIX=bool(four_over_six),
        SR=rounding in SR_MODES, SCALE_UP=rounding == "sr_up",
        HADAMARD=hadamard is not None, WRITE_CODES=codes is not None,
        WRITE_VALUES=values is not None, AMAX_ONLY=amax_only, PLAIN_TOO=plain_too,
        # HW_BF16: how a packed source decodes to bf16 (its only use)
        PACKED_X=packed, X_BF16=packed and x3.bf16, HW_BF16=packed and x3.bf16 and on_gpu(),
        num_warps=COLS_WARPS, maxnreg=COLS_MAXNREG, enable_fp_fusion=False)
    return partial.view(-1, n).amax(1).unbind() if amax_only else None


def _amax_launch(x3, hadamard, had_dim, tiles, plain_too):
    """_amax_kernel over x3 -> (max |x H|,) or with plain_too (max |x H|, max |x|). Every kernel
    rotates with the same butterfly (_hadamard16), so any kernel and tiling gives the quantize
    pass's maximum."""
    B, M, N = x3.shape
    BM, BN, warps = tiles
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN), B)
    n = grid[0] * grid[1] * grid[2]
    partial = torch.empty((2 if plain_too else 1) * n, device=x3.device, dtype=torch.float32)
    _amax_kernel[grid](x3, hadamard, partial, M, N, x3.stride(0), x3.stride(1), x3.stride(2),
                       BM=BM, BN=BN, HAD_DIM=had_dim, PLAIN_TOO=plain_too, num_warps=warps)
    return partial.view(-1, n).amax(1).unbind()


def _global_amax(x3, hadamard, had_dim, block):
    """max |x| (of x·H when rotating): one read of x, per-program partial maxima, then a tiny torch
    max (fp32; exact: a maximum of x's values, or of the rotated values the quantize pass computes).
    Without a rotation any contiguous x goes through the rows kernel's pass, whatever its block (a
    strided view through torch's reduction, in x's dtype: the kernels read either). A _Packed1x16 x:
    the cols kernel's pre-pass, decoding it as its quantize pass will."""
    if not torch.is_tensor(x3):
        return _cols_launch(x3, None, hadamard, False, 0, amax_only=True)[0]
    if had_dim < 2 and x3.is_contiguous():  # the rows kernel's pass (rotating rows' blocks or not)
        return _rows_launch(x3, None, hadamard, False, 0, amax_only=True)
    if had_dim == 0:  # a strided view: max |x| without an |x| temporary
        return torch.linalg.vector_norm(x3, ord=float("inf"))
    if _use_cols(x3, (16, 1) if had_dim == 2 else (1, 16)):
        return _cols_launch(x3, None, hadamard, False, 0, amax_only=True)[0]
    return _amax_launch(x3, hadamard, had_dim, _tiles(block, x3), plain_too=False)[0]


def global_amax_pair(x, hadamard, name="x"):
    """(max |x|, max |H^T x| over groups of 16 rows) of a 2-D x in one read: the global amaxes of
    Q1x16(dY) (dX) and of eq. 2's Q16x1(H^T dY) (dW), which the backward would otherwise read dY
    twice for. Each equals what quantize(x, ...) computes itself."""
    x3, block, had_dim, hadamard = _prepare(x, (16, 1), "sr", hadamard, name)
    if _use_cols(x3, block):
        rotated, plain = _cols_launch(x3, None, hadamard, False, 0, amax_only=True, plain_too=True)
    else:
        rotated, plain = _amax_launch(x3, hadamard, had_dim, _tiles(block, x3), plain_too=True)
    return plain, rotated


def _run(x, block, rounding, four_over_six, seed, hadamard, global_amax, write_codes, write_values,
         name, out=None, source_dtype=torch.float32):
    """Shared host side of quantize / quantize_dequant -> (codes, scales, values, s_g), None where
    not written; out: where the values go (_values_out); a packed x: _packed_source."""
    if not torch.is_tensor(x):
        x = _packed_source(x, block, source_dtype)
    if torch.is_tensor(x):
        x3, block, had_dim, hadamard = _prepare(x, block, rounding, hadamard, name)
    else:  # decoded by the cols kernel: its codes and scales came out of a quantize pass
        x3, (block, had_dim, hadamard) = x, _options(block, rounding, hadamard, x.device, name)
    device, shape = x3.device, x.shape
    M, N = shape[-2:]
    if global_amax is None:
        global_amax = _global_amax(x3, hadamard, had_dim, block)
    if not (torch.is_tensor(global_amax) and global_amax.device == device
            and global_amax.dtype in AMAX_DTYPES):
        global_amax = torch.as_tensor(global_amax, dtype=torch.float32, device=device)
    amax = global_amax.reshape(1)
    gs_out = torch.empty((), device=device, dtype=torch.float32)
    bm, bn = block
    # outputs allocated in their final shapes (contiguous: the kernels see (B, M, .) rows)
    lead = shape[:-2]
    codes = (torch.empty((*lead, M, N // 2), device=device, dtype=torch.uint8)
             if write_codes else None)
    scales = (torch.empty((*lead, M // bm, N // bn), device=device, dtype=torch.uint8)
              if write_codes else None)
    values = _values_out(out, shape, device, name) if write_values else None
    if _use_cols(x3, block):
        _cols_launch(x3, amax, hadamard, four_over_six, seed, rounding, codes, scales, values,
                     gs_out)
    elif _use_rows(x3, block):
        _rows_launch(x3, amax, hadamard, four_over_six, seed, rounding, codes, scales, values,
                     gs_out)
    else:
        BM, BN, warps = _tiles(block, x3)
        dummy = gs_out  # an fp32 tensor for unused pointers
        _quantize_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), x3.shape[0])](
            x3, hadamard if hadamard is not None else dummy, amax, gs_out,
            codes if codes is not None else dummy, scales if scales is not None else dummy,
            values if values is not None else dummy,
            M, N, x3.stride(0), x3.stride(1), x3.stride(2), _row_stride(values, x3),
            _seed_arg(seed, rounding, device, dummy),
            BM=BM, BN=BN, SBM=bm, SBN=bn, FP8_BOUND=_fp8_bound(four_over_six),
            FOUR_OVER_SIX=bool(four_over_six), SR=rounding in SR_MODES,
            SCALE_UP=rounding == "sr_up", HAD_DIM=had_dim,
            WRITE_CODES=write_codes, WRITE_VALUES=write_values,
            # no FMA contraction: every rounding as in the reference
            num_warps=warps, enable_fp_fusion=False)
    # gs_out: S_dec = 1 / S_enc (nvfp4.global_scales), the tensor's global (decode) scale
    return codes, (scales.view(torch.float8_e4m3fn) if write_codes else None), values, gs_out


def quantize(x, block=(1, 16), rounding="rtn", four_over_six=False, seed=0, hadamard=None,
             global_amax=None, name="x", source_dtype=torch.float32):
    """Fused NVFP4 quantization of x (*, M, N) -> (codes uint8 (*, M, N/2),
    scales float8_e4m3fn (*, M/bm, N/bn), global_scale fp32 0-d). block (1, 16) | (16, 1) | (16, 16)
    on the last two dims.
    rounding "rtn" | "sr" | "sr_up" (Philox words keyed by (seed, element position):
    nvfp4.sr_uniforms x's shape, for tests; "sr_up" rounds the block scales up, see SR_MODES).
    hadamard: (16, 16) matrix of nvfp4.random_hadamard's form (diag(+-1) H16 / 4) applied first
    along the block's 16-long dim (x·H for 1x16, H^T·x for 16x1).
    global_amax: max |x| (of x·H with hadamard) if the caller already has it; else one extra read
    pass.
    x may also be packed 1x16 (codes, scales, global_scale, shape, block: an nvfp4.NVFP4Tensor):
    its values dequantize(..., source_dtype) are quantized, with 16x1 blocks (eq. 2's
    Q16x1(H^T Q1x16(X))) decoded in the cols kernel's registers (fp32/bf16), not written out."""
    codes, scales, _, s_g = _run(x, block, rounding, four_over_six, seed, hadamard, global_amax,
                                 True, False, name, source_dtype=source_dtype)
    return codes, scales, s_g


def quantize_dequant(x, block=(1, 16), rounding="rtn", four_over_six=False, seed=0, hadamard=None,
                     global_amax=None, return_tensor=False, name="x", out=None,
                     source_dtype=torch.float32):
    """Same quantization, but writes the bf16 values q * s_b (exactly on the NVFP4 grid, without the
    global scale) for a bf16 GEMM: returns (values_bf16, global_scale), or with return_tensor=True
    (values_bf16, global_scale, codes, scales), the packed form written by the same pass
    (the forward keeps the packed X for the backward and multiplies the bf16 values).
    out: a bf16 tensor of x's shape to write the values into (returned as values_bf16), its rows
    any fixed stride apart: LoRA-SVD's GEMM operand [X_hat | branch] takes X_hat in its left
    columns. A packed x (with source_dtype) as in quantize."""
    codes, scales, values, s_g = _run(x, block, rounding, four_over_six, seed, hadamard,
                                      global_amax, return_tensor, True, name, out, source_dtype)
    return (values, s_g, codes, scales) if return_tensor else (values, s_g)
