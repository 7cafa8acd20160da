"""
NVFP4: the 4-bit number format (paper §2), the direct-NVFP4 linear layer (§3.2's baseline: eqs. 1-2
without the LoRA branch) and the quantization-error analysis of App. 7.

The functions here are the reference: plain PyTorch that reads like the equations and runs anywhere.
On CUDA they hand off to the Triton kernels in kernels/ at one seam (`_use_kernels`, below): bit-identical for
quantization (RTN; SR given the same uniforms), the same numbers up to summation order for the GEMMs. The
kernels decide how the GPU multiplies (kernels/nvfp4_gemm.py, kernels/nvfp4_linear.py).
NANOFP4_REFERENCE=1 forces the reference path everywhere in the project (`use_reference`).

Conventions (the numerics of Transformer Engine's NVFP4 recipe and torchao's NVFP4Tensor):
  element   E2M1: +-{0, .5, 1, 1.5, 2, 3, 4, 6}; code = sign bit (bit 3) | index into E2M1_VALUES
  global    s_g = amax(|x|) / (448 * 6)                 (256 instead of 448 with 4/6; 1 if amax == 0)
  block     s_b = e4m3(min(amax_block / 6 / s_g, 448))  (round to nearest even, subnormals kept; up for "sr_up")
  value     q = E2M1(clamp(x / (s_b * s_g), -6, 6)),  x_hat = q * s_b * s_g
"""

import math
import os

import torch
import torch.nn as nn

from kernels import nvfp4_linear as linear_kernels
from kernels import nvfp4_quant as quant_kernels
from kernels.nvfp4_gemm import nvfp4_gemm
from kernels.nvfp4_math import E4M3_MAX, E4M3_MAX_46, FP4_MAX  # 448, 256 (4/6: 256 * 1.5 < 448), 6
from kernels.nvfp4_quant import BLOCKS, ROUNDINGS, SR_MODES, check_blocks  # block shapes, "rtn" / "sr" / "sr_up"

# the E2M1 magnitudes by code index; on the CPU even under `with torch.device("meta")`
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device="cpu")


# ----------------------------------------------------------------------------------------------------------
# The seam: the Triton kernels on CUDA, this file's reference everywhere else

def use_reference():
    """True when NANOFP4_REFERENCE=1: every module then runs its PyTorch reference path, also on CUDA."""
    return os.environ.get("NANOFP4_REFERENCE", "0") == "1"


def _use_kernels(x):
    return x.is_cuda and not use_reference()


# ----------------------------------------------------------------------------------------------------------
# The packed tensor

class NVFP4Tensor:
    """Real 4-bit storage: 0.5 byte per element for the codes plus one E4M3 byte per 16 elements.

    codes        uint8 (*lead, M, N // 2)  row-major, two codes per byte, even element in the low nibble
    scales       float8_e4m3fn (*lead, M // bm, N // bn)  one per block
    global_scale fp32 0-d tensor
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
        """q * s_b in fp32: exactly representable in bf16 (at most 6 significant bits), no global scale."""
        codes = self.unpack_codes().long()
        q = E2M1_VALUES.to(self.device)[codes & 7]
        q = torch.where(codes >= 8, -q, q)
        *lead, M, N = self.shape
        bm, bn = self.block
        s = self.scales.float()[..., :, None, :, None]                      # (*, M/bm, 1, N/bn, 1)
        return (q.reshape(*lead, M // bm, bm, N // bn, bn) * s).reshape(self.shape)

    def dequantize(self, dtype=torch.float32):
        if _use_kernels(self.codes):  # one pass, same bits
            return quant_kernels.dequantize(self.codes, self.scales, self.global_scale, self.shape, self.block, dtype)
        return (self.grid_values() * self.global_scale).to(dtype)

    def t(self):
        """The transpose of the last two dims, re-packed: exact, no requantization ((1,16) blocks become (16,1),
        (16,16) stay). The layers never need it (the GEMMs read stored operands transposed, trans_a / trans_b);
        it is the oracle the tests use for those transposed reads."""
        codes = self.unpack_codes().transpose(-1, -2).contiguous()
        return NVFP4Tensor(_pack(codes), self.scales.transpose(-1, -2).contiguous(), self.global_scale,
                           codes.shape, self.block[::-1])

    def __repr__(self):
        return f"NVFP4Tensor(shape={tuple(self.shape)}, block={self.block}, global_scale={self.global_scale.item():.4g})"


def _pack(codes):
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


# ----------------------------------------------------------------------------------------------------------
# Quantization (reference)

def global_scale(amax, four_over_six=False):
    """s_g = amax / (448 * 6) in fp32 (256 with 4/6), 1 when amax is 0 so that zeros stay zeros."""
    # divide by a tensor, not a Python scalar: on CUDA torch turns `t / scalar` into `t * (1 / scalar)`, which
    # differs in the last bit and would break bit-equality with the kernels (and with the CPU)
    amax = amax.float()
    s = amax / torch.full_like(amax, (E4M3_MAX_46 if four_over_six else E4M3_MAX) * FP4_MAX)
    return torch.where(amax > 0, s, torch.ones_like(s))


def to_e4m3(s, up=False):
    """Round fp32 scales to E4M3 (nearest, ties to even; values below 2^-6 stay subnormal as in Transformer
    Engine: torchao lifts them to 2^-6 instead), saturating at 448. up=True: the smallest E4M3 value >= s."""
    s = s.clamp(max=E4M3_MAX)
    e = s.to(torch.float8_e4m3fn)
    if not up:
        return e
    bits = e.view(torch.uint8)  # positive E4M3: the next value up is the next bit pattern
    return torch.where(e.float() < s, bits + 1, bits).view(torch.float8_e4m3fn)


def _grid_step(a):
    """The E2M1 grid is uniform within each binade: step 0.5 below 2, 1 below 4, 2 up to 6."""
    return torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))


def _e2m1_index(q):
    """Index into E2M1_VALUES of a grid value q: 0, .5, 1, 1.5, 2 -> 0..4; 3, 4 -> 5, 6; 6 -> 7."""
    return torch.where(q <= 2, q * 2, torch.where(q <= 4, q + 2, 7.0)).to(torch.uint8)


def rtn_e2m1(a):
    """Index (0..7) of the nearest E2M1 magnitude for a in [0, 6]. torch.round rounds half to even on the binade's
    grid, which is the hardware's ties-to-even on the code: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2,
    3.5 -> 4, 5 -> 4 (a value at the top of a binade rounds into the next one, where it is exact)."""
    step = _grid_step(a)
    return _e2m1_index(torch.round(a / step) * step)


def sr_e2m1(a, rand):
    """Stochastic rounding of a in [0, 6]: up to the next grid value with probability equal to the fractional
    distance (unbiased: E[q] = a). rand: uniform [0, 1), same shape."""
    step = _grid_step(a)
    lo = torch.floor(a / step) * step
    return _e2m1_index(torch.where(rand < (a - lo) / step, lo + step, lo).clamp(max=FP4_MAX))


def _pairwise_block_sum(e):
    """Per-block sum of e (*, M/bm, bm, N/bn, bn) -> (*, M/bm, 1, N/bn, 1) as a fixed binary tree: neighbours
    along the row pairwise (16 -> 8 -> 4 -> 2 -> 1), then along the column. Every step adds two fp32 values, so the
    Triton kernel (kernels/nvfp4_quant._pairwise_block_sum) gets the same bits whatever its reduction order; a
    plain .sum() rounds in a machine-dependent order and 4/6 then picked the other candidate on ~1e-5 of blocks."""
    while e.shape[-1] > 1:
        e = e[..., 0::2] + e[..., 1::2]
    while e.shape[-3] > 1:
        e = e[..., 0::2, :, :] + e[..., 1::2, :, :]
    return e


def _quantize_reference(x, block, rounding, four_over_six, generator):
    shape, (bm, bn) = x.shape, block
    lead, (M, N) = shape[:-2], shape[-2:]
    x = x.float()
    xb = x.reshape(*lead, M // bm, bm, N // bn, bn)                      # (*, M/bm, bm, N/bn, bn)
    s_g = global_scale(x.abs().amax(), four_over_six)
    block_amax = xb.abs().amax(dim=(-3, -1), keepdim=True)               # (*, M/bm, 1, N/bn, 1)
    rand = None
    if rounding in SR_MODES:
        rand = torch.rand(xb.shape, generator=generator, device=x.device)

    def candidate(fp4_max):
        # the block's max maps to fp4_max (6 normally; 4 is 4/6's second candidate)
        s_b = to_e4m3(block_amax / torch.full_like(block_amax, fp4_max) / s_g, up=rounding == "sr_up")
        denom = s_b.float() * s_g
        a = torch.where(denom > 0, xb.abs() / torch.where(denom > 0, denom, 1.0), 0.0).clamp(max=FP4_MAX)
        return s_b, a, denom

    s_b, a, denom = candidate(FP4_MAX)
    idx = rtn_e2m1(a)
    if four_over_six:
        # 4/6 scaling: per block keep whichever of max->6 / max->4 reconstructs with lower squared error
        # (ties to 6). The choice uses the RTN error even when rounding is SR, so that the random draw does
        # not influence the scale and SR stays unbiased given the scale.
        def rtn_error(idx, denom):
            d = E2M1_VALUES.to(x.device)[idx.long()] * denom - xb.abs()
            return _pairwise_block_sum(d * d)
        s_b4, a4, denom4 = candidate(4.0)
        idx4 = rtn_e2m1(a4)
        use4 = rtn_error(idx4, denom4) < rtn_error(idx, denom)
        s_b = torch.where(use4, s_b4.float(), s_b.float()).to(torch.float8_e4m3fn)
        a, idx = torch.where(use4, a4, a), torch.where(use4, idx4, idx)
    if rounding in SR_MODES:
        idx = sr_e2m1(a, rand)
    # sign bit = x < 0: a negative x that rounds to 0 keeps its sign (code 8, -0), an input of exactly -0.0 gets code
    # 0 (+0); both decode to zero. The kernels decide the sign the same way.
    codes = idx | ((xb < 0).to(torch.uint8) << 3)
    codes = codes.reshape(shape)
    scales = s_b.reshape(*lead, M // bm, N // bn)
    return NVFP4Tensor(_pack(codes), scales, s_g, shape, block)


def quantize(x, block=(1, 16), rounding="rtn", four_over_six=False, generator=None, hadamard=None, name="x"):
    """Quantize x to NVFP4 with blocks on its last two dims. rounding:
      "rtn"    nearest, ties to even (the forward);
      "sr"     stochastic (the backward's gradients), as Transformer Engine does it: unbiased for every element
               below the block max, but when a block's E4M3 scale rounds down its max lands above 6 and is
               clamped, which pulls 2-4% of the elements of 1x16 blocks toward zero (by ~2% on average);
      "sr_up"  stochastic with the block scales rounded up to E4M3, so nothing clamps: unbiased, at the cost of a
               slightly coarser grid in those blocks.
    SR draws from `generator`, else torch's global RNG of x's device (so a saved RNG state reproduces it).
    hadamard: optional (16, 16) matrix applied first along the block's 16-long dim (x H for (1, 16) blocks,
    H^T x for (16, 1)); it is how eq. 2 quantizes the wgrad operands."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"{name}: rounding must be one of {ROUNDINGS}, got {rounding!r}")
    block = tuple(block)
    if hadamard is not None and block == (16, 16):
        raise ValueError(f"{name}: a Hadamard rotation needs a 1-D block, (1, 16) or (16, 1)")
    check_blocks(x, block, name)
    if _use_kernels(x):
        seed = sr_seed(generator) if rounding in SR_MODES else 0
        parts = quant_kernels.quantize(x, block, rounding, four_over_six, seed=seed, hadamard=hadamard, name=name)
        return NVFP4Tensor(*parts, x.shape, block)
    if hadamard is not None:
        x = hadamard_transform(x.float(), hadamard, dim=-1 if block == (1, 16) else -2)
    return _quantize_reference(x, block, rounding, four_over_six, generator)


def sr_seed(generator=None):
    """The kernels' SR seed: one draw from `generator`, by default torch's global CPU RNG (which a checkpoint
    saves), so a resumed run rounds identically. A CPU draw needs no GPU->host sync; a CUDA generator works
    too but costs one sync per quantization."""
    device = generator.device if generator is not None else "cpu"
    return int(torch.randint(0, 2**31 - 1, (), generator=generator, device=device))


def fake_quantize(x, block=(1, 16), rounding="rtn", four_over_six=False, generator=None, hadamard=None, name="x"):
    """Quantize then dequantize, in x's dtype (the Hadamard rotation, if any, is not undone)."""
    return quantize(x, block, rounding, four_over_six, generator, hadamard, name).dequantize(x.dtype)


# ----------------------------------------------------------------------------------------------------------
# Random Hadamard transform (eq. 2's H_16^r)

def sylvester_hadamard(n=16, device=None):
    """The n x n Sylvester Hadamard matrix (entries +-1), built once per (n, device) and cached: every backward draws
    a random_hadamard, and building it from scratch cost a dozen tiny kernels on the GPU. Treat it as read-only."""
    device = torch.device(device) if device is not None else torch.get_default_device()
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (n, str(device))
    if key not in _SYLVESTER:
        h = torch.ones(1, 1, device=device)
        while h.shape[0] < n:
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        _SYLVESTER[key] = h
    return _SYLVESTER[key]


_SYLVESTER = {}


def random_hadamard(generator=None, device=None):
    """diag(random +-1) . H16 / 4: orthogonal, drawn fresh for every backward (eq. 2). Random signs make the
    rotation of a fixed outlier pattern different each step, so its rounding error does not repeat."""
    device = generator.device if generator is not None else device
    signs = torch.randint(0, 2, (16,), generator=generator, device=device)
    table, rows = _signed_quarter_sylvester(device)
    return table[signs, rows]                                    # row i: (-1, +1)[signs_i] * H16[i] / 4


def _signed_quarter_sylvester(device):
    """(-H16 / 4, +H16 / 4) stacked (2, 16, 16) and the row indices 0..15, cached per device: random_hadamard
    picks each row's sign by indexing (two kernels per backward instead of five)."""
    key = ("signed_quarter", str(device))
    if key not in _SYLVESTER:
        h = sylvester_hadamard(16, device) / 4.0
        _SYLVESTER[key] = (torch.stack((-h, h)), torch.arange(16, device=h.device))
    return _SYLVESTER[key]


def hadamard_transform(x, H, dim=-1):
    """x . H applied to every group of 16 consecutive elements along `dim` (for dim = -2 on a matrix this is
    H^T x, the left-multiplication of eq. 2)."""
    x = x.movedim(dim, -1)
    if x.shape[-1] % 16:
        raise ValueError(f"hadamard_transform: dim {dim} has size {x.shape[-1]}, not a multiple of 16")
    y = (x.reshape(*x.shape[:-1], -1, 16) @ H.to(x.dtype)).reshape(x.shape)
    return y.movedim(-1, dim)


# ----------------------------------------------------------------------------------------------------------
# The NVFP4 GEMM

def nvfp4_matmul(a, b, out_dtype=torch.float32, trans_a=False, trans_b=False):
    """a_hat @ b_hat^T for logical a (*, M, K) and b (N, K), both blocked along K. trans_a / trans_b: the tensor is
    stored transposed ((K, M) / (K, N), blocked along its dim -2), e.g. the forward's Q16x16(W) (out, in) used as
    the (in, out) operand of dX = dY W, without re-packing. Like a native NVFP4 GEMM: products of E2M1 values and
    block scales are accumulated in fp32 and the two global scales applied once at the end."""
    ka = (a.shape[-2], a.block[0]) if trans_a else (a.shape[-1], a.block[1])
    kb = (b.shape[-2], b.block[0]) if trans_b else (b.shape[-1], b.block[1])
    if ka[0] != kb[0] or ka[1] != 16 or kb[1] != 16:
        raise ValueError(f"nvfp4_matmul: need a (M, K), b (N, K) both blocked along K; got {tuple(a.shape)} "
                         f"{a.block} (trans_a={trans_a}) and {tuple(b.shape)} {b.block} (trans_b={trans_b})")
    if _use_kernels(a.codes):
        lead = a.shape[:-2] if not trans_a else ()
        if lead:  # fold a's leading dims into its rows: the GEMM kernels take 2-D operands
            M, K = a.shape[:-1].numel(), a.shape[-1]
            a = NVFP4Tensor(a.codes.reshape(M, K // 2), a.scales.reshape(M // a.block[0], -1), a.global_scale,
                            (M, K), a.block)
        out = nvfp4_gemm(a, b, out_dtype, trans_a, trans_b)
        return out.reshape(*lead, -1, out.shape[-1]) if lead else out
    ga, gb = a.grid_values(), b.grid_values()
    ga, gb = (ga.transpose(-1, -2) if trans_a else ga), (gb if trans_b else gb.transpose(-1, -2))
    return ((ga @ gb) * (a.global_scale * b.global_scale)).to(out_dtype)


# ----------------------------------------------------------------------------------------------------------
# Direct-NVFP4 linear layer: the three GEMMs of eqs. 1-2 without the LoRA branch

class _NVFP4LinearFn(torch.autograd.Function):
    """Y = Q1x16(X) Q16x16(W)^T (RTN), dX = Q1x16(dY) Q16x16(W) (SR, W's forward quantization reused, eq. 1),
    dW = wgrad (eq. 2). sr_rounding: the gradients' SR, "sr" or "sr_up" (quantize). On CUDA
    kernels/nvfp4_linear.py runs the same three GEMMs on the GPU's route."""

    @staticmethod
    def forward(ctx, x, weight, four_over_six, sr_rounding):
        x2 = x.reshape(-1, x.shape[-1])                                                 # (T, in)
        w = weight.detach()
        if _use_kernels(x2):
            y, xq, w_used = linear_kernels.forward(x2, w, four_over_six)
            xq = NVFP4Tensor(*xq, x2.shape, (1, 16))
        else:
            xq = quantize(x2, (1, 16), "rtn", four_over_six, name="activation X")        # Q1x16(X), RTN
            w_used = quantize(w, (16, 16), "rtn", four_over_six, name="weight W")       # Q16x16(W), RTN
            y = nvfp4_matmul(xq, w_used, out_dtype=x.dtype)                              # (T, out)
        # Save the packed 4-bit X (not X): that is where FP4 training saves activation memory.
        ctx.xq, ctx.w_used, ctx.four_over_six, ctx.x_shape = xq, w_used, four_over_six, x.shape
        ctx.sr_rounding = sr_rounding
        ctx.weight_dtype = weight.dtype
        return y.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, dy):
        xq, w_used, fos, sr = ctx.xq, ctx.w_used, ctx.four_over_six, ctx.sr_rounding
        dy2 = dy.reshape(-1, dy.shape[-1])                                              # (T, out)
        need_dx, need_dw = ctx.needs_input_grad[:2]
        if _use_kernels(dy2):
            dx, dw = linear_kernels.backward(dy2, xq, w_used, fos, *backward_draws(need_dx, need_dw, dy2.device),
                                             dw_dtype=ctx.weight_dtype, rounding=sr)
        else:
            dx = dw = None
            if need_dx:
                dyq = quantize(dy2, (1, 16), sr, fos, name="gradient dY")                 # Q1x16(dY), SR
                dx = nvfp4_matmul(dyq, w_used, dy.dtype, trans_b=True)                    # Q16x16(W) reused
            if need_dw:
                dw = wgrad(dy2, xq, fos, out_dtype=ctx.weight_dtype, rounding=sr)         # eq. 2
        ctx.xq = ctx.w_used = None
        return (dx.reshape(ctx.x_shape) if dx is not None else None), dw, None, None


def backward_draws(need_dx, need_dw, device):
    """The random draws of one backward on the kernels, in the order the reference makes them: dX's SR seed
    (None without dX), then eq. 2's fresh random Hadamard H and the SR seeds of its two operands (None without dW).
    Returns (seed_dx, H, (seed_dy, seed_x))."""
    seed_dx = sr_seed() if need_dx else None
    H = random_hadamard(device=device) if need_dw else None
    seeds_dw = (sr_seed(), sr_seed()) if need_dw else None
    return seed_dx, H, seeds_dw


def wgrad(dy, xq, four_over_six=False, hadamard=None, out_dtype=torch.float32, rounding="sr"):
    """Eq. 2: dW = Q1x16(dY^T H) . Q16x1(H^T Q1x16(X)), H a fresh random Hadamard, SR on both operands.
    dy (T, out); xq the forward's packed Q1x16(X) (T, in), dequantized in dy's dtype (bf16 in training: the
    precision the activations had) before its rotation. The rotation spreads outliers along the token
    (contraction) dim before the 16-element blocks see them; H H^T = I leaves the product unbiased.
    Both operands are quantized as stored, (T, out) and (T, in) with 16x1 blocks along T (Q16x1(H^T dY) is
    Q1x16(dY^T H) transposed), and the GEMM reads them transposed. rounding: "sr" or "sr_up" (quantize).
    Returns (out, in) in out_dtype."""
    T = dy.shape[0]
    if T % 16:
        raise ValueError(f"wgrad: the number of tokens ({T}) must be a multiple of 16 (the contraction dim of dW)")
    H = random_hadamard(device=dy.device) if hadamard is None else hadamard
    dyq = quantize(dy, (16, 1), rounding, four_over_six, hadamard=H, name="gradient dY")          # (T, out)
    xhq = quantize(xq.dequantize(dy.dtype), (16, 1), rounding, four_over_six, hadamard=H, name="activation Q(X)")
    return nvfp4_matmul(dyq, xhq, out_dtype, trans_a=True, trans_b=True)                          # (out, in)


def nvfp4_linear(x, weight, four_over_six=False, sr_rounding="sr"):
    """Y = Q1x16(X) Q16x16(W)^T with the eq. 1-2 backward (its gradients rounded by sr_rounding, "sr" or "sr_up").
    Under autocast X is cast to the autocast dtype."""
    if sr_rounding not in SR_MODES:
        raise ValueError(f"nvfp4_linear: sr_rounding must be one of {SR_MODES}, got {sr_rounding!r}")
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    return _NVFP4LinearFn.apply(x, weight, four_over_six, sr_rounding)


class NVFP4Linear(nn.Module):
    """Drop-in nn.Linear (no bias by default) whose three GEMMs run in NVFP4; the master weight stays fp32.
    sr_rounding: the backward's stochastic rounding, "sr" (Transformer Engine's) or "sr_up" (quantize)."""

    def __init__(self, in_features, out_features, bias=False, four_over_six=False, device=None, dtype=None,
                 sr_rounding="sr"):
        super().__init__()
        if in_features % 16 or out_features % 16:
            raise ValueError(f"NVFP4Linear: in_features ({in_features}) and out_features ({out_features}) "
                             "must be multiples of 16 (the 16x16 weight blocks)")
        self.in_features, self.out_features, self.four_over_six = in_features, out_features, four_over_six
        self.sr_rounding = sr_rounding
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's default

    @classmethod
    def from_linear(cls, linear, four_over_six=False, sr_rounding="sr"):
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, four_over_six,
                    device=linear.weight.device, dtype=linear.weight.dtype, sr_rounding=sr_rounding)
        with torch.no_grad():
            layer.weight.copy_(linear.weight)
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x):
        y = nvfp4_linear(x, self.weight, self.four_over_six, self.sr_rounding)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"four_over_six={self.four_over_six}, sr_rounding={self.sr_rounding}")


# ----------------------------------------------------------------------------------------------------------
# Quantization error: the paper's Rel. MSE (the project's one error measure), and App. 7's growth with the
# hidden dimension

def relative_mse(x, x_hat):
    """Rel. MSE := MSE(x - x_hat) / mean(x^2), the paper's error measure (Fig. 3)."""
    return ((x.double() - x_hat.double()).pow(2).mean() / x.double().pow(2).mean()).item()


@torch.no_grad()
def matmul_quant_error(hidden_dims=(512, 1024, 2048, 4096), rounding="rtn", tokens=256, out_features=256,
                       four_over_six=False, seed=0, device=None):
    """For each contraction length N: Y = X W^T with X (tokens, N), W (out, N) Gaussian, against
    Q1x16(X) Q16x16(W)^T. Returns rows {N, mse, rel_mse}: App. 7 predicts mse = Theta(N) (each output sums N
    independent rounding errors) while rel_mse = mse / mean(Y^2) stays flat for i.i.d. inputs."""
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    rows = []
    for n in hidden_dims:
        x = torch.randn(tokens, n, generator=g, device=device)
        w = torch.randn(out_features, n, generator=g, device=device)
        y = x @ w.t()
        xq = quantize(x, (1, 16), rounding, four_over_six, generator=g)
        wq = quantize(w, (16, 16), rounding, four_over_six, generator=g)
        y_hat = nvfp4_matmul(xq, wq)
        rows.append({"N": n, "rounding": rounding, "mse": (y_hat - y).pow(2).mean().item(),
                     "rel_mse": relative_mse(y, y_hat)})
    return rows
