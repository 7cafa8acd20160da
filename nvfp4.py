"""
NVFP4: the 4-bit number format (paper §2), the direct-NVFP4 linear layer (§3.2's baseline:
eqs. 1-2 without the LoRA branch) and the quantization-error analysis of App. 7.

The functions here are the reference: plain PyTorch that reads like the equations and runs anywhere.
They are the spec: the Triton kernels in kernels/ reproduce them (bit for bit for quantization, SR
included given the same seed; up to summation order for the GEMMs). `use_kernels` (at the end, with
the rest of the plumbing) is the one seam every module asks.

The format, in Transformer Engine's arithmetic (its NVFP4 recipe; docs/nvfp4_format.md):
  element   E2M1: +-{0, .5, 1, 1.5, 2, 3, 4, 6}; code = sign bit (bit 3) | index into E2M1_VALUES
  global    S_enc = 448 * 6 / amax(|x|), S_dec = 1 / S_enc
            (256 for 448 with 4/6; both 1 when amax == 0)
  block     s_b = e4m3(amax_b * (S_enc * RN(1/6)))  (RNE, saturating at 448, subnormals kept)
  value     q = E2M1(clamp(x * RN(1 / (s_b * S_dec)), -6, 6)),  x_hat = q * s_b * S_dec
and the choices of eqs. 1-2 (which operand gets which blocks and rounding) as data: LINEAR, the
contract below. In paper order: §2's format, quantizer and Hadamard, the GEMM, the contract, then the
linear layer of eqs. 1-2 (its bodies, its autograd.Function, the bodies as custom ops for
torch.compile, the module), App. 7's error analysis; plumbing last.
"""

import math
import os
import weakref
from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from kernels import nvfp4_dequant
from kernels import nvfp4_linear as linear_kernels
from kernels import nvfp4_quant as quant_kernels
from kernels import targets
from kernels.nvfp4_gemm import nvfp4_gemm, use_dot_scaled

# --------------------------------------------------------------------------------------------------
# §2 the format: constants and the scalar formulas

BLOCKS = ((1, 16), (16, 1), (16, 16))  # (rows, cols) of one block, on a tensor's last two dims
# "sr_up": SR with the block scale rounded up to E4M3 instead of to nearest, so that the block max
# never lands above 6 and is clamped (which biases "sr", Transformer Engine's SR, toward zero on the
# block maxima)
ROUNDINGS = ("rtn", "sr", "sr_up")

E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device="cpu")  # by code index
FP4_MAX = 6.0          # largest E2M1 magnitude
E4M3_MAX = 448.0       # largest E4M3 block scale
# the global bound with 4/6: the max -> 4 candidate (x1.5) must still fit E4M3
E4M3_MAX_46 = 256.0
FLT_MAX = torch.finfo(torch.float32).max
# RN(1/6) = 0x3E2AAAAB, TE's
RCP = {6.0: torch.tensor(1 / 6, dtype=torch.float32).item(), 4.0: 0.25}


def global_scales(amax, four_over_six=False):
    """(S_enc, S_dec) in fp32: S_enc = bound * 6 / amax capped at FLT_MAX, S_dec = 1 / S_enc (the
    tensor's stored global_scale). Both 1 when amax is 0 (Transformer Engine saturates S_enc at
    FLT_MAX there; zeros encode to zeros either way). Tensor divisions, correctly rounded on every
    device."""
    amax = amax.float()
    bound = torch.full_like(amax, (E4M3_MAX_46 if four_over_six else E4M3_MAX) * FP4_MAX)
    s_enc = torch.where(amax > 0, (bound / torch.where(amax > 0, amax, 1.0)).clamp(max=FLT_MAX),
                        1.0)
    return s_enc, torch.ones_like(s_enc) / s_enc


def to_e4m3(s, up=False):
    """Round fp32 scales to E4M3 (nearest, ties to even; values below 2^-6 stay subnormal as in
    Transformer Engine: torchao lifts them to 2^-6 instead), saturating at 448. up=True: the
    smallest E4M3 value >= s."""
    s = s.clamp(max=E4M3_MAX)
    e = s.to(torch.float8_e4m3fn)
    if not up:
        return e
    bits = e.view(torch.uint8)  # positive E4M3: the next value up is the next bit pattern
    return torch.where(e.float() < s, bits + 1, bits).view(torch.float8_e4m3fn)


def block_scale(block_amax, s_enc, fp4_max=FP4_MAX, up=False):
    """s_b = e4m3(amax_b * (S_enc * RN(1 / fp4_max))): the block max maps to fp4_max (6; 4 for 4/6's
    second candidate). One multiply per block by a per-tensor constant, as Transformer Engine
    computes it."""
    return to_e4m3(block_amax * (s_enc * RCP[fp4_max]), up)


def element_scale(s_b, s_dec):
    """The elements' multiplier min(RN(1 / (s_b * S_dec)), FLT_MAX): one reciprocal per block. A
    zero block scale (an all-zero block, or one below E4M3's range) gives FLT_MAX, as in Transformer
    Engine."""
    d = s_b.float() * s_dec
    return torch.where(d > 0, torch.ones_like(d) / torch.where(d > 0, d, 1.0),
                       FLT_MAX).clamp(max=FLT_MAX)


def _grid_step(a):
    """The E2M1 grid is uniform within each binade: step 0.5 below 2, 1 below 4, 2 up to 6."""
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


def _e2m1_index(q):
    """Index into E2M1_VALUES of a grid value q: 0, .5, 1, 1.5, 2 -> 0..4; 3, 4 -> 5, 6; 6 -> 7."""
    return torch.where(q <= 2, q * 2, torch.where(q <= 4, q + 2, 7.0)).to(torch.uint8)


def rtn_e2m1(a):
    """Index (0..7) of the nearest E2M1 magnitude for a in [0, 6], ties to even: 0.25 -> 0, 0.75 ->
    1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (torch.round is half-to-even on each
    binade's grid)."""
    step = _grid_step(a)
    return _e2m1_index(torch.round(a / step) * step)


def sr_e2m1(a, u):
    """Stochastic rounding of a in [0, 6]: up to the next grid value iff u < the fractional
    distance, so E[q] = a for uniform u in [0, 1); sr_uniforms' u, on a 2^-16 grid, rounds up
    with probability ceil(d * 2^16) * 2^-16 for a fractional distance d: E[q] - a in
    [0, 2^-16) grid steps."""
    step = _grid_step(a)
    lo = torch.floor(a / step) * step
    return _e2m1_index(torch.where(u < (a - lo) / step, lo + step, lo).clamp(max=FP4_MAX))


# SR's random bits: Philox4x32-10 (Salmon et al. 2011), the generator of Triton's tl.randint4x, in
# int64 arithmetic, so that the reference and the kernels draw the same words from the same seed.
_M32 = 0xFFFFFFFF


def _mul_hi_lo(a, b):
    """(high, low) 32-bit halves of a * b for a constant a < 2^32 and b an int64 tensor < 2^32
    (int64 holds each 16 x 32-bit partial product exactly)."""
    t, u = (a >> 16) * b, (a & 0xFFFF) * b
    mid = ((t & 0xFFFF) << 16) + u
    return (t >> 16) + (mid >> 32), mid & _M32


def philox(seed, counter):
    """The four 32-bit words of Philox4x32-10 for counters (c, 0, 0, 0) and key (seed low, seed
    high): what tl.randint4x(seed, counter) returns. counter: an int64 tensor; returns (4,
    *counter.shape) int64."""
    c0, c1 = counter & _M32, torch.zeros_like(counter)
    c2, c3 = torch.zeros_like(counter), torch.zeros_like(counter)
    k0, k1 = seed & _M32, (seed >> 32) & _M32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(0xCD9E8D57, c2)
        hi_a, lo_a = _mul_hi_lo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
    return torch.stack((c0, c1, c2, c3))


def _word_halves(words):
    """Philox words (int64, < 2^32) -> (*words.shape, 2): each word's low 16 bits, then its high 16
    bits, the random integers of two neighbouring elements."""
    return torch.stack((words & 0xFFFF, words >> 16), dim=-1)


def sr_uniforms(seed, shape, block, device=None):
    """SR's uniforms for a tensor of `shape` quantized in `block`s: u = h * 2^-16 for 16 random bits
    h, half of a Philox word. One Philox call (4 words) serves 8 neighbours along the block, each
    word two of them, the even element its low half and the odd one its high half: for 1x16
    blocks element i of the flat tensor takes half i % 2 of word (i % 8) // 2 of counter i // 8;
    for 16x1 and 16x16 blocks element (row, col), rows over the flattened leading dims, takes half
    row % 2 of word (row % 8) // 2 of counter (row // 8) * N + col. The draw depends on the seed
    and the element's position only, never on a kernel's tiling.
    Why 16 bits: u on a 2^-16 grid rounds up with probability ceil(d * 2^16) * 2^-16 for a
    fractional distance d, a bias below 2^-16 of a grid step (so App. 7's unbiasedness assumption
    (A3) holds to that bound; every element has its own bits, so its draws stay independent), and
    it halves the Philox calls per element, the bulk of an SR kernel's arithmetic. Even Blackwell's
    hardware SR (cvt.rs.satfinite.e2m1x4.f32) takes only 32 random bits per 4 values."""
    *lead, M, N = shape
    rows = math.prod(lead) * M
    if tuple(block) == (1, 16):
        words = philox(seed, torch.arange(rows * N // 8, device=device))           # (4, rows N / 8)
        h = _word_halves(words.t())                                      # (rows N / 8, 4, 2)
    else:
        octs = torch.arange(rows // 8, device=device)[:, None] * N + torch.arange(N, device=device)
        h = _word_halves(philox(seed, octs)).permute(1, 0, 3, 2)         # (rows/8, 4, 2, N)
    return (h.reshape(rows, N).float() * 2.0**-16).reshape(shape)


def sr_seed(generator=None, device="cpu"):
    """A seed for SR: a 0-d int64 tensor drawn on `device` (`generator`'s, if given) by its RNG, by
    default torch's on that device (which torch.manual_seed sets and a checkpoint saves, so a
    resumed run rounds identically). It never passes through the host: the kernels read it from
    memory, so a captured CUDA graph draws a fresh seed each replay (torch advances a graph's
    Philox offset per replay) without a GPU->host sync. On the CPU it is the int the host RNG
    drew."""
    device = generator.device if generator is not None else device
    return torch.randint(0, 2**31 - 1, (), generator=generator, device=device)


def _pairwise_block_sum(e):
    """Per-block sum of e (*, M/bm, bm, N/bn, bn) -> (*, M/bm, 1, N/bn, 1) as a fixed binary tree:
    neighbours along the row pairwise (16 -> 8 -> 4 -> 2 -> 1), then along the column. Every step
    adds two fp32 values, so the kernels get the same bits whatever their reduction order (4/6 must
    pick the same candidate)."""
    while e.shape[-1] > 1:
        e = e[..., 0::2] + e[..., 1::2]
    while e.shape[-3] > 1:
        e = e[..., 0::2, :, :] + e[..., 1::2, :, :]
    return e


# --------------------------------------------------------------------------------------------------
# §2 quantization (the reference)

def _candidate(xb, block_amax, s_enc, s_dec, fp4_max, up):
    """One block-scale candidate: (s_b, |x| * scale clamped to 6, the signed scaled x, s_b *
    S_dec)."""
    s_b = block_scale(block_amax, s_enc, fp4_max, up)
    scaled = xb * element_scale(s_b, s_dec)
    return s_b, scaled.abs().clamp(max=FP4_MAX), scaled, s_b.float() * s_dec


def _rtn_error(idx, denom, ax):
    """4/6's error measure: the block's summed squared RTN reconstruction error (in the fixed
    tree)."""
    d = E2M1_VALUES.to(ax.device)[idx.long()] * denom - ax
    return _pairwise_block_sum(d * d)


def scale_blocks(xb, s_enc, s_dec, four_over_six=False, up=False):
    """§2's block scaling of xb (*, M/bm, bm, N/bn, bn) given the global scales: -> (s_b, |x| *
    scale clamped to 6, the signed scaled x, the RTN index of the former). The block max maps to 6;
    with 4/6 also to 4, and per block whichever candidate reconstructs with the lower squared
    error is kept (ties to 6). The choice uses the RTN error also under SR, so the random draw
    does not pick the scale. kernels/nvfp4_math._scale_blocks is this function in Triton."""
    block_amax = xb.abs().amax(dim=(-3, -1), keepdim=True)               # (*, M/bm, 1, N/bn, 1)
    s_b, a, scaled, denom = _candidate(xb, block_amax, s_enc, s_dec, FP4_MAX, up)
    idx = rtn_e2m1(a)
    if four_over_six:
        s_b4, a4, scaled4, denom4 = _candidate(xb, block_amax, s_enc, s_dec, 4.0, up)
        idx4 = rtn_e2m1(a4)
        use4 = _rtn_error(idx4, denom4, xb.abs()) < _rtn_error(idx, denom, xb.abs())
        s_b = torch.where(use4, s_b4.float(), s_b.float()).to(torch.float8_e4m3fn)
        a, idx, scaled = (torch.where(use4, a4, a), torch.where(use4, idx4, idx),
                          torch.where(use4, scaled4, scaled))
    return s_b, a, scaled, idx


def check_blocks(x, block, name):
    """The checks of the reference route's NVFP4 quantization (the kernels make the same ones,
    kernels/nvfp4_quant._check_input): one clear error naming the tensor."""
    if block not in BLOCKS:
        raise ValueError(f"{name}: block must be one of {BLOCKS}, got {block}")
    if not x.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if x.dim() < 2:
        raise ValueError(f"{name}: NVFP4 blocks apply to the last two dims; "
                         f"got shape {tuple(x.shape)}")
    M, N = x.shape[-2:]
    bm, bn = block
    if M % bm or N % bn or N % 2:
        raise ValueError(f"{name}: shape {tuple(x.shape)} does not fit NVFP4 block {block}: "
                         f"the last two dims must be multiples of ({bm}, {max(bn, 2)})")
    # On CUDA this check would cost a host sync and an extra pass per quantization, so none is
    # made there: a NaN comes out as NaN (its block's scale E4M3's NaN, as here), an Inf as an
    # infinite decode scale and NaN outputs, and train.py's non-finite loss/gradient check stops
    # the run.
    if not x.is_cuda and not torch.isfinite(x).all():
        raise ValueError(f"{name}: non-finite values (NaN/Inf) in tensor of shape {tuple(x.shape)}")


def quantize_reference(x, block=(1, 16), rounding="rtn", four_over_six=False, seed=0,
                       global_amax=None, uniforms=None):
    """The spec of NVFP4 quantization, in PyTorch: x (*, M, N) -> NVFP4Tensor with blocks on its
    last two dims. seed: SR's Philox seed (sr_uniforms); global_amax: the amax the global scale
    derives from (default max |x|), 0-d or one per leading index shaped (*, 1, 1) (then so is the
    global scale); uniforms: SR's u, like x (default sr_uniforms'). Attention's P and dS pass a
    bound and, for dS, their hashed uniforms: the in-register quantizer of its kernels."""
    shape, (bm, bn) = x.shape, block
    lead, (M, N) = shape[:-2], shape[-2:]
    x = x.float()
    xb = x.reshape(*lead, M // bm, bm, N // bn, bn)                      # (*, M/bm, bm, N/bn, bn)
    amax = x.abs().amax() if global_amax is None else torch.as_tensor(global_amax, device=x.device)
    s_enc, s_dec = global_scales(amax, four_over_six)
    # per leading index (*, 1, 1) -> (*, 1, 1, 1, 1) against the blocks' dims
    se, sd = (s.reshape(*s.shape[:-2], 1, 1, 1, 1) if s.dim() else s for s in (s_enc, s_dec))
    s_b, a, scaled, idx = scale_blocks(xb, se, sd, four_over_six, rounding == "sr_up")
    if rounding != "rtn":
        u = sr_uniforms(seed, shape, block, x.device) if uniforms is None else uniforms
        idx = sr_e2m1(a, u.reshape(xb.shape))
    # sign bit: the scaled value is negative (as Transformer Engine's cast: -0.0 and an underflow to
    # -0.0 get code 0, a negative value that rounds to 0 keeps its sign, code 8; both decode to
    # zero)
    codes = (idx | ((scaled < 0).to(torch.uint8) << 3)).reshape(shape)
    return NVFP4Tensor(_pack(codes), s_b.reshape(*lead, M // bm, N // bn), s_dec, shape, block)


def quantize(x, block=(1, 16), rounding="rtn", four_over_six=False, generator=None, hadamard=None,
             name="x", seed=None):
    """Quantize x to NVFP4 with blocks on its last two dims. rounding:
      "rtn"    nearest, ties to even (the forward);
      "sr"     stochastic (the backward's gradients), as Transformer Engine does it: unbiased for
               every element below the block max, but when a block's E4M3 scale rounds down its
               max lands above 6 and is clamped, which pulls 2-4% of the elements of 1x16 blocks
               toward zero (by ~2% on average);
      "sr_up"  stochastic with the block scales rounded up to E4M3, so nothing clamps: unbiased, at
               the cost of a slightly coarser grid in those blocks.
    SR's seed: `seed`, else one draw from `generator` (sr_seed). hadamard: optional (16, 16) matrix
    applied first along the block's 16-long dim (x H for (1, 16) blocks, H^T x for (16, 1)): how
    eq. 2 quantizes."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"{name}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    block = tuple(block)
    if hadamard is not None and block == (16, 16):
        raise ValueError(f"{name}: a Hadamard rotation needs a 1-D block, (1, 16) or (16, 1)")
    if rounding != "rtn" and seed is None:
        seed = sr_seed(generator, x.device)
    seed = 0 if seed is None else seed
    if use_kernels(x):  # the kernels check x themselves (one check, not two)
        parts = quant_kernels.quantize(x, block, rounding, four_over_six, seed=seed,
                                       hadamard=hadamard, name=name)
        return NVFP4Tensor(*parts, x.shape, block)
    check_blocks(x, block, name)
    if hadamard is not None:
        x = hadamard_transform(x.float(), hadamard, dim=-1 if block == (1, 16) else -2)
    return quantize_reference(x, block, rounding, four_over_six, seed)


def fake_quantize(x, block=(1, 16), rounding="rtn", four_over_six=False, generator=None,
                  hadamard=None, name="x"):
    """Quantize then dequantize, in x's dtype (the Hadamard rotation, if any, is not undone)."""
    return quantize(x, block, rounding, four_over_six, generator, hadamard,
                    name).dequantize(x.dtype)


# --------------------------------------------------------------------------------------------------
# The packed tensor

class NVFP4Tensor:
    """Real 4-bit storage: 0.5 byte per element for the codes plus one E4M3 byte per 16 elements.

    codes        uint8 (*lead, M, N // 2)  row-major, two codes per byte, even element in the
                 low nibble
    scales       float8_e4m3fn (*lead, M // bm, N // bn)  one per block
    global_scale fp32 0-d tensor: S_dec
    shape        the logical shape (*lead, M, N);  block  (bm, bn): (1, 16), (16, 1) or (16, 16)
    """

    def __init__(self, codes, scales, global_scale, shape, block):
        self.codes, self.scales, self.global_scale = codes, scales, global_scale
        self.shape, self.block = torch.Size(shape), tuple(block)

    @property
    def device(self):
        return self.codes.device

    @property
    def nbytes(self):
        return self.codes.nbytes + self.scales.nbytes + self.global_scale.nbytes

    def unpack_codes(self):
        """(*lead, M, N) uint8 codes, one per element."""
        low, high = self.codes & 0xF, self.codes >> 4
        return torch.stack((low, high), dim=-1).reshape(self.shape)

    def grid_values(self):
        """q * s_b in fp32: exactly representable in bf16 (at most 6 significant bits), no global
        scale."""
        codes = self.unpack_codes().long()
        q = E2M1_VALUES.to(self.device)[codes & 7]
        q = torch.where(codes >= 8, -q, q)
        *lead, M, N = self.shape
        bm, bn = self.block
        s = self.scales.float()[..., :, None, :, None]                      # (*, M/bm, 1, N/bn, 1)
        return (q.reshape(*lead, M // bm, bm, N // bn, bn) * s).reshape(self.shape)

    def dequantize(self, dtype=torch.float32):
        if use_kernels(self.codes):  # one pass, same bits
            return nvfp4_dequant.dequantize(self.codes, self.scales, self.global_scale, self.shape,
                                            self.block, dtype)
        return (self.grid_values() * self.global_scale).to(dtype)

    def __repr__(self):
        return (f"NVFP4Tensor(shape={tuple(self.shape)}, block={self.block}, "
                f"global_scale={self.global_scale.item():.4g})")


def _pack(codes):
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


# --------------------------------------------------------------------------------------------------
# Random Hadamard transform (eq. 2's H_16^r)

def sylvester_hadamard(n=16, device=None):
    """The n x n Sylvester Hadamard matrix (n a power of 2): H[i, j] = (-1)^popcount(i & j), the
    entries +-1 in fp32. Built per call (a few tiny kernels: every eager backward draws one), not
    cached: a cached tensor first made while torch.compile's CUDA graphs warm up would stay in
    their memory pool, which they refuse."""
    i = torch.arange(n, device=device)
    bits = i[:, None] & i  # (n, n)
    shift = 1
    while 2 * shift < n.bit_length() - 1:  # fold halves of the log2(n) bits: bit 0 ends as parity
        shift *= 2
    while shift:
        bits = bits ^ (bits >> shift)
        shift //= 2
    return (1 - 2 * (bits & 1)).float()


def signed_hadamard(signs):
    """diag(s) . H16 / 4 for signs (16, 1) in {0, 1}, s = 2 signs - 1: orthogonal, entries +-1/4."""
    return (signs * 0.5 - 0.25) * sylvester_hadamard(16, signs.device)


def random_hadamard(generator=None, device=None):
    """signed_hadamard of random signs, drawn fresh for every backward (eq. 2) on the device. Random
    signs make the rotation of a fixed outlier pattern different each step, so its rounding error
    does not repeat. The kernels build the matrix in one launch (the same entries)."""
    device = generator.device if generator is not None else device
    signs = torch.randint(0, 2, (16, 1), generator=generator, device=device)
    return quant_kernels.signed_hadamard(signs) if use_kernels(signs) else signed_hadamard(signs)


def hadamard_transform(x, H, dim=-1):
    """x . H applied to every group of 16 consecutive elements along `dim` (for dim = -2 on a matrix
    this is H^T x, the left-multiplication of eq. 2)."""
    x = x.movedim(dim, -1)
    if x.shape[-1] % 16:
        raise ValueError(f"hadamard_transform: dim {dim} has size {x.shape[-1]}, "
                         "not a multiple of 16")
    y = (x.reshape(*x.shape[:-1], -1, 16) @ H.to(x.dtype)).reshape(x.shape)
    return y.movedim(-1, dim)


# --------------------------------------------------------------------------------------------------
# The NVFP4 GEMM

def nvfp4_matmul(a, b, out_dtype=torch.float32, trans_a=False, trans_b=False):
    """a_hat @ b_hat^T for logical a (*, M, K) and b (N, K), both blocked along K. trans_a /
    trans_b: the tensor is stored transposed ((K, M) / (K, N), blocked along its dim -2), e.g. the
    forward's Q16x16(W) (out, in) used as the (in, out) operand of dX = dY W, without re-packing.
    Like a native NVFP4 GEMM: products of E2M1 values and block scales are accumulated in fp32 and
    the two global scales applied once at the end."""
    ka = (a.shape[-2], a.block[0]) if trans_a else (a.shape[-1], a.block[1])
    kb = (b.shape[-2], b.block[0]) if trans_b else (b.shape[-1], b.block[1])
    if ka[0] != kb[0] or ka[1] != 16 or kb[1] != 16:
        raise ValueError(f"nvfp4_matmul: need a (M, K), b (N, K) both blocked along K; "
                         f"got {tuple(a.shape)} {a.block} (trans_a={trans_a}) and "
                         f"{tuple(b.shape)} {b.block} (trans_b={trans_b})")
    if use_kernels(a.codes):
        lead = a.shape[:-2] if not trans_a else ()
        if lead:  # fold a's leading dims into its rows: the GEMM kernels take 2-D operands
            M, K = a.shape[:-1].numel(), a.shape[-1]
            a = NVFP4Tensor(a.codes.reshape(M, K // 2), a.scales.reshape(M // a.block[0], -1),
                            a.global_scale, (M, K), a.block)
        out = nvfp4_gemm(a, b, out_dtype, trans_a, trans_b)
        return out.reshape(*lead, -1, out.shape[-1]) if lead else out
    ga, gb = a.grid_values(), b.grid_values()
    ga, gb = (ga.transpose(-1, -2) if trans_a else ga), (gb if trans_b else gb.transpose(-1, -2))
    return ((ga @ gb) * (a.global_scale * b.global_scale)).to(out_dtype)


# --------------------------------------------------------------------------------------------------
# The precision contract: one entry per quantized operand, read by the reference and every kernel
# route

HADAMARDS = ("none", "random", "fixed")


@dataclass(frozen=True)
class Quant:
    """How one operand is quantized to NVFP4.
    block          (1, 16), (16, 1) or (16, 16), on the operand as stored
    rounding       "rtn" | "sr" | "sr_up"
    hadamard       "none"; "random": eq. 2's fresh random 16x16 Hadamard along the block first;
                   "fixed": the optimizer states' Sylvester H16 / 4 (optim.fwht16)
    four_over_six  4/6 block scaling; None: the layer's setting (model.Recipe.four_over_six)"""
    block: tuple = (1, 16)
    rounding: str = "rtn"
    hadamard: str = "none"
    four_over_six: bool = None

    def __post_init__(self):
        if (tuple(self.block) not in BLOCKS or self.rounding not in ROUNDINGS
                or self.hadamard not in HADAMARDS):
            raise ValueError(f"Quant{(self.block, self.rounding, self.hadamard)}: block must be "
                             f"one of {BLOCKS}, rounding one of {ROUNDINGS}, "
                             f"hadamard one of {HADAMARDS}")

    def resolved(self, four_over_six):
        """This entry with the layer's 4/6 filled in where the entry leaves it open."""
        return (self if self.four_over_six is not None
                else replace(self, four_over_six=bool(four_over_six)))


# eqs. 1-2: Y = Q(X) Q(W)^T, dX = Q(dY) Q(W) (the forward's Q(W) reused), dW = Q(dY^T H) Q(H^T
# Q(X)). The blocks follow from the equations (each GEMM's contraction dim); rounding, Hadamard and
# 4/6 are choices.
LINEAR = {
    "forward.x": Quant((1, 16), "rtn"),                     # activations, RTN (the paper's forward)
    # weights: 16x16 so that W^T reuses them for dX
    "forward.w": Quant((16, 16), "rtn"),
    "dgrad.dy": Quant((1, 16), "sr"),                       # gradients: unbiased SR
    # eq. 2: along tokens, after a random Hadamard
    "wgrad.dy": Quant((16, 1), "sr", "random"),
    # eq. 2: the forward's Q(X), dequantized, likewise
    "wgrad.x": Quant((16, 1), "sr", "random"),
}
# each GEMM's contraction dim fixes its operands' blocks: a fork edits rounding, Hadamard and 4/6
_EQ_BLOCKS = {name: q.block for name, q in LINEAR.items()}


_CONTRACTS = {}  # (4/6, LINEAR's entries) -> the resolved contract: each layer call reads it


def linear_contract(four_over_six):
    """LINEAR as it is now (read at call time: a fork edits the table, both routes follow), 4/6
    resolved, checked against what eqs. 1-2 allow."""
    key = (four_over_six, *LINEAR.values())
    if key not in _CONTRACTS:
        _CONTRACTS[key] = _resolve_contract(four_over_six)
    return _CONTRACTS[key]


def _resolve_contract(four_over_six):
    entries = {name: LINEAR[name].resolved(four_over_six) for name in _EQ_BLOCKS}
    for name, block in _EQ_BLOCKS.items():
        if tuple(entries[name].block) != block:
            raise ValueError(f"nvfp4.LINEAR[{name!r}].block must be {block} (the GEMM's "
                             f"contraction dim), got {entries[name].block}")
    if (entries["wgrad.dy"].hadamard != entries["wgrad.x"].hadamard
            or entries["wgrad.x"].hadamard == "fixed"):
        raise ValueError("nvfp4.LINEAR: wgrad.dy and wgrad.x need the same hadamard, 'random' or "
                         "'none' (H H^T = I only when both operands are rotated)")
    for name in ("forward.x", "forward.w", "dgrad.dy"):
        if entries[name].hadamard != "none":
            raise ValueError(f"nvfp4.LINEAR[{name!r}].hadamard: only eq. 2's operands are rotated")
    return entries


# The two schemes no table states, by version: bump one when a change moves a single bit of what it
# names (train.py hashes both with the contracts into a run's numerics_id, so a record made before
# the bump no longer passes for today's). SR: 16 random bits per element, one Philox4x32-10 call per
# 8 neighbours (sr_uniforms), each call's seed drawn by the tensor's device RNG (sr_seed);
# encoding: Transformer Engine's scales and one reciprocal per block.
SR_SCHEME = "philox4x32-10/16bit/device-seed/v3"
ENCODING = "te-nvfp4/v1"


# --------------------------------------------------------------------------------------------------
# The linear layer's pieces: the three GEMMs of eqs. 1-2 quantize their operands as LINEAR says

def quantize_as(x, entry, seed=0, hadamard=None, name="x"):
    """Quantize x as a contract entry says (`hadamard`: the drawn H when entry.hadamard is
    "random")."""
    return quantize(x, entry.block, entry.rounding, entry.four_over_six, name=name, seed=seed,
                    hadamard=hadamard if entry.hadamard == "random" else None)


def draws(entry, device):
    """The SR seed an entry needs (0 for RTN: unused), drawn on the device (sr_seed)."""
    return sr_seed(device=device) if entry.rounding != "rtn" else 0


def backward_draws(c, need_dx, need_dw, device):
    """The random draws of one backward, made once for whichever route runs it, in a fixed order:
    dX's SR seed, then eq. 2's random Hadamard H (if the contract rotates) and the seeds of its two
    operands. Returns (seed_dx, H, (seed_dy, seed_x)); H is None without a rotation."""
    seed_dx = draws(c["dgrad.dy"], device) if need_dx else None
    H = random_hadamard(device=device) if need_dw and c["wgrad.dy"].hadamard == "random" else None
    seeds_dw = (draws(c["wgrad.dy"], device), draws(c["wgrad.x"], device)) if need_dw else None
    return seed_dx, H, seeds_dw


def wgrad(dy, qx, c, hadamard, seeds, out_dtype=torch.float32):
    """Eq. 2: dW = Q(dY^T H) . Q(H^T Q1x16(X)), H the drawn random Hadamard, both operands as
    c["wgrad.dy"] and c["wgrad.x"] say (SR). dy (T, out); qx the forward's packed Q1x16(X) (T, in),
    dequantized in dy's dtype (bf16 in training: the precision the activations had) before its
    rotation. The rotation spreads outliers along the token (contraction) dim before the 16-element
    blocks see them; H H^T = I leaves the product unbiased. Both operands are quantized as stored,
    (T, out) and (T, in) with 16x1 blocks along T, and the GEMM reads them transposed. seeds:
    (dY's, X's) SR seeds. Returns (out, in) in out_dtype."""
    if dy.shape[0] % 16:
        raise ValueError(f"wgrad: the number of tokens ({dy.shape[0]}) must be a multiple of 16 "
                         "(the contraction dim of dW)")
    # (T, out)
    dyq = quantize_as(dy, c["wgrad.dy"], seeds[0], hadamard, name="gradient dY")
    xhq = quantize_as(qx.dequantize(dy.dtype), c["wgrad.x"], seeds[1], hadamard,
                      name="activation Q(X)")
    # (out, in)
    return nvfp4_matmul(dyq, xhq, out_dtype, trans_a=True, trans_b=True)


# --------------------------------------------------------------------------------------------------
# The linear layer of eqs. 1-2 (and LoRA-SVD's, eq. 1's branch beside it: lora_svd.py): the forward
# and backward bodies, the autograd.Function between them, and the same bodies as torch.library
# custom ops for torch.compile. The random draws (draws, backward_draws) are made inside the bodies
# when they run, so a compiled run draws in eager's order (tests/test_compile.py).

def low_rank(x, A, B, dtype):
    """LoRA-SVD's branch (x A^T) B^T on dtype operands, the rank-r intermediate rounded to dtype
    too, fp32 accumulation (the GPU's BF16 GEMMs): X L1^T L2^T in Y, dY L2 L1 in dX (eq. 1)."""
    t = (x.to(dtype).float() @ A.to(dtype).float().t()).to(dtype)
    return t.float() @ B.to(dtype).float().t()


def quantized_weight(weight, L1, L2, four_over_six):
    """Q16x16(W) as Y and dX multiply it (LINEAR's forward.w), three tensors: the packed codes,
    scales and global scale, or on the Hopper kernels the bf16 grid values (with LoRA-SVD's
    L1 (r, in), L2 (out, r): [W_hat | L2 ; L1 | unused]), an empty scales tensor and the global
    scale."""
    c = linear_contract(four_over_six)["forward.w"]
    w, seed = weight.detach(), draws(c, weight.device)
    if use_kernels(w):
        return linear_kernels.weight(w, c, seed, L1, L2)
    qw = quantize_as(w, c, seed, name="weight W")
    return qw.codes, qw.scales, qw.global_scale


def quantized_input(x, four_over_six, r=0, global_amax=None):
    """Q1x16(X) as Y multiplies it (LINEAR's forward.x), four tensors: the packed codes, scales and
    global scale (what eq. 2 reads in the backward) and, on the Hopper kernels, the bf16 GEMM
    operand (T, in + r) of X_hat with r columns for LoRA-SVD's branch, else an empty tensor.
    x (T, in); global_amax: max |x| where the kernels have it already (_cast), else None."""
    c = linear_contract(four_over_six)["forward.x"]
    seed = draws(c, x.device)
    if use_kernels(x):
        return linear_kernels.activation(x, c, seed, r, global_amax)
    qx = quantize_as(x, c, seed, name="activation X")
    return qx.codes, qx.scales, qx.global_scale, x.new_empty(0)


def linear_forward(x: Tensor, weight: Tensor, L1: Optional[Tensor], L2: Optional[Tensor],
                   beta: float, branch_dtype: torch.dtype, four_over_six: bool,
                   qw_data: Optional[Tensor] = None, qw_scales: Optional[Tensor] = None,
                   qw_scale: Optional[Tensor] = None, qx_codes: Optional[Tensor] = None,
                   qx_scales: Optional[Tensor] = None, qx_scale: Optional[Tensor] = None,
                   qx_operand: Optional[Tensor] = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """eq. 1: Y = Q1x16(X) Q16x16(W)^T [+ beta (X L1^T) L2^T with LoRA-SVD's L1 (r, in), L2 (out,
    r); None: the direct layer], each operand as LINEAR says (read when it runs, 4/6 resolved).
    x (..., in), weight (out, in); qw_*: quantized_weight's tensors where the caller keeps them
    (WeightCache), qx_*: quantized_input's where the caller has them (_SharedInput), else each is
    quantized here. -> (Y (..., out) in x's dtype, then what the backward reads: the packed
    Q1x16(X) (T, in) as qx_codes, qx_scales, qx_scale, and W's quantization (quantized_weight) as
    qw_data, qw_scales, qw_scale). Leading dims are flattened into tokens T: Y is not a view (FSDP2
    wants that)."""
    x2 = x.reshape(-1, x.shape[-1])                                                     # (T, in)
    qx = ((qx_codes, qx_scales, qx_scale, qx_operand) if qx_codes is not None           # Q1x16(X)
          else quantized_input(x2, four_over_six, 0 if L1 is None else L1.shape[0]))
    qw = ((qw_data, qw_scales, qw_scale) if qw_data is not None                         # Q16x16(W)
          else quantized_weight(weight, L1, L2, four_over_six))
    if use_kernels(x2):  # LoRA's branch rides the residual's GEMM, Y is written once (App. 9)
        y = linear_kernels.forward(x2, qx, qw, L1, L2, beta, branch_dtype)
    else:
        y = nvfp4_matmul(packed(*qx[:3], (1, 16)), packed(*qw, (16, 16)),
                         out_dtype=x.dtype if L1 is None else torch.float32)            # (T, out)
        if L1 is not None:
            y = (y + beta * low_rank(x2, L1, L2, branch_dtype)).to(x.dtype)
    return y.reshape(*x.shape[:-1], -1), *qx[:3], *qw


def linear_backward(dy: Tensor, qx_codes: Tensor, qx_scales: Tensor, qx_scale: Tensor,
                    qw_data: Tensor, qw_scales: Tensor, qw_scale: Tensor, L1: Optional[Tensor],
                    L2: Optional[Tensor], beta: float, branch_dtype: torch.dtype,
                    four_over_six: bool, dw_dtype: torch.dtype, dx_dtype: torch.dtype,
                    need_dx: bool, need_dw: bool, dx_into: Optional[Tensor]
                    ) -> tuple[Tensor, Tensor]:
    """eq. 1's dX = Q1x16(dY) Q16x16(W) [+ beta (dY L2) L1] (the forward's W reused), rounded to
    dY's dtype and returned in dx_dtype (x's, as the autograd of autocast's cast would return it),
    and eq. 2's dW = wgrad, in dw_dtype, from what linear_forward saved. -> (dX (..., in),
    dW (out, in)), each an empty tensor where not needed (a custom op returns tensors). dx_into:
    where the layers reading one input sum their dX (_GradientSum): dX is added into it instead,
    and returned empty; None: dX returned. (Passed always, never left to a default: torch 2.11's
    in-place bookkeeping drops a mutable argument left at its default and then indexes it.)"""
    c = linear_contract(four_over_six)
    dy2 = dy.reshape(-1, dy.shape[-1])                                                  # (T, out)
    qx = packed(qx_codes, qx_scales, qx_scale, (1, 16))
    seed_dx, H, seeds_dw = backward_draws(c, need_dx, need_dw, dy2.device)
    need = (need_dx, need_dw)
    into = None if dx_into is None else dx_into.view(-1, dx_into.shape[-1])            # (T, in)
    if use_kernels(dy2):
        dx, dw = linear_kernels.backward(dy2, qx, (qw_data, qw_scales, qw_scale), c, need, seed_dx,
                                         H, seeds_dw, dw_dtype, L1, L2, beta, branch_dtype,
                                         dx_dtype, into)
    else:
        dx = dw = None
        if need_dx:
            dyq = quantize_as(dy2, c["dgrad.dy"], seed_dx, name="gradient dY")          # Q1x16(dY)
            qw = packed(qw_data, qw_scales, qw_scale, (16, 16))           # Q16x16(W), not requantized
            dx = nvfp4_matmul(dyq, qw, dy.dtype if L1 is None else torch.float32, trans_b=True)
            if L1 is not None:
                dx = (dx + beta * low_rank(dy2, L2.t(), L1.t(), branch_dtype)).to(dy.dtype)
            dx = dx.to(dx_dtype) if into is None else into.add_(dx.to(dx_dtype))
        if need_dw:
            dw = wgrad(dy2, qx, c, H, seeds_dw, out_dtype=dw_dtype)                        # eq. 2
    return (dx.reshape(*dy.shape[:-1], -1) if need_dx and into is None else dy.new_empty(0),
            dw if need_dw else dy.new_empty(0))


def packed(codes, scales, global_scale, block):
    """The NVFP4Tensor of an op's (codes, scales, global scale): shape (*, M, 2 * codes' N)."""
    return NVFP4Tensor(codes, scales, global_scale, (*codes.shape[:-1], 2 * codes.shape[-1]),
                       block)


class LinearFunction(torch.autograd.Function):
    """Eqs. 1-2 as autograd sees them, eager and compiled. Saved for the backward: the packed
    Q1x16(X) (the 4-bit activations: where FP4 training saves memory), W as dX multiplies it, and
    LoRA-SVD's L1, L2; never X itself. Under torch.compile the bodies run as the custom ops below,
    opaque nodes in the graph (inductor neither sees nor re-traces their Triton kernels); eager
    calls them directly: a custom op's dispatch is host time every eager layer call would pay
    (docs/performance.md measures it)."""

    @staticmethod
    def forward(ctx, x, weight, L1, L2, beta, branch_dtype, four_over_six, qw=(), dtype=None,
                dx_sum=None):
        """qw: W's quantization from a WeightCache, or () to quantize W here. dtype: what X is cast
        to first (autocast's), None: X as it is. Eager, the cast and X's quantization are shared
        with the layers that read the same x (_SHARED_INPUT), and dx_sum is where their dX are
        summed (_GradientSum; None: returned to autograd); compiled, the graph makes them."""
        compiling = torch.compiler.is_compiling()
        body = linear_op if compiling else linear_forward
        ctx.x_dtype, qx = x.dtype, ()
        with torch.autocast(x.device.type, enabled=False):  # the contract's arithmetic
            if not compiling:
                x = _SHARED_INPUT.cast(x, dtype)
                qx = _SHARED_INPUT.quantized(x, four_over_six, 0 if L1 is None else L1.shape[0])
            y, qx_codes, qx_scales, qx_scale, qw_data, qw_scales, qw_scale = body(
                x, weight, L1, L2, beta, branch_dtype, four_over_six, *(qw or [None] * 3), *qx)
        ctx.save_for_backward(qx_codes, qx_scales, qx_scale, qw_data, qw_scales, qw_scale, L1, L2)
        ctx.beta, ctx.branch_dtype, ctx.four_over_six = beta, branch_dtype, four_over_six
        ctx.dw_dtype, ctx.dx_sum = weight.dtype, dx_sum
        return y

    @staticmethod
    def backward(ctx, dy):
        """-> grads of (x, weight, L1, L2, ...). L1 and L2 get none: their gradients come from dW
        after the backward (lora_svd.project_gradients, App. 8, eqs. 3-4). DDP takes a missing
        gradient as zero (tests/test_lora_svd.py)."""
        qx_codes, qx_scales, qx_scale, qw_data, qw_scales, qw_scale, L1, L2 = ctx.saved_tensors
        need_dx, need_dw, need_l1, need_l2 = ctx.needs_input_grad[:4]
        body = linear_backward_op if torch.compiler.is_compiling() else linear_backward
        summing, total = False, None
        if ctx.dx_sum is not None:
            _SHARED_INPUT.release(ctx.dx_sum)
            # (create_graph: autograd's sum, whose own graph the double backward needs)
            summing = need_dx and not torch.is_grad_enabled()
            total = ctx.dx_sum.so_far() if summing else None
        with torch.autocast(dy.device.type, enabled=False):
            dx, dw = body(dy, qx_codes, qx_scales, qx_scale, qw_data, qw_scales, qw_scale, L1, L2,
                          ctx.beta, ctx.branch_dtype, ctx.four_over_six, ctx.dw_dtype, ctx.x_dtype,
                          need_dx, need_dw, total)
        dx = ctx.dx_sum.returned(dx if total is None else None) if summing else dx
        return (dx if need_dx else None, dw if need_dw else None, None, None, None,
                None, None, None, None, None)


# What torch.compile sees: the bodies as custom ops (schemas from their annotations), each with a
# fake that gives its outputs' shapes and dtypes (tests: torch.library.opcheck)
linear_op = torch.library.custom_op("nanofp4::linear", linear_forward, mutates_args=())
linear_backward_op = torch.library.custom_op("nanofp4::linear_backward", linear_backward,
                                             mutates_args=("dx_into",))


@linear_op.register_fake
def _(x, weight, L1, L2, beta, branch_dtype, four_over_six, qw_data=None, qw_scales=None,
      qw_scale=None, qx_codes=None, qx_scales=None, qx_scale=None, qx_operand=None):
    """linear_forward's outputs, empty (W's tensors as the route makes them): what torch.compile
    plans with."""
    (K, N), e4m3 = (x.shape[-1], weight.shape[0]), torch.float8_e4m3fn
    r = 0 if L1 is None else L1.shape[0]
    T = x.numel() // K
    grid_values = use_kernels(x) and not use_dot_scaled(x.device)  # the Hopper kernels'
    qw = ([((N + r, K + r), torch.bfloat16), ((0,), e4m3)] if grid_values
          else [((N, K // 2), torch.uint8), ((N // 16, K // 16), e4m3)])
    made = [((T, K // 2), torch.uint8), ((T, K // 16), e4m3), ((), torch.float32), *qw,
            ((), torch.float32)]
    return x.new_empty((*x.shape[:-1], N)), *(x.new_empty(s, dtype=d) for s, d in made)


@linear_backward_op.register_fake
def _(dy, qx_codes, qx_scales, qx_scale, qw_data, qw_scales, qw_scale, L1, L2, beta, branch_dtype,
      four_over_six, dw_dtype, dx_dtype, need_dx, need_dw, dx_into):
    N, K = dy.shape[-1], 2 * qx_codes.shape[1]
    return (dy.new_empty((*dy.shape[:-1], K), dtype=dx_dtype) if need_dx and dx_into is None
            else dy.new_empty(0),
            dy.new_empty((N, K), dtype=dw_dtype) if need_dw else dy.new_empty(0))


def nvfp4_linear(x, weight, four_over_six=False, L1=None, L2=None, beta=1.0,
                 branch_dtype=torch.bfloat16, cache=None, sum_dx=False):
    """Y = Q1x16(X) Q16x16(W)^T with the eq. 1-2 backward (LINEAR); with L1, L2 LoRA-SVD's
    eq. 1 (lora_svd.lora_svd_linear). Under autocast X is cast to the autocast dtype. cache: the
    layer's WeightCache (torch.compile quantizes W in its graph instead). sum_dx: the layers that
    read this x sum their dX in place (_GradientSum) rather than leave the sum to autograd: the
    same bits where x feeds nothing else (the blocks' q, k, v and gate, up), the same sum in
    another order where it does."""
    dtype = (torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type)
             else None)
    if torch.compiler.is_compiling():  # the cast in the graph, where inductor fuses it
        x = x if dtype is None else x.to(dtype)
        return LinearFunction.apply(x, weight, L1, L2, float(beta), branch_dtype, four_over_six)
    qw = () if cache is None else cache.get(weight, L1, L2, four_over_six)
    x, dx_sum = _SHARED_INPUT.summing(x) if sum_dx else (x, None)
    return LinearFunction.apply(x, weight, L1, L2, float(beta), branch_dtype, four_over_six, qw,
                                dtype, dx_sum)


class _SharedInput:
    """What the layers that read one input share: q, k and v read one normalized x, gate and up
    another. Each cast it to bf16 under autocast (as nn.Linear does) and quantized the copy by RTN
    into the same codes (LINEAR's forward.x): three casts and three quantizations of the same
    bytes. Now the first layer makes them and the others take them: the cast copy, keyed by the
    input tensor itself, and its quantization (quantized_input), keyed by the tensor quantized;
    each key a weak reference (the memory held by a detached alias, so no other tensor can take it
    and no autograd graph is kept) and the version counter. The layers save the same packed
    Q1x16(X) for eq. 2 (one copy in memory), and each still returns its own dX in x's dtype, so
    autograd adds them as it added the casts'. An SR forward.x draws afresh each call. On the
    kernels the cast also gives the copy's global amax, from the same read (_cast), which the
    quantization then takes instead of reading the copy again."""

    def __init__(self):
        self.source = self.cast_x = self.cast_amax = self.quantized_of = self.key = self.qx = None
        self.summed_of = self.point = self.dx_sum = None

    @staticmethod
    def _holding(x):
        return weakref.ref(x), x.detach(), x._version

    @staticmethod
    def _holds(held, x):
        return held is not None and held[0]() is x and held[2] == x._version

    def cast(self, x, dtype):
        if dtype is None or x.dtype == dtype:
            return x
        if x.is_inference():  # no version counter to key on
            return x.to(dtype)
        if not (self._holds(self.source, x) and self.cast_x.dtype == dtype):
            self.source = self._holding(x)
            self.cast_x, self.cast_amax = _cast(x, dtype)
        return self.cast_x

    def quantized(self, x, four_over_six, r):
        """quantized_input of x (..., in) with r branch columns: made by the first layer that
        reads x, taken by the next."""
        x2, entry = x.reshape(-1, x.shape[-1]), linear_contract(four_over_six)["forward.x"]
        amax = self.cast_amax if x is self.cast_x else None  # the copy's, from its cast
        if entry.rounding != "rtn" or x.is_inference():
            return quantized_input(x2, four_over_six, r, amax)
        kernels = use_kernels(x2)
        key = (entry, r, kernels, kernels and use_dot_scaled(x2.device))
        if not (self._holds(self.quantized_of, x) and self.key == key):
            self.quantized_of, self.key = self._holding(x), key
            self.qx = quantized_input(x2, four_over_six, r, amax)
        return self.qx

    def summing(self, x):
        """(what the layers reading x take as their input, where they sum their dX): a view of x
        made by the first of them (its autograd node's only readers are these layers, so that the
        sum in place cannot miss a gradient from elsewhere) and its _GradientSum; (x, None) where
        no gradient flows to x. The view is held until a layer reads another input, as the next
        layer of a block does, or a backward pass reaches these layers (release)."""
        if not (torch.is_grad_enabled() and x.requires_grad):
            return x, None
        if not self._holds(self.summed_of, x):
            self.summed_of, self.dx_sum = self._holding(x), _GradientSum()
            self.point = x.view_as(x)  # an autograd node of its own, the layers its only readers
        self.dx_sum.layers += 1
        return self.point, self.dx_sum

    def release(self, dx_sum):
        """Drops the view that the layers summing into dx_sum read, as a backward pass reaches
        them. Held past its backward, the view would keep the forward's autograd graph alive, the
        parameters' gradient accumulators with it, and the next forward would reuse those: a CUDA
        graph captured after an eager step then waits on the eager run's stream at the end of its
        backward, and the capture fails."""
        if self.dx_sum is dx_sum:
            self.summed_of = self.point = self.dx_sum = None


class _GradientSum:
    """The dX of the layers that read one input, summed. Autograd sums the dX each layer returns
    in the input's buffer: for every layer after the first, its dX written, then read with the sum
    and the sum written (16 bytes an element in fp32, k, v and up's in a 1b micro-step). Instead
    the first layer of a backward pass returns its dX and each later one adds its own into that
    tensor in the pass that scales its GEMM's output (kernels/nvfp4_gemm.scale_: 4 bytes more read)
    and returns none. They add in the order they run, the order autograd adds in: the same sum
    bit for bit. One sum per backward pass (autograd's graph task: retain_graph runs it again)."""

    def __init__(self):
        self.layers, self.task, self.total, self.left = 0, None, None, 0

    def so_far(self):
        """The sum of this backward pass so far; None: the calling layer is its first."""
        task = torch._C._current_graph_task_id()
        if task != self.task:
            self.task, self.total, self.left = task, None, self.layers
        return self.total

    def returned(self, dx):
        """What a layer returns to autograd after its backward: dx, its dX for the first layer
        (the sum the others add into), None for the others (theirs added)."""
        if dx is not None:
            self.total = dx
        self.left -= 1
        if self.left == 0:  # all added: autograd has the sum, this need not keep it
            self.total = None
        return dx


def _cast(x, dtype):
    """Autocast's cast of a linear layer's input -> (the copy, its global amax or None). On the
    kernels an fp32 x goes to bf16 through quant_kernels.cast_bf16_amax: the same copy, and the
    amax its Q1x16 quantization reads, from one read of x."""
    if (use_kernels(x) and dtype == torch.bfloat16 and x.dtype == torch.float32
            and x.is_contiguous() and x.shape[-1] % 16 == 0):
        return quant_kernels.cast_bf16_amax(x)
    return x.to(dtype), None


_SHARED_INPUT = _SharedInput()


class WeightCache:
    """A layer's quantized_weight kept from one forward to the next while W (and L1, L2) stay as
    they are: an optimizer step's micro-steps all multiply the same Q16x16(W) (forward.w is RTN:
    the same bits every time), so W is quantized once a step instead of once a micro-step, as
    Transformer Engine keeps its FP8 weights between micro-batches. Stale when any of them changed
    in place (the optimizer, a checkpoint load or a realignment bumps its version counter) or
    moved; refreshed in place, so a CUDA graph that reads it stays valid (train.GraphedMicroStep
    refreshes before each replay: refresh_weights). An SR forward.w is drawn afresh each call."""

    def __init__(self):
        self.key, self.tensors = None, None

    def get(self, weight, L1, L2, four_over_six):
        entry = linear_contract(four_over_six)["forward.w"]
        # SR draws afresh each call; a tensor made in inference mode could not be saved for a backward
        if entry.rounding != "rtn" or torch.is_inference_mode_enabled():
            return ()
        key = (use_kernels(weight), entry, *[(t.data_ptr(), t._version)
                                             for t in (weight, L1, L2) if t is not None])
        if key != self.key:  # the contract's arithmetic, as in LinearFunction.forward
            with torch.no_grad(), torch.autocast(weight.device.type, enabled=False):
                fresh = quantized_weight(weight, L1, L2, four_over_six)
                if self.tensors is not None and all((a.shape, a.dtype, a.device) ==
                                                    (b.shape, b.dtype, b.device)
                                                    for a, b in zip(fresh, self.tensors)):
                    for old, new in zip(self.tensors, fresh):
                        old.copy_(new)
                else:
                    self.tensors = fresh
            self.key = key
        return self.tensors


def refresh_weights(model):
    """Bring every FP4 layer's WeightCache up to date with its weights (eagerly: before a CUDA
    graph that reads them replays)."""
    for m in model.modules():
        if hasattr(m, "weight_cache"):
            m.quantized_weight()


class NVFP4Linear(nn.Module):
    """Drop-in nn.Linear (no bias by default) whose three GEMMs run in NVFP4; the master weight
    stays fp32."""

    def __init__(self, in_features, out_features, bias=False, four_over_six=False, device=None,
                 dtype=None):
        super().__init__()
        if in_features % 16 or out_features % 16:
            raise ValueError(f"NVFP4Linear: in_features ({in_features}) and out_features "
                             f"({out_features}) must be multiples of 16 (the 16x16 weight blocks)")
        self.in_features, self.out_features, self.four_over_six = (in_features, out_features,
                                                                   four_over_six)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype))
        self.bias = (nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias
                     else None)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default
        self.weight_cache = WeightCache()

    def quantized_weight(self):
        return self.weight_cache.get(self.weight, None, None, self.four_over_six)

    @classmethod
    def from_linear(cls, linear, four_over_six=False):
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, four_over_six,
                    device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x):
        # x feeds only this layer's product (and the other layers' that read it)
        y = nvfp4_linear(x, self.weight, self.four_over_six, cache=self.weight_cache, sum_dx=True)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"four_over_six={self.four_over_six}")


# --------------------------------------------------------------------------------------------------
# Quantization error: the paper's Rel. MSE (the project's one error measure), and App. 7's growth
# with the hidden dimension

def relative_mse(x, x_hat):
    """Rel. MSE := MSE(x - x_hat) / mean(x^2), the paper's error measure (Fig. 3)."""
    return ((x.double() - x_hat.double()).pow(2).mean() / x.double().pow(2).mean()).item()


@torch.no_grad()
def matmul_quant_error(hidden_dims=(512, 1024, 2048, 4096), rounding="rtn", tokens=256,
                       out_features=256, four_over_six=False, seed=0, device=None):
    """For each contraction length N: Y = X W^T with X (tokens, N), W (out, N) Gaussian, against
    Q1x16(X) Q16x16(W)^T. Returns rows {N, mse, rel_mse}: App. 7 predicts mse = Theta(N) (each
    output sums N independent rounding errors) while rel_mse = mse / mean(Y^2) stays flat for i.i.d.
    inputs."""
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    rows = []
    for n in hidden_dims:
        x = torch.randn(tokens, n, generator=g, device=device)
        w = torch.randn(out_features, n, generator=g, device=device)
        y = x @ w.t()
        qx = quantize(x, (1, 16), rounding, four_over_six, generator=g)
        qw = quantize(w, (16, 16), rounding, four_over_six, generator=g)
        y_hat = nvfp4_matmul(qx, qw)
        rows.append({"N": n, "rounding": rounding, "mse": (y_hat - y).pow(2).mean().item(),
                     "rel_mse": relative_mse(y, y_hat)})
    return rows


# --------------------------------------------------------------------------------------------------
# Plumbing. The seam: the Triton kernels on CUDA, this file's reference everywhere else

ROUTES = ("auto", "reference", "kernels")


def route():
    """The route: train.py --route, else NANOFP4_ROUTE (default auto), read at every call so a
    layer takes the route in force when it runs."""
    r = os.environ.get("NANOFP4_ROUTE", "auto")
    if r not in ROUTES:
        raise ValueError(f"NANOFP4_ROUTE (train.py --route) must be one of {', '.join(ROUTES)}, "
                         f"got {r!r}")
    return r


def use_kernels(x):
    """Does an operation on x run the Triton kernels? auto (default): on a CUDA GPU whose row of
    kernels/targets.py has them (sm_80 and newer; which FP4 products each takes is decided there
    too); reference: never (the reference also on a GPU); kernels: always (on a CPU the kernels run
    in Triton's interpreter: how the tests hold each kernel route to the reference). Every module's
    seam is this function."""
    r = route()
    return r == "kernels" or (r == "auto" and x.is_cuda
                              and targets.of(x.device).route != "reference")


def kernels_line(device):
    """What runs on device, for a run's first log line and summary.json: "kernels: sm_90
    grid-values (NVIDIA H200)", or why the reference runs instead."""
    if route() == "reference":
        return "kernels: off (route reference)"
    if route() == "kernels" and torch.device(device).type != "cuda":
        return "kernels: all, in Triton's interpreter (route kernels on cpu)"
    return targets.describe(torch.device(device))
