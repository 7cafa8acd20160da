"""
Optimizers in NVFP4 (paper §3.3-3.4): quantized-state AdamW and the NVFP4 Root (Muon) optimizer.

§3.3, states. AdamW keeps two moments per weight; with states="nvfp4" both live in real 4-bit
storage (uint8 codes + E4M3 block scales + an fp32 global scale, nvfp4.NVFP4Tensor's layout), as
CONTRACT says:
    m (first moment)   m H16 -> NVFP4, stochastic rounding, 4/6 scaling        (unbiased, signed)
    v (second moment)  sqrt -> minus tile mean -> H16 -> NVFP4 (SR, 4/6),
                       decoded as max((s q) H16 + mu, floor mu)^2
The square root flattens v's heavy tail, the tile mean removes the large positive offset
(after it the residual is centred, so a block's 4-bit grid spends its levels on the variation, not
on the offset) and the Hadamard rotation spreads outliers over the 16 elements of a block. Squaring
the decoded root keeps v >= 0, and a floor on the decoded root (a fraction of the tile mean) keeps
every positive v away from 0, so 1/sqrt(v) never blows up (the failure of direct 4-bit v that 4-bit
Adam work reported).
states="direct" is App. 13's naive baseline: plain NVFP4 (RTN) of m and v, no rotation, no
transform.
states="fp32" keeps full-precision states (the paper's high-precision baseline).
The paper fixes neither v's rounding, nor its tile, nor a floor: CONTRACT holds our choices, made by
measurement (docs/optim.md, tools/optim_states_study.py).

§3.4, Root. Momentum, Nesterov, soft-thresholding of outliers, then Newton-Schulz
orthogonalization whose matmuls run in NVFP4 exactly as the paper's three equations (RTN + 4/6, a
fresh random Hadamard each step), with (a, b, c) coefficients specialised to the matrix shape, read
from root_coefficients.json (written by tools/fit_root_coefficients.py). The momentum buffer is
stored in two NVFP4 levels (m H16, then the first level's error; RTN, 4/6): Newton-Schulz gives
every direction of M the same weight, so one level's noise in M's weak directions became full-size
steps; the second level removes it for 0.56 more bytes/param (docs/optim.md).

build_optimizer(model, optimizer="adamw"|"root", states="fp32"|"nvfp4"|"direct", ...) routes every
parameter (Root for 2-D hidden weights, AdamW for the rest) and returns ONE object that train.py
steps.
"""

import json
import math
import os
import warnings

import torch
import torch.nn as nn

import nvfp4
from kernels.optim_fused import fused_adamw_step

STATES = ("fp32", "nvfp4", "direct")  # model.Recipe.optim_states
OPTIMIZERS = ("adamw", "root")


# --------------------------------------------------------------------------------------------------
# The precision contract of states="nvfp4" (§3.3-3.4), read at call time by the reference and the
# fused kernel. The paper fixes m's pipeline and v's transform; v's rounding, tile and floor are our
# choices (docs/optim.md).

# x H16 -> NVFP4, SR (unbiased), 4/6
_STATE = nvfp4.Quant((1, 16), "sr", "fixed", four_over_six=True)
CONTRACT = {
    "adamw.m": _STATE,                  # AdamW's m ("fp32" here or for v: both moments stay fp32)
    # (sqrt(v) - tile mean) H16; SR: RTN's repeated error lagged fp32 AdamW
    "adamw.v": _STATE,
    # elements per tile mean of sqrt(v): 4 bytes / 128 = 0.03 byte/param
    "adamw.v.tile": 128,
    "adamw.v.floor": 1 / 4,             # decoded sqrt(v) >= floor * tile mean (a power of two)
    # Root's momentum buffer: two levels (the second stores the first's error), RTN. One level of
    # any NVFP4 encoding cost Root 2-15%; Newton-Schulz turns the noise in M's weak directions into
    # full-size steps (docs/optim.md). "fp32" keeps it in full precision.
    "root.momentum": nvfp4.Quant((1, 16), "rtn", "fixed", four_over_six=True),
    "root.momentum.levels": 2,
    # §3.4's GEMMs; or "fp32"
    "newton_schulz": nvfp4.Quant((1, 16), "rtn", "random", four_over_six=True),
}


def _entry(name):
    """CONTRACT[name], checked: a Quant in 1x16 blocks (the states rotated by the fixed H16 or not
    at all, NS by a random Hadamard or not at all), or "fp32" (full precision)."""
    e = CONTRACT[name]
    if e == "fp32":
        return e
    want = "random" if name == "newton_schulz" else "fixed"
    if (not isinstance(e, nvfp4.Quant) or tuple(e.block) != (1, 16)
            or e.hadamard not in (want, "none")):
        raise ValueError(f"optim.CONTRACT[{name!r}]: expected nvfp4.Quant((1, 16), rounding, "
                         f"{want!r} or 'none', four_over_six), got {e!r}")
    return e.resolved(False)


# smaller tensors keep fp32 states (their bytes do not matter, their precision might)
MIN_QUANT_NUMEL = 4096
# Root for 2-D hidden weights with max(m,n)/min(m,n) <= 8 (the widest published coefficient set is
# 2048x16384); narrower matrices go to AdamW (§3.4 "narrow-shaped")
MAX_ROOT_ASPECT = 8.0
ROOT_SCALE = 0.2        # Moonlight's 0.2*sqrt(max(m,n)) lets Root share AdamW's lr and weight decay


# --------------------------------------------------------------------------------------------------
# The fixed 16-point Hadamard rotation of the states

def fwht16(x):
    """x . H16/4 on every group of 16 consecutive elements of the last dim (Sylvester H16,
    orthogonal and symmetric, so it is its own inverse). The same numbers as
    nvfp4.hadamard_transform(x, nvfp4.sylvester_hadamard(16) / 4) up to rounding, but computed as a
    4-stage butterfly of adds and subtracts (times an exact 1/4), whose rounding the fused kernel
    reproduces bit for bit; a 16-wide matmul sums in a library-defined order. No random signs: the
    decoder must know the rotation, and a fixed one needs no storage."""
    shape = x.shape
    y = x.reshape(-1, 16)
    for half in (8, 4, 2, 1):                         # Sylvester order: [[H, H], [H, -H]]
        y = y.reshape(-1, 16 // (2 * half), 2, half)  # (groups, pairs, 2, half)
        a, b = y[:, :, 0], y[:, :, 1]
        y = torch.stack((a + b, a - b), dim=2)
    return (y.reshape(shape) * 0.25)


def _packed(state, shape, block=(1, 16)):
    return nvfp4.NVFP4Tensor(state["codes"], state["scales"], state["global_scale"], shape, block)


def _shape(state):
    return (*state["codes"].shape[:-1], 2 * state["codes"].shape[-1])


def _as_state(t):
    return {"codes": t.codes, "scales": t.scales, "global_scale": t.global_scale}


def sqrt_rn(x):
    """Correctly rounded fp32 sqrt on every backend (this CPU build's vectorized torch.sqrt is off
    by an ulp on some inputs; the fused kernel uses tl.sqrt_rn): the fp64 root rounded once to fp32
    is correctly rounded, because fp64 carries more than 2 * 24 + 2 bits."""
    return x.double().sqrt().float()


def check_quantizable(x, name):
    """2-D, last dim a multiple of 16: what the packed states need (ValueError otherwise)."""
    if x.dim() != 2 or x.shape[-1] % 16:
        raise ValueError(f"{name}: packed optimizer states need a 2-D tensor whose last dim is a "
                         f"multiple of 16, got shape {tuple(x.shape)}")


# --------------------------------------------------------------------------------------------------
# §3.3 state encodings

def encode_first_moment(m, generator=None, seed=None, entry="adamw.m", levels=1):
    """m -> NVFP4 of m H16 as CONTRACT[entry] says (SR and 4/6 for AdamW's m). m is signed and
    roughly symmetric, so a rotation (outliers spread over the block) plus unbiased rounding is
    enough for AdamW: E[decode(encode(m))] = m, and the EMA does not drift when it is re-encoded
    every step. levels=2 (Root's momentum): the first level's error x - decode(x) is quantized again
    and stored beside it ("res_" keys), error feedback kept in the same format, 2 x 0.5625
    bytes/param. SR's seed: `seed` (level k: seed + k), else a draw from `generator`. Returns a dict
    of packed tensors."""
    check_quantizable(m, "first moment m")
    e = _entry(entry)
    if e == "fp32":
        raise ValueError(f"encode_first_moment: CONTRACT[{entry!r}] is 'fp32': nothing to encode")
    x = fwht16(m.float()) if e.hadamard == "fixed" else m.float()
    state = {}
    for level in range(levels):
        t = nvfp4.quantize(x, e.block, e.rounding, e.four_over_six, generator=generator,
                           name=f"{entry} (H16)", seed=None if seed is None else seed + level)
        state.update({("res_" if level else "") + k: v for k, v in _as_state(t).items()})
        x = x - t.dequantize() if level + 1 < levels else x
    return state


def decode_first_moment(state, entry="adamw.m"):
    x = _packed(state, _shape(state)).dequantize()
    second = {k[len("res_"):]: v for k, v in state.items() if k.startswith("res_")}
    if second:  # the second level: the first one's error
        x = x + _packed(second, _shape(state)).dequantize()
    return fwht16(x) if _entry(entry).hadamard == "fixed" else x  # (s q) H16, H16 = H16^-1


def _tile(n, tile):
    """Tile length along the last dim: gcd(n, tile), a power of two >= 16 whenever n % 16 == 0 and
    tile is a power of two; e.g. 128 for every hidden size of our configs."""
    return math.gcd(n, tile)


def tile_mean(s, tile):
    """Mean over tiles of `tile` consecutive elements of the last dim, summed as a pairwise tree
    (halves added elementwise) so that the fused kernel reproduces it bit for bit; 1/tile is a power
    of two (exact)."""
    R, C = s.shape
    x = s.reshape(R, C // tile, tile)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0] * (1.0 / tile)  # (R, C // tile)


def encode_second_moment(v, tile=None, rounding=None, generator=None, seed=None):
    """§3.3's pipeline: 1) r = sqrt(v); 2) r -= mean over its tile; 3) r H16; 4) NVFP4 (4/6
    scaling).

    Stochastic rounding (the paper does not say which). RTN has the lower error per encoding
    (at most half a grid step against up to a full one), but v is re-encoded every step, and RTN's
    error is deterministic: an entry whose root sits between grid points is pulled the same way step
    after step, so its 1/sqrt(v) stays off in one direction for as long as its neighbours keep the
    grid where it is. SR's error averages out over the EMA. In training that decided it
    (tools/optim_states_study.py, docs/optim.md). tile and rounding default to CONTRACT's
    entries."""
    check_quantizable(v, "second moment v")
    e = _entry("adamw.v")
    tile = CONTRACT["adamw.v.tile"] if tile is None else tile
    rounding = e.rounding if rounding is None else rounding
    if not (v >= 0).all():
        raise ValueError("second moment v: has negative entries (v is a running mean of g^2)")
    tile = _tile(v.shape[-1], tile)
    r = sqrt_rn(v.float())                                            # (R, C)
    mu = tile_mean(r, tile)                                           # (R, C // tile) fp32
    r = (r.reshape(*mu.shape, tile) - mu[..., None]).reshape(v.shape)
    t = nvfp4.quantize(fwht16(r) if e.hadamard == "fixed" else r, (1, 16), rounding,
                       e.four_over_six, generator=generator, seed=seed,
                       name="second moment (sqrt(v) - mu) H")
    return {**_as_state(t), "tile_mean": mu}


def decode_second_moment(state, floor=None):
    """v_hat = max((s q) H16 + mu, floor * mu)^2.

    Squaring makes v_hat >= 0 whatever the rounding did. The floor: a positive v makes its tile mean
    mu > 0, so its decoded root is >= mu / 4 > 0 and v_hat > 0 (for v >= ~1e-36: below that fp32's
    square underflows; Adam's eps = 1e-8 in the denominator dominates long before). An all-zero tile
    has mu = 0 and decodes to exactly 0. The floor only acts on entries far below their tile's
    typical size (where the 4-bit residual error exceeds 3/4 of the tile mean); raising their
    denominator shrinks their update (safe), while a denominator near 0 would multiply it without
    bound. 1/4 gave the lowest error of the Adam update m/sqrt(v) among 1/32, 1/8, 1/4, 1/2 on
    synthetic heavy-tailed v (row/column log-normal scales): see docs/optim.md."""
    floor = CONTRACT["adamw.v.floor"] if floor is None else floor
    mu = state["tile_mean"]                                           # (R, C // tile)
    shape = _shape(state)
    tile = shape[-1] // mu.shape[-1]
    r = _packed(state, shape).dequantize()
    r = fwht16(r) if _entry("adamw.v").hadamard == "fixed" else r
    r = r.reshape(*mu.shape, tile) + mu[..., None]
    r = torch.maximum(r, mu[..., None] * floor)
    return (r * r).reshape(shape)


def encode_direct(x):
    """App. 13's naive baseline (`naive_fp4` recipe): plain NVFP4 of the state, RTN, no rotation, no
    4/6, no transform. A positive v below a quarter of its block's grid step decodes to exactly
    0."""
    check_quantizable(x, "optimizer state")
    return _as_state(nvfp4.quantize(x.float(), (1, 16), "rtn", name="optimizer state (direct)"))


def decode_direct(state):
    return _packed(state, _shape(state)).dequantize()


ENCODERS = {  # states -> (encode m, decode m, encode v, decode v)
    "nvfp4": (encode_first_moment, decode_first_moment, encode_second_moment, decode_second_moment),
    "direct": (lambda m, seed=None: encode_direct(m), decode_direct,
               lambda v, seed=None: encode_direct(v), decode_direct),
}


def _prefixed(state, prefix):
    return {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}


def _store(state, prefix, encoded):
    for k, v in encoded.items():
        state[f"{prefix}.{k}"] = v


# --------------------------------------------------------------------------------------------------
# FSDP2 / DTensor helpers: QuantizedAdamW works on each rank's local shard; Root gathers the full
# matrix

def _is_dtensor(t):
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return False
    return isinstance(t, DTensor)


def _local(t):
    return t.to_local() if _is_dtensor(t) else t


def _generator(gens, device, seed, use="sr"):
    """One torch.Generator per use ("sr": stochastic rounding of the states, "ns": Root's Hadamard
    signs) and device, seeded once; saved in state_dict so a resumed run draws the same random
    numbers. Separate uses keep the NS draws independent of how many elements a rank's shard rounds
    (identical on every FSDP rank)."""
    key = f"{use}/{device}"
    if key not in gens:
        gens[key] = torch.Generator(device=device).manual_seed(seed)
    return gens[key]


class _StateMixin:
    """state_dict / load_state_dict that keep packed states bit-exact and carry the generators'
    states."""

    def state_dict(self):
        sd = super().state_dict()
        sd["generator_states"] = {k: g.get_state() for k, g in self._generators.items()}
        return sd

    def load_state_dict(self, state_dict):
        state_dict = dict(state_dict)
        gen_states = state_dict.pop("generator_states", {})
        super().load_state_dict(state_dict)
        # torch.optim casts every floating-point state tensor to its parameter's dtype
        # (and would turn uint8 codes into floats): put back exact copies of the saved tensors,
        # dtype and bits unchanged.
        params = [p for group in self.param_groups for p in group["params"]]
        for index, saved in state_dict["state"].items():
            p = params[index]
            for key, value in saved.items():
                if torch.is_tensor(value) and key != "step":
                    self.state[p][key] = value.to(device=_local(p).device, copy=True)
        for key, g_state in gen_states.items():
            use, device = key.split("/")
            g = _generator(self._generators, torch.device(device), self.seed, use)
            g.set_state(g_state.cpu())  # a checkpoint loaded onto the GPU moved it there

    def state_nbytes(self):
        """Bytes held in optimizer state (packed codes, scales, global scales, tile means, fp32
        states, steps)."""
        return sum(v.nbytes for st in self.state.values() for v in st.values()
                   if torch.is_tensor(v))

    def reset_state(self, param):
        """Forget param's state (it restarts from zero moments and step 0): LoRA-SVD realignment."""
        self.state.pop(param, None)


# --------------------------------------------------------------------------------------------------
# §3.3 Quantized-state AdamW

def _adamw_fp32(p, g, state, lr, beta1, beta2, eps, weight_decay):
    """torch.optim.AdamW's single-tensor update, op for op (so that it matches it bit for bit)."""
    if "exp_avg" not in state:
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    m, v = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    step = state["step"].item()
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
    p.addcdiv_(m, denom, value=-lr / bias_correction1)


def adamw_update_math(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step):
    """The AdamW arithmetic of the quantized path, one elementwise op at a time in fp32
    (the fused kernel does the same ops in the same order). Returns new (p, m, v)."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * (g * g)
    denom = sqrt_rn(v) / bias_correction2_sqrt + eps
    p = p - (lr / bias_correction1) * (m / denom)
    return p, m, v


class QuantizedAdamW(_StateMixin, torch.optim.Optimizer):
    """AdamW (decoupled weight decay) whose moments are stored in NVFP4 (§3.3).

    states: "nvfp4" (§3.3: m rotated + SR + 4/6; v through sqrt/tile-mean/Hadamard, SR + 4/6) or
    "direct" (App. 13's naive baseline: plain NVFP4 of m and v). Full-precision states are
    torch.optim.AdamW's (build_optimizer's "fp32"); CONTRACT "fp32" for adamw.m or adamw.v keeps
    fp32 states here, updated as torch.optim.AdamW does, bit for bit.

    Which tensors get packed states: 2-D tensors with >= 4096 elements whose last dim is a multiple
    of 16 (under FSDP2: the rank's local shard must be). Everything else keeps fp32 states: norms
    and biases (1-D), tensors of other ndim, small ones (< 4096 elements: their bytes do not matter)
    and rows not made of 16-blocks.

    Packed state per tensor (R, C): m and v codes (R, C/2) uint8 + E4M3 scales (R, C/16) + fp32
    global scales, plus v's fp32 tile means (R, C/128): 1/2 + 1/2 + 2/16 + 4/128 = 1.156 bytes/param;
    a run's printed total (1.17) adds the global scales and the small tensors' fp32 states
    (torchao's AdamW4bit: ~1.06; fp32 AdamW: 8).
    On CUDA the "nvfp4" update runs in the fused Triton kernel (kernels/optim_fused.py): an amax
    pre-pass, then one pass that decodes, updates, writes the parameter and re-encodes.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                 states="nvfp4", seed=0):
        if states not in ENCODERS:
            raise ValueError(f"QuantizedAdamW: states must be one of {', '.join(ENCODERS)}; "
                             f"got {states!r}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.states, self.seed = states, seed
        self._generators, self._warned = {}, set()

    def _quantized(self, p):
        local = _local(p)
        ok = local.dim() == 2 and local.numel() >= MIN_QUANT_NUMEL and local.shape[-1] % 16 == 0
        if not ok and local is not p and p.dim() == 2 \
                and p.shape[-1] % 16 == 0 and p.numel() >= MIN_QUANT_NUMEL \
                and id(p) not in self._warned:
            self._warned.add(id(p))
            warnings.warn(f"QuantizedAdamW: local shard {tuple(local.shape)} of a "
                          f"{tuple(p.shape)} parameter does not fit 16-element blocks / the size "
                          "threshold: fp32 states for it")
        return ok and "fp32" not in (CONTRACT["adamw.m"], CONTRACT["adamw.v"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = (group["lr"], group["betas"], group["eps"],
                                           group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError("QuantizedAdamW: sparse gradients are not supported")
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                if not self._quantized(p):
                    _adamw_fp32(p, p.grad, state, lr, beta1, beta2, eps, wd)
                    continue
                self._step_packed(_local(p), _local(p.grad), state, lr, beta1, beta2, eps, wd)
        return loss

    def _step_packed(self, p, g, state, lr, beta1, beta2, eps, wd):
        enc_m, dec_m, enc_v, dec_v = ENCODERS[self.states]
        if "m.codes" not in state:  # zero moments, encoded (all-zero blocks: zero scales and codes)
            zeros = torch.zeros(p.shape, device=p.device)
            _store(state, "m", enc_m(zeros, seed=0))
            _store(state, "v", enc_v(zeros, seed=0))
        state["step"] += 1
        step = state["step"].item()
        # SR seeds for m and v, drawn on p's device (no host sync; resumable), the same on either
        # route
        seed_m, seed_v = _seeds(self._generators, self.seed, 2, p.device)
        if self.states == "nvfp4" and nvfp4.use_kernels(p) and self._fused(p):
            fused_adamw_step(p, g, state, lr, beta1, beta2, eps, wd, step, seed_m, seed_v,
                             CONTRACT["adamw.v.floor"], CONTRACT["adamw.m"].rounding,
                             CONTRACT["adamw.v"].rounding)
            return
        m, v = dec_m(_prefixed(state, "m")), dec_v(_prefixed(state, "v"))
        p_new, m, v = adamw_update_math(p.float(), g.float(), m, v, lr, beta1, beta2, eps, wd, step)
        p.copy_(p_new)
        _store(state, "m", enc_m(m, seed=seed_m))
        _store(state, "v", enc_v(v, seed=seed_v))

    def _fused(self, p):
        """Does the fused kernel implement CONTRACT for p? (It rotates both states by H16 and uses
        4/6; any rounding, tile and floor.) If not, the reference runs on the GPU too, and says so
        once."""
        fits = all(_entry(k).hadamard == "fixed" and _entry(k).four_over_six
                   for k in ("adamw.m", "adamw.v"))
        if not fits and "contract" not in self._warned:
            self._warned.add("contract")
            warnings.warn("QuantizedAdamW: the fused kernel implements adamw.m / adamw.v with "
                          "hadamard 'fixed' and 4/6 only; running optim.py's reference for this "
                          "CONTRACT")
        return fits and p.dtype == torch.float32 and p.is_contiguous()


def _seeds(gens, seed, n, device):
    """n SR seeds, an int64 tensor on `device` drawn there by the optimizer's saved "sr" generator:
    no host int, so a captured step would replay fresh seeds (nvfp4.sr_seed)."""
    return torch.randint(0, 2**31 - 1, (n,), generator=_generator(gens, device, seed, "sr"),
                         device=device)


# --------------------------------------------------------------------------------------------------
# §3.4 Newton-Schulz: fp32 reference and the NVFP4 iteration

MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
PUBLISHED_COEFFICIENTS = {  # ROOT (arXiv 2511.20626), keyed by (min dim, max dim)
    (2048, 2048): (3.4916, -4.8224, 2.1095),
    (2048, 3072): (3.4509, -4.5790, 1.9325),
    (2048, 8192): (2.9794, -3.6674, 1.6207),
    (2048, 16384): (3.1943, -3.8221, 1.5322),
}
COEFFICIENTS_JSON = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                 "root_coefficients.json")
# fit_coefficients(64, 128), if the JSON is missing
NVFP4_FALLBACK_COEFFICIENTS = (2.2255, -1.8246, 0.5915)
# X0 = B/||B||_F has singular values <= 1; 10% margin for quantization noise
STABILITY_SIGMA_MAX = 1.1
STABILITY_BOUND = 1.5


def coefficients_stable(coefficients, steps=5, sigma_max=STABILITY_SIGMA_MAX,
                        bound=STABILITY_BOUND):
    """Does the scalar map p(s) = a s + b s^3 + c s^5, iterated `steps` times, keep every singular
    value in [0, sigma_max] below `bound`? NS applies p to each singular value, so an overshoot here
    is an overshoot of the update's spectral norm. The published 2048x2048 set fails: s0 ~ 0.56 ->
    1.22, 1.23, 1.25, 1.42, 3.31."""
    a, b, c = coefficients
    s = torch.linspace(0, sigma_max, 4001, dtype=torch.float64)
    for _ in range(steps):
        s = a * s + b * s**3 + c * s**5
        if not torch.isfinite(s).all() or s.abs().max() >= bound:
            return False
    return True


_fitted_cache = {}


def _fitted():
    if "sets" not in _fitted_cache:
        sets = {}
        if os.path.exists(COEFFICIENTS_JSON):
            with open(COEFFICIENTS_JSON) as f:
                for key, entry in json.load(f)["coefficients"].items():
                    m, n = (int(d) for d in key.split("x"))
                    sets[(m, n)] = tuple(entry["abc"])
        _fitted_cache["sets"] = sets
    return _fitted_cache["sets"]


def root_coefficients(m, n, quantized=True):
    """(a, b, c) for an m x n matrix, keyed by (min dim, max dim) (NS runs on the wide orientation).
    quantized (NVFP4 NS): our set fitted for that shape (root_coefficients.json), else the fitted
    set of the nearest aspect ratio: Muon's and ROOT's published sets amplify 4-bit rounding noise
    until the iteration explodes (see fig4b_numbers). fp32 NS: ROOT's published set if it passes
    coefficients_stable, else Muon's."""
    key = (min(m, n), max(m, n))
    fitted = _fitted()
    if quantized:
        if key in fitted:
            return fitted[key]
        if not fitted:  # no JSON: a set fitted once for 64x128, never Muon's (it explodes in NVFP4)
            return NVFP4_FALLBACK_COEFFICIENTS
        aspect = math.log(key[1] / key[0])
        return fitted[min(fitted, key=lambda k: (abs(math.log(k[1] / k[0]) - aspect),
                                                 abs(k[0] - key[0])))]
    if key in PUBLISHED_COEFFICIENTS and coefficients_stable(PUBLISHED_COEFFICIENTS[key]):
        return PUBLISHED_COEFFICIENTS[key]
    return MUON_COEFFICIENTS


def _ns_step_nvfp4(X, a, b, c, H):
    """One NS step in NVFP4, §3.4's three equations, X (m, n) with m <= n:
        qX = Q1x16(X H),  A = qX qX^T
        qA = Q1x16(A H),  qA' = Q16x1(H^T A),  B = b A + c qA qA'
        qB = Q1x16(B H),  qX' = Q16x1(H^T X),  X_next = a X + qB qX'
    every quantization as CONTRACT["newton_schulz"] says (RTN + 4/6 with one fresh random Hadamard H
    per step: H H^T = I, so each product is unbiased in the rotation). The NT GEMM takes both
    operands blocked along K; a 16x1 quantization of Y is the 1x16 quantization of Y^T
    (same blocks, same amax), so Q16x1(H^T Y) enters as Q1x16(Y^T H)."""
    e = _entry("newton_schulz")
    q = lambda t, name: nvfp4.quantize(t, (1, 16), e.rounding, e.four_over_six, name=name,
                                       hadamard=H if e.hadamard == "random" else None)
    qX = q(X, "NS X")                                      # (m, n) blocked along n
    A = nvfp4.nvfp4_matmul(qX, qX)                         # (m, m) fp32
    qA, qA_t = q(A, "NS A"), q(A.t(), "NS A^T")            # (m, m), both blocked along K
    B = b * A + c * nvfp4.nvfp4_matmul(qA, qA_t)           # (m, m)
    qB, qX_t = q(B, "NS B"), q(X.t(), "NS X^T")            # (m, m) and (n, m)
    return a * X + nvfp4.nvfp4_matmul(qB, qX_t)            # (m, n)


def newton_schulz(G, steps=5, coefficients=None, quantized=True, generator=None, hadamards=None):
    """Orthogonalize G (m, n): X0 = G / (||G||_F + 1e-7), then `steps` of X <- a X + (b A + c A^2)
    X, A = X X^T, on the wide orientation (transposed if m > n). quantized: every matmul in NVFP4
    (§3.4, nvfp4.nvfp4_matmul: the Triton GEMM on CUDA); else in G's dtype (fp32 for Root, bf16 for
    the Muon reference).
    coefficients default to root_coefficients(m, n). The per-step random Hadamards are drawn from
    `generator` (all `steps` of them up front), or given as `hadamards` (a list, as Root's CUDA
    graph passes them)."""
    if G.dim() != 2:
        raise ValueError(f"newton_schulz: G must be 2-D, got shape {tuple(G.shape)}")
    if quantized and (G.shape[0] % 16 or G.shape[1] % 16):
        raise ValueError(f"newton_schulz: NVFP4 NS needs both dims multiples of 16, "
                         f"got {tuple(G.shape)}")
    a, b, c = coefficients or root_coefficients(*G.shape, quantized=quantized)
    X = G.float() if quantized else G
    transposed = X.shape[0] > X.shape[1]
    if transposed:
        X = X.t()
    X = X / (X.norm() + 1e-7)
    if quantized and hadamards is None:
        hadamards = [nvfp4.random_hadamard(generator, device=X.device) for _ in range(steps)]
    for i in range(steps):
        if quantized:
            X = _ns_step_nvfp4(X, a, b, c, hadamards[i])
        else:
            A = X @ X.t()
            X = a * X + (b * A + c * (A @ A)) @ X
    return X.t() if transposed else X


def quantile(x, q):
    """torch.quantile(x, q) (linear interpolation) without its input-size limit: kthvalue on the
    CPU, a sort on CUDA."""
    flat = x.reshape(-1)
    pos = q * (flat.numel() - 1)
    lo = math.floor(pos)
    if flat.is_cuda:  # one sort: CUDA's kthvalue on one large slice is many times slower
        ordered = flat.sort().values
        v_lo, v_hi = ordered[lo], ordered[min(lo + 1, flat.numel() - 1)]
    else:
        v_lo = flat.kthvalue(lo + 1).values
        if pos == lo:
            return v_lo
        v_hi = flat.kthvalue(lo + 2).values
    return v_lo + (v_hi - v_lo) * (pos - lo)


def root_direction(M, threshold_quantile=0.9, steps=5, quantized=True, hadamards=None,
                   generator=None):
    """Root's update direction: NS5 of M soft-thresholded at its quantile (outliers clipped,
    §3.4)."""
    eps = quantile(M.abs(), threshold_quantile)
    return newton_schulz(M.clamp(-eps, eps), steps, quantized=quantized, generator=generator,
                         hadamards=hadamards)


class _CapturedDirection:
    """root_direction for one matrix shape as a CUDA graph, replayed every step. The NVFP4 NS is
    ~130 small kernels (5 quantizations and 3 GEMMs per step, each with its amax pass and scale
    arithmetic): at toy and 1B sizes the Python launch overhead, not the math, sets its time
    (docs/optim.md).
    The random Hadamards are drawn outside and copied in; the kernels, the GEMM routes and every
    rounding are those of the eager call (tests/test_optim.py::test_gpu_root_cuda_graph_equals_eager
    checks bit equality)."""

    def __init__(self, M, threshold_quantile, steps):
        self.M = M.detach().clone()
        # placeholder rotations for the capture, no RNG draw (a draw here would shift a resumed
        # run's streams)
        self.H = (nvfp4.sylvester_hadamard(16, M.device) / 4).expand(steps, 16, 16).contiguous()
        run = lambda: root_direction(self.M, threshold_quantile, steps, True,
                                     list(self.H.unbind(0)))
        run()  # compile the kernels outside the capture
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.X = run()

    def __call__(self, M, hadamards):
        self.M.copy_(M)
        self.H.copy_(torch.stack(hadamards))
        self.graph.replay()
        return self.X  # a static buffer: overwritten by the next replay of this shape


# --------------------------------------------------------------------------------------------------
# §3.4 Root

class Root(_StateMixin, torch.optim.Optimizer):
    """ROOT (arXiv 2511.20626) for 2-D hidden weights, with NVFP4 momentum and NVFP4 Newton-Schulz
    (§3.4):

        buf = mu buf + g;  M = g + mu buf                      (Nesterov)
        eps = 0.9-quantile of |M|;  B = clip(M, -eps, eps)     (soft threshold: outliers M - B
                                                               are dropped)
        X = NS5(B)  (transposed if rows > cols, X0 = B / (||B||_F + 1e-7), shape-specific (a, b, c))
        p <- p (1 - lr wd) - lr * 0.2 sqrt(max(m, n)) X

    states="nvfp4": buf stored as CONTRACT["root.momentum"] says (H16, two NVFP4 levels, RTN, 4/6;
    the module docstring says why) and NS in NVFP4; "direct": buf in plain NVFP4 (App. 13's naive
    baseline), NS in NVFP4; "fp32": fp32 momentum and fp32 NS (the paper's high-precision
    baseline).
    Under FSDP2 each rank keeps its shard's momentum, gathers the full M (full_tensor(): an
    all-gather of m*n fp32 per matrix per step) and every rank runs the same NS on it (compute
    repeated world-size times; the Hadamard generator is seeded identically everywhere), then keeps
    its own shard of X: simple, and the cost is small next to the forward/backward for our matrix
    sizes.
    """

    def __init__(self, params, lr=1e-3, momentum=0.95, weight_decay=0.1, states="nvfp4", ns_steps=5,
                 threshold_quantile=0.9, seed=0):
        if states not in STATES:
            raise ValueError(f"Root: states must be one of {', '.join(STATES)}; got {states!r}")
        # NVFP4 states come with the NVFP4 NS (§3.4), unless CONTRACT says fp32
        quantized = states != "fp32"
        defaults = dict(lr=lr, momentum=momentum, weight_decay=weight_decay)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() != 2:
                    raise ValueError(f"Root: parameters must be 2-D matrices, "
                                     f"got shape {tuple(p.shape)}")
                if quantized and (p.shape[0] % 16 or p.shape[1] % 16):
                    raise ValueError(f"Root: NVFP4 NS needs both dims multiples of 16, "
                                     f"got {tuple(p.shape)}")
        self.states, self.ns_steps = states, ns_steps
        self.threshold_quantile, self.seed = threshold_quantile, seed
        # NVFP4 NS on CUDA replayed from one captured graph per shape (False after a failed capture)
        self.cuda_graphs = True
        self._generators, self._graphs = {}, {}

    @property
    def quantized(self):
        """NVFP4 Newton-Schulz: NVFP4 states (or the direct baseline) and CONTRACT["newton_schulz"]
        not fp32."""
        return self.states != "fp32" and _entry("newton_schulz") != "fp32"

    def _momentum(self, g, state, mu):
        """buf <- mu buf + g (stored packed or fp32); returns the Nesterov M = g + mu buf."""
        packed = self.states != "fp32" and _entry("root.momentum") != "fp32" and g.dim() == 2 \
            and g.shape[-1] % 16 == 0 and g.numel() > 0
        if not packed:
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(g, dtype=torch.float32)
            buf = state["momentum_buffer"]
            buf.mul_(mu).add_(g)
            return g.float().add(buf, alpha=mu)
        if self.states == "direct":
            enc, dec = (lambda x, seed: encode_direct(x)), decode_direct
        else:
            enc = lambda x, seed: encode_first_moment(x, seed=seed, entry="root.momentum",
                                                      levels=CONTRACT["root.momentum.levels"])
            dec = lambda st: decode_first_moment(st, entry="root.momentum")
        buf = (dec(_prefixed(state, "m")) if "m.codes" in state
               else torch.zeros(g.shape, device=g.device))
        buf = mu * buf + g.float()
        _store(state, "m", enc(buf, _seeds(self._generators, self.seed, 1, g.device)[0]))
        return g.float() + mu * buf

    def _direction(self, M, gen):
        """root_direction(M); the NVFP4 NS on CUDA through a captured graph per (shape, device)."""
        if not (self.quantized and self.cuda_graphs and M.is_cuda):
            return root_direction(M, self.threshold_quantile, self.ns_steps, self.quantized,
                                  generator=gen)
        # the eager call's draws
        hadamards = [nvfp4.random_hadamard(gen) for _ in range(self.ns_steps)]
        key = (tuple(M.shape), M.device)
        if key not in self._graphs:
            try:
                self._graphs[key] = _CapturedDirection(M, self.threshold_quantile, self.ns_steps)
            # a capture failure must not stop a long run: eager from here on, once said
            except RuntimeError as e:
                warnings.warn(f"Root: CUDA graph capture failed ({e}); "
                              "running the NVFP4 NS eagerly")
                self.cuda_graphs = False
                return root_direction(M, self.threshold_quantile, self.ns_steps, True, hadamards)
        return self._graphs[key](M, hadamards)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "step" not in state:
                    state["step"] = torch.tensor(0.0)
                state["step"] += 1
                local, g = _local(p), _local(p.grad)
                M = self._momentum(g, state, mu)
                if _is_dtensor(p):  # FSDP2: NS needs the whole matrix
                    from torch.distributed.tensor import DTensor
                    M = DTensor.from_local(M, p.device_mesh, p.placements, shape=p.shape,
                                           stride=p.stride()).full_tensor()
                X = self._direction(M, _generator(self._generators, M.device, self.seed, "ns"))
                if _is_dtensor(p):
                    from torch.distributed.tensor import distribute_tensor
                    X = distribute_tensor(X, p.device_mesh, p.placements,
                                          src_data_rank=None).to_local()
                local.mul_(1 - lr * wd)
                local.add_(X.to(local.dtype), alpha=-lr * ROOT_SCALE * math.sqrt(max(p.shape)))
        return loss


# --------------------------------------------------------------------------------------------------
# build_optimizer: route every parameter, one object for train.py

def lora_factors(model):
    """The LoRA branch factors of every module that carries one: by duck typing, a module with L1
    and L2 parameters (lora_svd.LoRASVDLinear's principal part, lora_svd.NaiveLoRALinear's
    branch)."""
    ids = set()
    for module in model.modules():
        L1, L2 = getattr(module, "L1", None), getattr(module, "L2", None)
        if isinstance(L1, nn.Parameter) and isinstance(L2, nn.Parameter):
            ids |= {id(L1), id(L2)}
    return ids


def route_parameters(model, optimizer="root", max_aspect=MAX_ROOT_ASPECT):
    """{"root": [...], "adamw": [...], "adamw_no_decay": [...], "lora": [...]} lists of
    (name, param).

    Per §3.4: Root takes 2-D hidden weights (block linears, LoRA-SVD's weight_res, naive LoRA's
    main weight) whose aspect ratio is <= max_aspect and whose dims are multiples of 16; AdamW takes
    embeddings, lm_head (by type nn.Embedding / by the name "lm_head"), narrow matrices, and LoRA
    L1/L2 (group "lora", own lr); norms and biases (1-D) go to AdamW without weight decay. With
    optimizer="adamw" Root's share goes to AdamW."""
    lora_ids = lora_factors(model)
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    routes = {"root": [], "adamw": [], "adamw_no_decay": [], "lora": []}
    for name, p in model.named_parameters():  # tied weights are listed once
        if not p.requires_grad:
            continue
        if id(p) in lora_ids:
            routes["lora"].append((name, p))
        elif p.dim() < 2:
            routes["adamw_no_decay"].append((name, p))
        elif (optimizer == "root" and p.dim() == 2 and id(p) not in embedding_ids
              and "lm_head" not in name and max(p.shape) <= max_aspect * min(p.shape)
              and p.shape[0] % 16 == 0 and p.shape[1] % 16 == 0):
            routes["root"].append((name, p))
        else:
            routes["adamw"].append((name, p))
    return routes


class CombinedOptimizer:
    """The one optimizer object train.py steps: a Root and/or an AdamW over disjoint parameters.
    param_groups lists every inner group (each with its base_lr), so a schedule that writes
    group["lr"] reaches all of them. (LoRA-SVD's eqs. 3-4, which §3.2 defers to the optimizer
    step, train.py runs just before it: lora_svd.project_all, then clipping, then step().)"""

    def __init__(self, optimizers):
        self.optimizers = optimizers

    def __repr__(self):
        def describe(opt):
            n = sum(len(g["params"]) for g in opt.param_groups)
            if isinstance(opt, Root):
                return (f"Root({opt.states} momentum, "
                        f"{'NVFP4' if opt.quantized else 'fp32'} NS) on {n} matrices")
            states = opt.states if isinstance(opt, QuantizedAdamW) else "fp32"
            return f"AdamW({states} states) on {n} tensors"
        return " + ".join(describe(opt) for opt in self.optimizers)

    @property
    def param_groups(self):
        return [g for opt in self.optimizers for g in opt.param_groups]

    @property
    def state(self):
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    @torch.no_grad()
    def step(self):
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none=True):
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [opt.state_dict() for opt in self.optimizers]}

    def load_state_dict(self, state_dict):
        if len(state_dict["optimizers"]) != len(self.optimizers):
            raise ValueError(f"load_state_dict: checkpoint has {len(state_dict['optimizers'])} "
                             f"optimizers, this one {len(self.optimizers)} "
                             f"(different --optimizer or --recipe?)")
        for opt, sd in zip(self.optimizers, state_dict["optimizers"]):
            opt.load_state_dict(sd)

    def state_nbytes(self):
        return sum(opt.state_nbytes() if hasattr(opt, "state_nbytes") else
                   sum(v.nbytes for st in opt.state.values() for v in st.values()
                       if torch.is_tensor(v))
                   for opt in self.optimizers)

    def reset_state(self, param):
        for opt in self.optimizers:
            opt.state.pop(param, None)


def build_optimizer(model, optimizer="adamw", states="fp32", lr=1e-3, lora_lr=None,
                    weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8, momentum=0.95):
    """optimizer: "adamw" (AdamW for everything) or "root" (Root for 2-D hidden weights, AdamW for
    the rest).
    states (model.Recipe.optim_states): "fp32" (plain torch.optim.AdamW, fused on CUDA, and an fp32
    Root: the paper's baseline), "nvfp4" (§3.3 states + §3.4's NVFP4 NS: fullstack) or "direct"
    (App. 13's naive_fp4).
    lora_lr: LoRA L1/L2 learning rate (default lr). Every param group carries base_lr for the
    schedule."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"build_optimizer: optimizer must be one of {', '.join(OPTIMIZERS)}; "
                         f"got {optimizer!r}")
    if states not in STATES:
        raise ValueError(f"build_optimizer: states must be one of {', '.join(STATES)}; "
                         f"got {states!r}")
    routes = route_parameters(model, optimizer)
    lora_lr = lr if lora_lr is None else lora_lr
    groups = [dict(params=[p for _, p in routes[key]], lr=group_lr, base_lr=group_lr,
                   weight_decay=group_wd)
              for key, group_lr, group_wd in (("adamw", lr, weight_decay),
                                              ("adamw_no_decay", lr, 0.0),
                                              ("lora", lora_lr, weight_decay)) if routes[key]]
    optimizers = []
    if groups:
        if states == "fp32":
            fused = all(p.is_cuda for g in groups for p in g["params"])
            optimizers.append(torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps,
                                                fused=fused or None))
        else:
            optimizers.append(QuantizedAdamW(groups, lr=lr, betas=betas, eps=eps, states=states))
    if routes["root"]:
        root_groups = [dict(params=[p for _, p in routes["root"]], lr=lr, base_lr=lr,
                            weight_decay=weight_decay)]
        optimizers.append(Root(root_groups, lr=lr, momentum=momentum, states=states))
    return CombinedOptimizer(optimizers)
