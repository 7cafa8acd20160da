"""Triton NVFP4 kernels (kernels/nvfp4_quant.py, nvfp4_gemm.py, nvfp4_linear.py) against the
reference nvfp4.py.

On CPU the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1), so shapes are
small.
The @pytest.mark.gpu tests repeat the checks at full size on the H200:
    pytest -m gpu tests/test_kernels_nvfp4.py
"""

import os

import pytest
import torch
import triton
import triton.language as tl

import nvfp4
from kernels import nvfp4_dequant as kd
from kernels import nvfp4_gemm as kg
from kernels import nvfp4_linear as kl
from kernels import nvfp4_math as nm
from kernels import nvfp4_quant as kq
from oracles import transposed

BLOCKS = [(1, 16), (16, 1), (16, 16)]
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _heavy_tailed(shape, generator, dtype=torch.float32, device="cpu"):
    """Gaussian times a log-normal spread (outliers, tiny blocks), with an all-zero block and a
    block so small that its E4M3 scale is subnormal or zero."""
    x = (torch.randn(shape, generator=generator)
         * torch.exp(1.5 * torch.randn(shape, generator=generator)))
    x[..., :16, :16] = 0.0
    x[..., 16:32, 16:32] *= 1e-7
    return x.to(device=device, dtype=dtype)


def kquantize(x, block=(1, 16), *args, **kwargs):
    """The quantize kernel's (codes, scales, global_scale) as an NVFP4Tensor, as nvfp4.quantize
    wraps them."""
    return nvfp4.NVFP4Tensor(*kq.quantize(x, block, *args, **kwargs), x.shape, block)


def kdequantize(t, dtype):
    return kd.dequantize(t.codes, t.scales, t.global_scale, t.shape, t.block, dtype)


def _same(k, r):
    """Kernel NVFP4Tensor == reference NVFP4Tensor, bit for bit."""
    assert k.shape == r.shape and k.block == r.block
    assert k.codes.dtype == torch.uint8 and k.scales.dtype == torch.float8_e4m3fn
    assert torch.equal(k.global_scale.cpu(), r.global_scale.cpu()), (k.global_scale, r.global_scale)
    sk, sr = k.scales.view(torch.uint8).cpu(), r.scales.view(torch.uint8).cpu()
    assert torch.equal(sk, sr), f"{(sk != sr).sum().item()} of {sr.numel()} scales differ"
    ck, cr = k.codes.cpu(), r.codes.cpu()
    assert torch.equal(ck, cr), f"{(ck != cr).sum().item()} of {cr.numel()} code bytes differ"


# --------------------------------------------------------------------------------------------------
# quantize: RTN bit-exact

@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("four_over_six", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rtn_bit_exact(block, four_over_six, dtype):
    g = torch.Generator().manual_seed(BLOCKS.index(block) * 4 + 2 * four_over_six
                                      + (dtype == torch.bfloat16))
    x = _heavy_tailed((48, 96), g, dtype)
    k = kquantize(x, block, "rtn", four_over_six)
    r = nvfp4.quantize_reference(x, block, "rtn", four_over_six)
    _same(k, r)
    # zero block
    assert k.scales.view(torch.uint8)[0, 0] == 0 and (k.codes[:16, :8] & 0x77).eq(0).all()
    assert (k.scales.float() < 2**-6).any()  # subnormal scales kept


# the interpreter's numpy says so when 1 / (s_b * S_dec) overflows, before the cap
@pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("four_over_six", [False, True])
def test_quantize_at_the_bottom_of_fp32s_range(four_over_six):
    """A tensor near 1e-38: S_enc saturates at FLT_MAX, so s_b * S_dec is subnormal and its
    reciprocal overflows; the element scale is capped at FLT_MAX there, as in the reference (and
    Transformer Engine), not infinite."""
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(5)) * 1e-38
    assert (nvfp4.element_scale(nvfp4.to_e4m3(torch.tensor([0.5])), torch.tensor(1 / 3.4e38))
            == nvfp4.FLT_MAX).all()
    for block in BLOCKS:
        _same(kquantize(x, block, "rtn", four_over_six),
              nvfp4.quantize_reference(x, block, "rtn", four_over_six))


@pytest.mark.parametrize("block", BLOCKS)
def test_quantize_fp16_input_as_the_reference(block):
    """An fp16 x (10 mantissa bits, 3 more than bf16's) is quantized from its own values widened
    to fp32, as the reference quantizes it, not from a bf16 rounding of them."""
    x = _heavy_tailed((32, 64), torch.Generator().manual_seed(21)).to(torch.float16)
    assert not torch.equal(x.bfloat16().float(), x.float())
    _same(kquantize(x, block, "rtn", True), nvfp4.quantize_reference(x, block, "rtn", True))


def test_quantize_batched_and_transposed_views():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 32, 48, generator=g)
    _same(kquantize(x, (16, 16), "rtn", True), nvfp4.quantize_reference(x, (16, 16), "rtn", True))
    xt = torch.randn(64, 48, generator=g).t()  # (48, 64) with strides (1, 48): the wgrad's dY.t()
    _same(kquantize(xt, (1, 16)), nvfp4.quantize_reference(xt, (1, 16), "rtn", False))


def test_quantize_ties_to_even_on_the_grid():
    # every block has max 6 (so s_b * s_g = 1 exactly with amax 2688: s_g = 1, s_b = 1) and holds
    # all midpoints
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    row = torch.cat((mids, -mids))                       # 16 values, max |.| = 6
    x = row.repeat(16, 2)                                # (16, 32)
    x[0, 0] = 2688.0  # global amax -> s_g = 1, that block's own scale 448
    k = kquantize(x, (1, 16))
    _same(k, nvfp4.quantize_reference(x, (1, 16), "rtn", False))
    assert k.dequantize()[1, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


@triton.jit
def _e4m3_probe(s_ptr, v_ptr, bits_ptr, n, BLOCK: tl.constexpr, UP: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    s = tl.load(s_ptr + offs, mask=offs < n, other=0.0)
    v, bits = nm._round_to_e4m3(s, UP)
    tl.store(v_ptr + offs, v, mask=offs < n)
    tl.store(bits_ptr + offs, bits, mask=offs < n)


def _check_round_to_e4m3(device):
    # all finite E4M3 >= 0
    grid = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = (grid[:-1] + grid[1:]) / 2  # exact midpoints
    g = torch.Generator().manual_seed(0)
    rand = (torch.rand(2000, generator=g) * 448
            * torch.exp2(-torch.randint(0, 14, (2000,), generator=g).float()))
    # and a NaN (a block that held one): E4M3's NaN, 0x7F
    s = torch.cat((grid, ties, torch.nextafter(ties, torch.zeros_like(ties)), rand,
                   torch.tensor([448.0, 1e-30, float("nan")])))
    for up in (False, True):
        sd = s.to(device)
        v, bits = torch.empty_like(sd), torch.empty(s.shape, dtype=torch.uint8, device=device)
        _e4m3_probe[(triton.cdiv(s.numel(), 1024),)](sd, v, bits, s.numel(), BLOCK=1024, UP=up)
        v, bits = v.cpu(), bits.cpu()
        want = nvfp4.to_e4m3(s, up=up)  # torch's RNE cast (+1 code up)
        assert torch.equal(v.isnan(), s.isnan()) and torch.equal(v[:-1], want[:-1].float())
        assert torch.equal(bits, want.view(torch.uint8)) and bits[-1] == 0x7F
        if up:  # the smallest E4M3 value >= s
            below = torch.where(bits > 0, bits - 1, bits).view(torch.float8_e4m3fn).float()
            assert (v >= s)[:-1].all() and ((below < s) | (bits == 0))[:-1].all()


def test_round_to_e4m3_matches_torch_including_ties_and_subnormals():
    """In the interpreter: the integer arithmetic (its own E4M3 conversion is not RNE on subnormal
    ties)."""
    _check_round_to_e4m3("cpu")


@pytest.mark.gpu
def test_gpu_round_to_e4m3_hardware_conversion_on_every_tie():
    """On the GPU: the hardware conversion (HW_E4M3) for nearest, the arithmetic for up."""
    _check_round_to_e4m3("cuda")


@triton.jit
def _e4m3_value_probe(bits_ptr, v_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(v_ptr + offs, kq._e4m3_value(tl.load(bits_ptr + offs)))


@pytest.mark.parametrize("hw", [False, True], ids=["integer", "cvt"])
def test_e4m3_value_decodes_every_block_scale(monkeypatch, hw):
    """Every E4M3 scale byte >= 0 (0..0x7e finite, 0x7f the NaN of a block that held a NaN) decodes
    to torch's value by both paths: the integer arithmetic (Ampere, the interpreter) and the fp8
    conversion (sm_89+)."""
    from kernels import nvfp4_math
    if hw and not nvfp4_math.on_gpu():
        monkeypatch.setattr(nvfp4_math, "HW_E4M3", tl.constexpr(True))
    elif not hw and nvfp4_math.on_gpu():
        pytest.skip("a GPU compiles HW_E4M3 as its row of kernels/targets.py says")
    bits = torch.arange(0, 128, dtype=torch.uint8)
    dev = "cuda" if nvfp4_math.on_gpu() else "cpu"
    v = torch.empty(128, device=dev)
    _e4m3_value_probe[(1,)](bits.to(dev), v, BLOCK=128)
    v, want = v.cpu(), bits.view(torch.float8_e4m3fn).float()
    assert torch.equal(v[:0x7F], want[:0x7F]) and want[0x7F].isnan()
    # the interpreter's own fp8 decode (the cvt path off a GPU) has no NaN: 0x7f reads 480 there
    assert v[0x7F].isnan() or (hw and not nvfp4_math.on_gpu())


@triton.jit
def _e2m1_probe(a_ptr, idx_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(a_ptr + offs, mask=offs < n, other=0.0)
    tl.store(idx_ptr + offs, nm._e2m1_index(nm._rtn_e2m1_value(a)), mask=offs < n)


def test_rtn_e2m1_matches_the_reference_on_ties_and_neighbours():
    grid = nvfp4.E2M1_VALUES.clone()
    ties = (grid[:-1] + grid[1:]) / 2  # 0.25, 0.75, ..., 5: exact midpoints
    pts = torch.cat((grid, ties))
    down, up = (torch.nextafter(pts, torch.zeros_like(pts)),
                torch.nextafter(pts, torch.full_like(pts, 7.0)))
    near = torch.cat((pts, down, up))
    g = torch.Generator().manual_seed(0)
    a = torch.cat((near, torch.rand(20000, generator=g) * 6,
                   torch.tensor([0.0, 1e-38, 6.0]))).clamp(0, 6)
    idx = torch.empty(a.shape, dtype=torch.int32)
    _e2m1_probe[(triton.cdiv(a.numel(), 1024),)](a, idx, a.numel(), BLOCK=1024)
    assert torch.equal(idx, nvfp4.rtn_e2m1(a).int())
    # ties to even
    assert idx[:8].tolist() == list(range(8)) and idx[8:15].tolist() == [0, 2, 2, 4, 4, 6, 6]


@triton.jit
def _pairwise_probe(e_ptr, out_ptr, BM: tl.constexpr, BN: tl.constexpr, SBM: tl.constexpr,
                    SBN: tl.constexpr):
    e = tl.load(e_ptr + tl.arange(0, BM)[:, None] * BN + tl.arange(0, BN)[None, :])
    s = nm._pairwise_block_sum(e.reshape(BM // SBM, SBM, BN // SBN, SBN),
                               BM // SBM, SBM, BN // SBN, SBN)
    tl.store(out_ptr + tl.arange(0, BM // SBM)[:, None] * (BN // SBN)
             + tl.arange(0, BN // SBN)[None, :], s)


def _pairwise_block_sum_torch(e):
    """The reference's fixed tree (nvfp4._pairwise_block_sum once the lead's patch is in): row
    pairs, then columns."""
    while e.shape[-1] > 1:
        e = e[..., 0::2] + e[..., 1::2]
    while e.shape[-3] > 1:
        e = e[..., 0::2, :, :] + e[..., 1::2, :, :]
    return e


@pytest.mark.parametrize("block", BLOCKS)
def test_four_over_six_error_sum_is_the_fixed_pairwise_tree(block):
    """4/6 compares two per-block sums of squared errors; the kernel must add them in exactly the
    reference's order, or near-ties pick different candidates (seen on the H200: ~1e-5 of the blocks
    with a plain sum).
    Random magnitudes over many binades make every fp32 add round, so only the same tree gives the
    same bits."""
    g = torch.Generator().manual_seed(BLOCKS.index(block))
    BM, BN = 32, 64
    e = (torch.rand(BM, BN, generator=g)
         * torch.exp2(torch.randint(-20, 20, (BM, BN), generator=g).float()))
    out = torch.empty(BM // block[0], BN // block[1])
    _pairwise_probe[(1,)](e, out, BM=BM, BN=BN, SBM=block[0], SBN=block[1])
    ref_sum = getattr(nvfp4, "_pairwise_block_sum", _pairwise_block_sum_torch)
    want = ref_sum(e.reshape(BM // block[0], block[0], BN // block[1], block[1]))
    assert torch.equal(out, want.reshape(out.shape))
    # the check can fail: a sequential left-to-right sum rounds differently in some blocks
    seq = (e.reshape(BM // block[0], block[0], BN // block[1], block[1])
           .permute(0, 2, 1, 3).reshape(*out.shape, -1))
    acc = torch.zeros_like(out)
    for i in range(seq.shape[-1]):
        acc = acc + seq[..., i]
    assert not torch.equal(acc, out)


def test_markstein_division_step_is_correctly_rounded():
    """The GPU path of nm._div_by (the interpreter cannot run it: its fma rounds twice):
    q = RN(x / den) from inv = RN(1 / den) with one fma correction (emulated in float64: exact
    products), equals true division.
    Per-block divisors, and the block scale's constant ones
    (nm._block_scale: amax / 6, then / s_g)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2_000_000, generator=g)
         * torch.exp(3 * torch.randn(2_000_000, generator=g))).abs()
    den = ((torch.rand(2_000_000, generator=g) + 0.5)
           * torch.exp2(torch.randint(-40, 20, (2_000_000,), generator=g).float()))
    den[:300_000], den[300_000:400_000] = 6.0, 4.0
    inv = 1.0 / den                                                            # RN(1 / den), fp32
    q = x * inv
    r = (x.double() - q.double() * den.double()).float()  # exact (fma): representable
    q1 = (q.double() + r.double() * inv.double()).float()  # fma: r * inv exact in fp64
    assert torch.equal(q1, x / den)


# --------------------------------------------------------------------------------------------------
# quantize: Hadamard

@pytest.mark.parametrize("block", [(1, 16), (16, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_hadamard_bit_exact(block, dtype):
    g = torch.Generator().manual_seed(7)
    H = nvfp4.random_hadamard(g)
    # multiples of 1/8 in [-8, 8]: every 16-term rotation is exact in fp32, whatever the summation
    # order
    x = (torch.randint(-64, 65, (32, 64), generator=g).float() / 8).to(dtype)
    _same(kquantize(x, block, "rtn", False, hadamard=H),
          nvfp4.quantize(x, block, "rtn", False, hadamard=H))
    # generic values: the rotation's rounding may depend on summation order; here it matched, keep
    # it honest
    x = torch.randn(32, 64, generator=g).to(dtype)
    k, r = (kquantize(x, block, "rtn", True, hadamard=H),
            nvfp4.quantize(x, block, "rtn", True, hadamard=H))
    assert (k.codes != r.codes).float().mean() < 1e-3 \
        and (k.scales.view(torch.uint8) != r.scales.view(torch.uint8)).float().mean() < 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_global_amax_pair_equals_each_quantizations_own_amax(dtype, transposed):
    """NVFP4Linear's backward reads dY once for max |dY| and max |H^T dY|: both must be the exact
    amaxes the two quantizations would compute themselves (same global scale bits)."""
    g = torch.Generator().manual_seed(11)
    H = nvfp4.random_hadamard(g)
    x = _heavy_tailed((64, 96), g, dtype)
    x = x.t().contiguous().t() if transposed else x  # a column-major view takes the 64 x 64 tiles
    x[37, 5] = -2 * x.abs().max()  # the plain max sits in one element, negative
    plain, rotated = kq.global_amax_pair(x, H)
    assert plain.item() == -x[37, 5].item()
    x3 = x.reshape(1, *x.shape)
    assert torch.equal(rotated, kq._global_amax(x3, H, 2, (16, 1)))
    for block, hadamard, amax in [((1, 16), None, plain), ((16, 1), H, rotated)]:
        _same(kquantize(x, block, "rtn", False, hadamard=hadamard, global_amax=amax),
              kquantize(x, block, "rtn", False, hadamard=hadamard))


# --------------------------------------------------------------------------------------------------
# quantize: SR

@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("rounding", ["sr", "sr_up"])
def test_sr_bit_exact_given_the_seed(block, rounding):
    """The kernels' Philox words are the reference's (nvfp4.sr_uniforms): the same seed, the same
    codes."""
    x = _heavy_tailed((32, 64), torch.Generator().manual_seed(3))
    _same(kquantize(x, block, rounding, True, seed=11),
          nvfp4.quantize_reference(x, block, rounding, True, 11))


class _Int64Tensors(torch.utils._python_dispatch.TorchDispatchMode):
    """The int64 tensors a call makes (SR's seed is one), by op name; the interpreter's own copies
    of the launch arguments (set_, copy_) left out."""

    def __enter__(self):
        self.ops = []
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if (torch.is_tensor(out) and out.dtype == torch.int64
                and not str(func).startswith(("aten.set_", "aten.copy_"))):
            self.ops.append(str(func))
        return out


@pytest.mark.parametrize("block", BLOCKS)
def test_rtn_and_the_amax_passes_make_no_seed(block):
    """RTN and the amax pre-passes never load SR's seed pointer, so they launch with a tensor the
    call has anyway: no fill of a 0 per call (~770 small kernels a 1b micro-step, each a launch for
    eager's host). SR still gets its seed, a host 0 included (the reference's seed-0 codes)."""
    x = _heavy_tailed((32, 64), torch.Generator().manual_seed(8))
    with _Int64Tensors() as made:
        kq.quantize(x, block, "rtn")
        kq.quantize(x, block, "rtn", four_over_six=True)
        kq.quantize_dequant(x, block, "rtn")
    assert made.ops == []
    with _Int64Tensors() as made:
        t = kquantize(x, block, "sr", seed=0)
    assert made.ops
    _same(t, nvfp4.quantize_reference(x, block, "sr", False, 0))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_signed_hadamard_kernel_is_the_reference_matrix(device, monkeypatch):
    """Eq. 2's diag(s) H16 / 4 from one launch: nvfp4.signed_hadamard's entries for every drawn
    sign pattern tried (all +, all -, random), and random_hadamard draws the same matrix on either
    route."""
    g = torch.Generator().manual_seed(13)
    patterns = [torch.zeros(16, 1, dtype=torch.int64), torch.ones(16, 1, dtype=torch.int64)]
    patterns += [torch.randint(0, 2, (16, 1), generator=g) for _ in range(6)]
    for signs in patterns:
        signs = signs.to(device)
        assert torch.equal(kq.signed_hadamard(signs), nvfp4.signed_hadamard(signs))
    by_route = {}
    for route in ("kernels", "reference"):
        monkeypatch.setenv("NANOFP4_ROUTE", route)
        torch.manual_seed(5)
        by_route[route] = nvfp4.random_hadamard(device=device)
    assert torch.equal(by_route["kernels"], by_route["reference"])


def _assert_sr_unbiased(d, row, t_rtn):
    """d: (n, C) dequantized SR draws of the same row x (C,). E[SR(a)] = a, so the mean must match
    sign(x) * min(|x| / (s_b s_g), 6) * s_b s_g (the clamp at 6 is the format's, not SR's). Per
    value the number of round-ups is Binomial(n, p), p the fractional distance: allow 6 standard
    deviations plus 10 draws (when n p is small the count is Poisson-like and a few extra ups are
    not rare; over thousands of values a bound of 5 sigma of the observed spread alone failed by
    chance when all n draws happened to round down)."""
    bm, bn = t_rtn.block
    n = d.shape[0]
    s_b = t_rtn.scales.float().repeat_interleave(bm, -2).repeat_interleave(bn, -1)[0]
    den = s_b * t_rtn.global_scale
    a = (row.abs() * nvfp4.element_scale(s_b, t_rtn.global_scale)).clamp(max=6.0)
    expected = torch.sign(row) * a * den
    grid = nvfp4.E2M1_VALUES
    lo = (a.unsqueeze(-1) >= grid[1:]).sum(-1)
    gap = (grid[(lo + 1).clamp(max=7)] - grid[lo]) * den  # one round-up in x's units
    p = torch.where(gap > 0, (a - grid[lo]) * den / torch.where(gap > 0, gap, 1.0), 0.0)
    bound = (6 * (n * p * (1 - p)).sqrt() + 10) * gap / n + 1e-6 * row.abs()
    assert ((d.mean(0) - expected).abs() <= bound).all()


def test_sr_unbiased_reproducible_and_the_references_draws():
    g = torch.Generator().manual_seed(5)
    row = torch.randn(64, generator=g)
    x = row.repeat(512, 1)  # 512 independent SR draws of each of 64 values, one launch
    k = kquantize(x, (1, 16), "sr", seed=123)
    rtn = nvfp4.quantize_reference(x, (1, 16), "rtn", False)
    # the reference's draws, bit for bit
    _same(k, nvfp4.quantize_reference(x, (1, 16), "sr", False, 123))
    _assert_sr_unbiased(k.dequantize(), row, rtn)
    # reproducible given the seed
    assert torch.equal(kquantize(x, (1, 16), "sr", seed=123).codes, k.codes)
    assert not torch.equal(kquantize(x, (1, 16), "sr", seed=124).codes, k.codes)
    # SR leaves the scales alone
    assert torch.equal(k.scales.view(torch.uint8), rtn.scales.view(torch.uint8))


@pytest.mark.parametrize("block", [(1, 16), (16, 1)])
def test_sr_draws_independent_across_neighbours(block):
    """Every element sits halfway between two grid points (a = 1.25: up with probability 1/2). One
    Philox call feeds 8 neighbouring elements, each word two of them (nvfp4.sr_uniforms): a reused
    or correlated draw would still be unbiased, so check the pair correlations of the up/down
    decisions too, within a word, within and across the groups of 8."""
    x = torch.full((128, 256), 1.25)
    # the first element of each block is 6: s_b * s_g = 1, a = 1.25
    firsts = torch.zeros(128, 256, dtype=torch.bool)
    if block == (1, 16):
        firsts[:, ::16] = True
    else:
        firsts[::16, :] = True
    x[firsts] = 6.0
    d = kquantize(x, block, "sr", seed=77).dequantize()
    if block == (16, 1):  # neighbours along the block: down the columns
        d, firsts = d.t(), firsts.t()
    up = (d[~firsts] > 1.25).float()           # the other 15/16 of the decisions, along the blocks
    assert abs(up.mean().item() - 0.5) < 0.02
    z = up - up.mean()
    for lag in range(1, 10):
        corr = (z[:-lag] * z[lag:]).mean() / z.var()
        assert abs(corr.item()) < 0.03, lag


@triton.jit
def _words_probe(out_ptr, seed, M, N, WHICH: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """The SR helpers' words for a (BM, BN) tile at the origin of an (M, N) tensor, as int32: WHICH
    0 _random_words, 1 _block_random_words (the rows kernel's (NB, 2, 8) tile of blocks), 2
    _column_random_words in the tile kernel's arrangement."""
    rows, cols = tl.arange(0, BM), tl.arange(0, BN)
    if WHICH == 0:
        r = nm._random_words(seed, rows, 0, N, BM, BN)
    elif WHICH == 1:
        r = nm._block_random_words(seed, tl.arange(0, BM * BN // 16), BM * BN // 16)
        r = r.reshape(BM, BN)
    else:
        r = nm._column_random_words(seed, tl.arange(0, BM // 8)[:, None] * N + cols[None, :])
        r = tl.permute(r, (0, 2, 3, 4, 1)).reshape(BM, BN)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], r.to(tl.int32, bitcast=True))


@pytest.mark.parametrize("which, block", [(0, (1, 16)), (1, (1, 16)), (2, (16, 1))])
def test_sr_words_are_the_references_half_words(which, block):
    """Every SR helper draws nvfp4.sr_uniforms' 16 bits per element, as the SR word
    _sr_e2m1_value reads (_sr_word: the bits h in the low half under the fp32 1.0's, u = h 2^-16)."""
    M, N, seed = 32, 64, 424242
    out = torch.zeros(M, N, dtype=torch.int32)
    _words_probe[(1,)](out, seed, M, N, which, M, N)
    r = out.long() & 0xFFFFFFFF
    assert ((r >> 16) == 0x3F80).all()
    assert torch.equal((r & 0xFFFF).float() * 2.0**-16, nvfp4.sr_uniforms(seed, (M, N), block))


@triton.jit
def _sr_probe(a_ptr, idx_ptr):
    """_sr_e2m1_value's index of one a (per program) with every 16-bit half-word h, placed as the
    SR helpers place it (_sr_word)."""
    h = tl.arange(0, 65536)
    a = tl.load(a_ptr + tl.program_id(0) + h * 0)
    r = nm._sr_word(h.to(tl.uint32))
    tl.store(idx_ptr + tl.program_id(0) * 65536 + h, nm._e2m1_index(nm._sr_e2m1_value(a, r)))


def test_sr_rounds_up_for_exactly_ceil_d_2_16_of_the_half_words():
    """The 16-bit contract, enumerated: over all 2^16 values of the half-word, a fractional distance
    d rounds up for exactly ceil(d 2^16) of them (P(up) = ceil(d 2^16) 2^-16: a bias in
    [0, 2^-16) of a step), on both sides of 1 (the kernel's two branches), at d on, just below and
    just above multiples of 2^-16 and at d far off that grid; the kernel and the reference
    (nvfp4.sr_e2m1) decide alike for every half-word."""
    lo = torch.tensor([0.0, 0.5, 1.0, 2.0, 4.0])
    gap = torch.tensor([0.5, 0.5, 0.5, 1.0, 2.0])
    on = torch.tensor([1.0, 12345.0, 65535.0])[None, :] * 2.0**-16 * gap[:, None] + lo[:, None]
    a = torch.cat((on.flatten(), torch.nextafter(on, lo[:, None]).flatten(),
                   torch.nextafter(on, lo[:, None] + gap[:, None]).flatten(),
                   lo + gap / 3, lo + 2.0**-30, lo, torch.tensor([6.0, 2.0**-100])))
    idx = torch.zeros(len(a), 65536, dtype=torch.int32)
    _sr_probe[(len(a),)](a, idx)
    u = torch.arange(65536) * 2.0**-16
    assert torch.equal(idx, nvfp4.sr_e2m1(a[:, None], u[None, :]).int())
    lo_idx = nvfp4.sr_e2m1(a, torch.ones(()))       # u = 1: never up
    g_lo = nvfp4.E2M1_VALUES[lo_idx.long()].double()
    g_gap = torch.where(g_lo < 2, 0.5, torch.where(g_lo < 4, 1.0, 2.0))
    d = (a.double() - g_lo) / g_gap
    ups = (idx > lo_idx[:, None]).sum(1)
    assert torch.equal(ups, torch.ceil(d * 2**16).long())
    # the bias ups 2^-16 - d in [0, 2^-16): d 2^16 in (ups - 1, ups]
    assert ((ups - 1 < d * 2**16) & (d * 2**16 <= ups)).all()
    assert (d * 2**16 != (d * 2**16).round()).sum() > len(a) // 2   # most d off the grid


@pytest.mark.parametrize("block", [(1, 16), (16, 1)])
@pytest.mark.parametrize("options", [dict(rounding="rtn"), dict(rounding="rtn", four_over_six=True),
                                     dict(rounding="sr", seed=5),
                                     dict(rounding="sr", seed=5, hadamard=True),
                                     dict(rounding="sr", seed=5, hadamard=True, four_over_six=True),
                                     dict(rounding="sr_up", seed=5, hadamard=True,
                                          four_over_six=True)])
def test_rows_and_cols_kernels_equal_the_tile_kernel(block, options):
    """1x16 blocks of a contiguous x take _quantize_rows_kernel, 16x1 blocks of a row-major x
    _quantize_cols_kernel; the same values stored column-major take the general tile kernel, which
    must give the same bits (codes, scales, bf16 values, global scale, the global amax of the
    rotated x; SR: the same Philox counters; the rotation: the same butterfly), on shapes with
    masked tails (a block count that is not a multiple of the rows kernel's program size, a width
    that is not a multiple of the cols kernel's)."""
    g = torch.Generator().manual_seed(3)
    shape = (2, 40, 48) if block == (1, 16) else (2, 32, 600)
    x = _heavy_tailed(shape, g)
    opts = dict(options)
    if opts.pop("hadamard", False):
        opts["hadamard"] = nvfp4.random_hadamard(g)
    x_tile = x.transpose(-1, -2).contiguous().transpose(-1, -2)        # same values, column-major
    x3, x3_tile = x.reshape(-1, *shape[1:]), x_tile.reshape(-1, *shape[1:])
    assert kq._use_rows(x3, block) if block == (1, 16) else kq._use_cols(x3, block)
    assert not kq._use_rows(x3_tile, block) and not kq._use_cols(x3_tile, block)
    fast_values, fast_gs, *fast = kq.quantize_dequant(x, block, return_tensor=True, **opts)
    tile_values, tile_gs, *tile = kq.quantize_dequant(x_tile, block, return_tensor=True, **opts)
    _same(nvfp4.NVFP4Tensor(*fast, fast_gs, shape, block),
          nvfp4.NVFP4Tensor(*tile, tile_gs, shape, block))
    # -0.0 included
    assert torch.equal(fast_values.view(torch.int16), tile_values.view(torch.int16))
    # values only, as Hopper's wgrad operands are written (no codes)
    values, gs = kq.quantize_dequant(x, block, **opts)
    assert torch.equal(values.view(torch.int16), tile_values.view(torch.int16))
    assert torch.equal(gs, tile_gs)


# --------------------------------------------------------------------------------------------------
# quantize_dequant / grid values

@pytest.mark.parametrize("block", [(1, 16), (16, 16)])
def test_quantize_dequant_writes_the_grid_values(block):
    x = _heavy_tailed((32, 64), torch.Generator().manual_seed(9), torch.bfloat16)
    r = nvfp4.quantize_reference(x, block, "rtn", True)
    values, s_g, codes, scales = kq.quantize_dequant(x, block, "rtn", True, return_tensor=True)
    assert values.dtype == torch.bfloat16 and torch.equal(values.float(), r.grid_values())
    assert torch.equal(s_g, r.global_scale)
    _same(nvfp4.NVFP4Tensor(codes, scales, s_g, x.shape, block), r)
    assert torch.equal(kd.grid_values_bf16(r).float(), r.grid_values())
    assert torch.equal(kdequantize(r, torch.float32), r.dequantize(torch.float32))
    # explicit RNE to bf16
    assert torch.equal(kdequantize(r, torch.bfloat16), r.dequantize(torch.bfloat16))


@pytest.mark.parametrize("block", BLOCKS)
def test_dequantize_bitwise_every_block(block):
    """kd.dequantize / grid_values_bf16 against the reference bit for bit (-0.0 of negative zero
    codes and subnormal scales included), batched, with a block count that leaves a partial
    program."""
    x = _heavy_tailed((3, 48, 80), torch.Generator().manual_seed(11))
    x[0, :16, :16] = -1e-30  # tiny negative blocks: scale 0, codes 8 (-0.0)
    r = nvfp4.quantize_reference(x, block, "rtn", False)
    assert (r.unpack_codes() == 8).any() and (r.scales.float() < 2**-6).any()
    bits = lambda t: t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)
    assert torch.equal(bits(kd.grid_values_bf16(r)), bits(r.grid_values().to(torch.bfloat16)))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(bits(kdequantize(r, dtype)), bits(r.dequantize(dtype)))


def test_dequantize_reads_1x16_codes_that_start_off_a_word():
    """The 1x16 kernel reads a block's codes as two int32 words: codes that are a view starting one
    byte into their storage (a slice of a larger buffer) decode as the reference does, not refused
    by the int32 view and not read from the wrong bytes."""
    r = nvfp4.quantize_reference(_heavy_tailed((32, 48), torch.Generator().manual_seed(12)))
    storage = torch.zeros(r.codes.numel() + 1, dtype=torch.uint8)
    storage[1:] = r.codes.flatten()
    codes = storage[1:].view(r.codes.shape)
    assert codes.storage_offset() == 1
    t = nvfp4.NVFP4Tensor(codes, r.scales, r.global_scale, r.shape, r.block)
    assert torch.equal(kdequantize(t, torch.float32), r.dequantize(torch.float32))


# --------------------------------------------------------------------------------------------------
# values written into a wider buffer (LoRA-SVD's GEMM operands, kernels/nvfp4_linear.py)

def _bits16(t):
    return t.view(torch.int16)


def _noise_buffer(shape, g):
    """bf16 buffer of random bit patterns (NaNs included): whatever a write outside its part
    touches shows."""
    return torch.randint(-2**15, 2**15, shape, generator=g, dtype=torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("block,shape,options", [
    ((1, 16), (40, 48), dict(rounding="rtn", four_over_six=True)),  # a partial rows program
    ((1, 16), (24, 16), dict(rounding="sr", seed=5, hadamard=True)),  # the smallest K
    ((1, 16), (16, 32), dict(rounding="sr_up", seed=5, four_over_six=True)),
    ((16, 1), (32, 48), dict(rounding="sr", seed=5, hadamard=True)),  # the cols kernel
    ((16, 16), (32, 48), dict(rounding="rtn", four_over_six=True))])  # the tile kernel
def test_values_land_in_the_left_columns_of_a_wider_buffer(block, shape, options):
    """quantize_dequant(out=buf[:, :K]) of a (T, K + r) buffer: the left K columns hold exactly the
    reference's grid values (-0.0 included), the packed outputs are the reference's, and the r
    right columns keep their bits (the quantize pass writes nothing there)."""
    g = torch.Generator().manual_seed(13)
    opts = dict(options)
    H = nvfp4.random_hadamard(g) if opts.pop("hadamard", False) else None
    # with H: multiples of 1/8, whose rotations are exact in any summation order
    x = (torch.randint(-64, 65, shape, generator=g).float() / 8 if H is not None
         else _heavy_tailed(shape, g))
    (T, K), r = shape, 5
    buf = _noise_buffer((T, K + r), g)
    before = buf.clone()
    values, s_g, codes, scales = kq.quantize_dequant(x, block, hadamard=H, return_tensor=True,
                                                     out=buf[:, :K], **opts)
    ref = nvfp4.quantize(x, block, opts["rounding"], opts.get("four_over_six", False),
                         hadamard=H, seed=opts.get("seed", 0))
    assert values.data_ptr() == buf.data_ptr() and values.stride() == (K + r, 1)
    _same(nvfp4.NVFP4Tensor(codes, scales, s_g, x.shape, block), ref)
    assert torch.equal(_bits16(buf[:, :K]), _bits16(ref.grid_values().to(torch.bfloat16)))
    assert torch.equal(_bits16(buf[:, K:]), _bits16(before[:, K:]))


def test_grid_values_decode_into_a_wider_buffer():
    """LoRA-SVD's [W_hat | L2] and [W_hat ; L1]: W's 16x16 grid values decoded into the buffer's
    left columns / top rows, bit for bit, the rest untouched; a strided 1x16 output and a wrong
    dtype are refused."""
    g = torch.Generator().manual_seed(17)
    w = nvfp4.quantize_reference(_heavy_tailed((48, 32), g), (16, 16), "rtn", True)
    want = _bits16(w.grid_values().to(torch.bfloat16))
    for buf, part, rest in [(_noise_buffer((48, 35), g), (slice(None), slice(0, 32)),
                             (slice(None), slice(32, None))),
                            (_noise_buffer((51, 32), g), slice(0, 48), slice(48, None))]:
        before = buf.clone()
        out = kd.grid_values_bf16(w, out=buf[part])
        assert out.data_ptr() == buf.data_ptr() and torch.equal(_bits16(buf[part]), want)
        assert torch.equal(_bits16(buf[rest]), _bits16(before[rest]))
    x = nvfp4.quantize_reference(torch.randn(16, 32, generator=g))
    with pytest.raises(ValueError, match="out must be"):
        kd.grid_values_bf16(x, out=torch.empty(16, 40, dtype=torch.bfloat16)[:, :32])
    with pytest.raises(ValueError, match="out must be"):
        kq.quantize_dequant(torch.randn(16, 32), out=torch.empty(16, 32))


@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_lora_operands_equal_the_concatenations_bit_for_bit(rounding):
    """kernels/nvfp4_linear's LoRA buffers written in place are the concatenations they replace:
    [X_hat | beta X L^T / (s_g s_g_other)], and W's [W_hat | L2] (the forward's rows) and
    [W_hat ; L1] (dX's columns), every bit."""
    from kernels import nvfp4_linear
    g = torch.Generator().manual_seed(19)
    x, L = _heavy_tailed((48, 64), g), torch.randn(5, 64, generator=g)
    gs_other, beta = torch.tensor(0.37), 0.5
    buf, s_g, (codes, scales) = nvfp4_linear._operand(x, rounding, True, 7, "x", 5,
                                                      return_tensor=True)
    nvfp4_linear._branch_columns(buf, x, L, beta, s_g, gs_other)
    xv, s_g_cat, *_ = kq.quantize_dequant(x, (1, 16), rounding, True, seed=7, return_tensor=True)
    branch = (x.float() @ L.t().float() * beta / (s_g_cat * gs_other)).to(torch.bfloat16)
    assert torch.equal(s_g, s_g_cat)
    assert torch.equal(_bits16(buf), _bits16(torch.cat((xv, branch), dim=1)))
    w = _heavy_tailed((32, 64), g)
    L2 = torch.randn(32, 5, generator=g)
    c = nvfp4.linear_contract(True)
    wbuf, _, s_gw = nvfp4_linear.weight(w, c["forward.w"], 0, L, L2)
    qw = nvfp4.quantize_reference(w, (16, 16), "rtn", True)
    assert torch.equal(s_gw, qw.global_scale)
    w_hat, N, K = qw.grid_values().bfloat16(), *w.shape
    assert torch.equal(_bits16(wbuf[:N]), _bits16(torch.cat((w_hat, L2.bfloat16()), dim=1)))
    assert torch.equal(_bits16(wbuf[:, :K]), _bits16(torch.cat((w_hat, L.bfloat16()))))


# --------------------------------------------------------------------------------------------------
# eq. 2's X_hat decoded inside the 16x1 quantize pass (kernels/nvfp4_linear.wgrad)

PACKED_SOURCE_OPTIONS = [dict(rounding="rtn"), dict(rounding="rtn", four_over_six=True),
                         dict(rounding="sr", seed=5), dict(rounding="sr", seed=5, hadamard=True),
                         dict(rounding="sr_up", seed=5, hadamard=True, four_over_six=True)]


def _split_hadamard(options, g):
    opts = dict(options)
    return opts, nvfp4.random_hadamard(g) if opts.pop("hadamard", False) else None


@pytest.mark.parametrize("options", PACKED_SOURCE_OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_source_equals_dequantize_then_quantize(options, dtype):
    """quantize_dequant of a packed 1x16 X with 16x1 blocks (the cols kernel decoding codes and
    scales in registers, in its amax pre-pass too) gives every bit the separate dequantize(X, dtype)
    then quantize route gave: codes, scales, global scale, grid values; on a width that is not a
    multiple of the cols tile, the smallest K, and a batch."""
    g = torch.Generator().manual_seed(29)
    opts, H = _split_hadamard(options, g)
    for shape in [(32, 48), (16, 16), (2, 16, 32)]:
        xq = nvfp4.quantize_reference(_heavy_tailed(shape, g), (1, 16), "rtn", True)
        x_hat = kd.dequantize(xq.codes, xq.scales, xq.global_scale, xq.shape, xq.block, dtype)
        want_v, want_gs, *want = kq.quantize_dequant(x_hat, (16, 1), hadamard=H,
                                                     return_tensor=True, **opts)
        got_v, got_gs, *got = kq.quantize_dequant(xq, (16, 1), hadamard=H, return_tensor=True,
                                                  source_dtype=dtype, **opts)
        _same(nvfp4.NVFP4Tensor(*got, got_gs, shape, (16, 1)),
              nvfp4.NVFP4Tensor(*want, want_gs, shape, (16, 1)))
        assert torch.equal(_bits16(got_v), _bits16(want_v))
        # values only (Hopper's wgrad.x)
        only_v, only_gs = kq.quantize_dequant(xq, (16, 1), hadamard=H, source_dtype=dtype, **opts)
        assert torch.equal(_bits16(only_v), _bits16(want_v)) and torch.equal(only_gs, want_gs)
    # codes only (the Blackwell route); fp16: not decoded in the kernel, dequantized first
    for dt in (dtype, torch.float16) if H is not None else ():
        x_hat = kd.dequantize(xq.codes, xq.scales, xq.global_scale, xq.shape, xq.block, dt)
        _same(nvfp4.NVFP4Tensor(*kq.quantize(xq, (16, 1), hadamard=H, source_dtype=dt, **opts),
                                shape, (16, 1)), kquantize(x_hat, (16, 1), hadamard=H, **opts))


@pytest.mark.parametrize("options", PACKED_SOURCE_OPTIONS)
def test_packed_source_equals_the_reference(options):
    """Against the reference's eq. 2 operand, nvfp4.quantize(Q1x16(X).dequantize(bf16), 16x1):
    bit for bit, on values whose rotations are exact in any summation order (multiples of 1/8 and
    a power-of-two global scale: 16-term sums of 6-bit grid values a few binades apart)."""
    g = torch.Generator().manual_seed(31)
    opts, H = _split_hadamard(options, g)
    x = torch.randint(-64, 65, (32, 32), generator=g).float() / 8
    x[0, 0] = 10.5   # amax(x)
    xq = nvfp4.quantize_reference(x, (1, 16), "rtn", False)
    assert xq.global_scale.item() == 2.0**-8  # S_enc = 6 * 448 / 10.5 = 256
    ref = nvfp4.quantize(xq.dequantize(torch.bfloat16), (16, 1), opts["rounding"],
                         opts.get("four_over_six", False), hadamard=H, seed=opts.get("seed", 0))
    values, s_g, *packed = kq.quantize_dequant(xq, (16, 1), hadamard=H, return_tensor=True,
                                               source_dtype=torch.bfloat16, **opts)
    _same(nvfp4.NVFP4Tensor(*packed, s_g, x.shape, (16, 1)), ref)
    assert torch.equal(_bits16(values), _bits16(ref.grid_values().to(torch.bfloat16)))


# --------------------------------------------------------------------------------------------------
# GEMM

def _gemm_bound(a_hat, b_hat, gs, K, out_dtype):
    """|kernel - reference| bound: fp32 summation in another order (K * 2^-22 relative to sum
    |a||b|, generous for tensor-core accumulation) plus one rounding of the output dtype (a full
    ulp: the interpreter's fp32 -> bf16 cast truncates instead of rounding to nearest)."""
    mag = (a_hat.abs().double() @ b_hat.abs().double().t()) * gs
    eps_out = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[out_dtype]
    return mag * K * 2**-22 + mag * eps_out + 1e-30


def _check_gemm(out, a, b, trans_a=False, trans_b=False, out_dtype=torch.float32):
    A = a.grid_values().double()
    B = b.grid_values().double()
    A, B = (A.t() if trans_a else A), (B.t() if trans_b else B)
    gs = (a.global_scale * b.global_scale).double()
    ref = (A @ B.t()) * gs
    assert out.dtype == out_dtype and out.shape == ref.shape
    err = (out.double() - ref).abs()
    bound = _gemm_bound(A, B, gs, A.shape[1], out_dtype)
    assert (err <= bound).all(), \
        f"max err {err.max().item()}, bound there {bound.flatten()[err.argmax()].item()}"
    # and the reference itself (nvfp4.nvfp4_matmul on CPU) agrees within the same bound
    if out.device.type == "cpu":
        r = nvfp4.nvfp4_matmul(transposed(a) if trans_a else a, transposed(b) if trans_b else b)
        assert ((r.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("M,N,K", [(48, 32, 96), (33, 18, 64), (16, 80, 160)])
@pytest.mark.parametrize("w_block", [(1, 16), (16, 16)])
def test_gemm_matches_reference(M, N, K, w_block):
    if N % w_block[0]:
        pytest.skip("16x16 weight blocks need N % 16 == 0")
    g = torch.Generator().manual_seed(M * N + K)
    a = nvfp4.quantize(_heavy_tailed((M, K), g) if M >= 32 and K >= 32
                       else torch.randn(M, K, generator=g), (1, 16))
    b = nvfp4.quantize(torch.randn(N, K, generator=g), w_block)
    for out_dtype in (torch.float32, torch.bfloat16):
        _check_gemm(kg.nvfp4_gemm(a, b, out_dtype=out_dtype), a, b, out_dtype=out_dtype)


def test_gemm_transposed_operands():
    g = torch.Generator().manual_seed(2)
    T, O, I = 32, 48, 64
    dy, W, X = (torch.randn(T, O, generator=g), torch.randn(O, I, generator=g),
                torch.randn(T, I, generator=g))
    dyq, wq = nvfp4.quantize(dy, (1, 16)), nvfp4.quantize(W, (16, 16))
    # dX = Q1x16(dY) Q16x16(W): W stored (out, in) is the transposed (N=in, K=out) operand
    _check_gemm(kg.nvfp4_gemm(dyq, wq, torch.float32, trans_b=True), dyq, wq, trans_b=True)
    # dW = dY^T X with both operands stored (T, .) and 16x1-blocked along T
    dy16, x16 = nvfp4.quantize(dy, (16, 1)), nvfp4.quantize(X, (16, 1))
    _check_gemm(kg.nvfp4_gemm(dy16, x16, torch.float32, trans_a=True, trans_b=True), dy16, x16,
                trans_a=True, trans_b=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_kernel_rounds_like_torch_mul(dtype):
    """The grid-value route's global-scale pass: x * s_g in fp32, rounded once to x's dtype
    (ties to even), in place, widened into an fp32 out, or added into one."""
    g = torch.Generator().manual_seed(11)
    # not a multiple of the block: the masked tail
    x = (torch.randn(5000, generator=g) * 100).to(dtype)
    gs_a, gs_b = (torch.tensor(0.3333, dtype=torch.float32),
                  torch.tensor(1.1e-3, dtype=torch.float32))
    want = (x.float() * (gs_a * gs_b)).to(dtype)
    got = kg.scale_(x.clone(), gs_a, gs_b)
    assert torch.equal(got, want)
    if dtype == torch.bfloat16:  # dX for an fp32 x: rounded to bf16, returned in fp32, x kept
        kept = x.clone()
        wide = kg.scale_(x, gs_a, gs_b, out=torch.full(x.shape, float("nan")))
        assert wide.dtype == torch.float32 and torch.equal(wide, want.float())
        assert torch.equal(x, kept)
    # accumulate: out.add_(x * s_g rounded to x's dtype), as autograd sums the dX of the layers
    # reading one input (nvfp4._GradientSum): into x's dtype, and into fp32 for a bf16 x
    for out_dtype in {dtype, torch.float32}:
        acc = (torch.randn(5000, generator=g) * 100).to(out_dtype)
        summed = kg.scale_(x.clone(), gs_a, gs_b, out=acc.clone(), accumulate=True)
        assert summed.dtype == out_dtype and torch.equal(summed, acc + want.to(out_dtype))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_cast_bf16_amax_is_autocasts_cast_and_its_amax(device):
    """A shared input's cast on the kernels (nvfp4._cast): x.to(bf16) bit for bit, ties to even
    (half the values sit exactly between two bf16 values), and max |.| of that copy, in one pass;
    a NaN anywhere gives a NaN amax, as torch's amax does."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, 37, 48, generator=g) * 10  # 333 blocks: a program takes 512, a masked tail
    ties = ((x.view(torch.int32) & -65536) | 0x8000).view(torch.float32)
    x = torch.where(torch.rand(x.shape, generator=g) < 0.5, x, ties).to(device)
    cast, amax = kq.cast_bf16_amax(x)
    want = x.to(torch.bfloat16)
    assert cast.dtype == torch.bfloat16 and torch.equal(cast, want)
    assert amax.dtype == torch.float32 and torch.equal(amax, want.float().abs().amax())
    x[1, 5, 7] = float("nan")
    assert torch.isnan(kq.cast_bf16_amax(x)[1])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_scale_into_is_torchs_branch_arithmetic(device):
    """LoRA-SVD's branch columns: x * beta / (s_ga * s_gb) with each step rounded to fp32 as torch
    rounds it, then once to bf16, into the left operand's last columns (rows a buffer's width
    apart), the other columns untouched."""
    g = torch.Generator().manual_seed(12)
    T, R, K = 300, 24, 40   # T not a multiple of the row tile; R not a power of two
    gs_a, gs_b = (torch.tensor(v, dtype=torch.float32, device=device) for v in (3.1e-3, 0.77))
    for beta in (1.0, 0.3):
        x = torch.randn(T, R, generator=g) * torch.exp(3 * torch.randn(T, R, generator=g))
        # half of them land within a few fp32 ulps of a bf16 tie: any other fp32 rounding of a step
        # moves some across it
        ties = (x.to(torch.bfloat16).float().view(torch.int32) | 0x8000).view(torch.float32)
        near = ties * (gs_a.cpu() * gs_b.cpu()) / beta
        x = torch.where(torch.arange(T)[:, None] % 2 == 0, x, near).to(device)
        buf = torch.randn(T, K + R, generator=g).to(device=device, dtype=torch.bfloat16)
        left = buf[:, :K].clone()
        kg.scale_into(buf[:, K:], x, beta, gs_a, gs_b)
        assert torch.equal(buf[:, K:], (x * beta / (gs_a * gs_b)).to(torch.bfloat16))
        assert torch.equal(buf[:, :K], left)


# --------------------------------------------------------------------------------------------------
# The linear layer's kernels (kernels/nvfp4_linear.py) in the interpreter



def test_wgrad_averages_to_the_unquantized_product():
    """Eq. 2 is unbiased (SR, H H^T = I) up to the block-scale clamp: the kernel route's dW averaged
    over fresh draws approaches dY^T X_hat far closer than one draw (the contract tests check each
    draw's bits)."""
    g = torch.Generator().manual_seed(22)
    T, I, O = 64, 32, 32
    dy = torch.randn(T, O, generator=g).bfloat16()
    xq = nvfp4.quantize(torch.randn(T, I, generator=g), (1, 16), "rtn")
    c = nvfp4.linear_contract(False)
    exact = dy.double().t() @ xq.dequantize(torch.bfloat16).double()
    dws = [kl.wgrad(dy, xq, c, nvfp4.random_hadamard(g),
                    (2 * i, 2 * i + 1)).double() for i in range(32)]  # the mean: ~1/32 of one
    assert nvfp4.relative_mse(exact, sum(dws) / len(dws)) < nvfp4.relative_mse(exact, dws[0]) / 10


# --------------------------------------------------------------------------------------------------
# bad input -> clear errors

def test_bad_inputs_raise_clear_errors():
    x = torch.randn(32, 64)
    with pytest.raises(ValueError, match="does not fit NVFP4 block"):
        kquantize(torch.randn(24, 64), (16, 1))
    with pytest.raises(ValueError, match="does not fit NVFP4 block"):
        kquantize(torch.randn(32, 40), (1, 16))
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match="non-finite"):
            kquantize(torch.tensor([[1.0] * 15 + [bad]] * 2), (1, 16))
    with pytest.raises(ValueError, match="1-D block"):
        kquantize(x, (16, 16), hadamard=torch.eye(16))
    with pytest.raises(ValueError, match=r"\(16, 16\) matrix"):
        kquantize(x, (1, 16), hadamard=torch.eye(8))
    for rounding in ("nearest", "rtz", "sr_down"):  # only the spec's (nvfp4.ROUNDINGS)
        with pytest.raises(ValueError, match="rounding"):
            kquantize(x, (1, 16), rounding=rounding)
    overlapping = torch.empty(31 * 48 + 64, dtype=torch.bfloat16).as_strided((32, 64), (48, 1))
    with pytest.raises(ValueError, match="out must be"):  # rows 48 apart, 64 wide: they overlap
        kq.quantize_dequant(x, out=overlapping)
    with pytest.raises(ValueError, match="contiguous fp32"):
        kq.cast_bf16_amax(torch.randn(64, 32).t())
    a, b = nvfp4.quantize(x, (1, 16)), nvfp4.quantize(torch.randn(16, 48), (1, 16))
    with pytest.raises(ValueError, match="contraction dims differ"):
        kg.nvfp4_gemm(a, b)
    with pytest.raises(ValueError, match="blocked along K"):
        kg.nvfp4_gemm(a, nvfp4.quantize(torch.randn(16, 64), (16, 1)))
    with pytest.raises(ValueError, match="blocked along K"):
        kg.nvfp4_gemm(a, nvfp4.quantize(torch.randn(64, 16), (1, 16)), trans_b=True)


# --------------------------------------------------------------------------------------------------
# GPU, full size (H200): kernels vs the reference run on CPU (the spec; see kernels/nvfp4_quant.py's
# note on torch's CUDA scalar division)

@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("four_over_six", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_quantize_rtn_bit_exact_4096(block, four_over_six, dtype):
    x = _heavy_tailed((4096, 4096), torch.Generator().manual_seed(0), dtype)
    k = kquantize(x.cuda(), block, "rtn", four_over_six)
    _same(k, nvfp4.quantize_reference(x, block, "rtn", four_over_six))


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
def test_gpu_sr_bit_exact_given_the_seed_and_unbiased(block):
    x = _heavy_tailed((4096, 4096), torch.Generator().manual_seed(1), torch.bfloat16)
    for rounding in ("sr", "sr_up"):
        _same(kquantize(x.cuda(), block, rounding, True, seed=2),
              nvfp4.quantize_reference(x, block, rounding, True, 2))
    row = torch.randn(4096)
    xs = row.repeat(4096, 1)
    d = kquantize(xs.cuda(), block, "sr", seed=3).dequantize().cpu()
    _assert_sr_unbiased(d, row, nvfp4.quantize_reference(xs, block, "rtn", False))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, on the interpreter's NaN casts
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("block", BLOCKS)
@pytest.mark.parametrize("rounding,four_over_six,rotate",
                         [("rtn", False, False), ("rtn", True, False), ("sr", True, False),
                          ("sr", True, True), ("sr_up", False, False)])
def test_a_nan_comes_out_nan(monkeypatch, device, block, rounding, four_over_six, rotate):
    """On a GPU no finiteness check runs (it would sync the host), so a NaN in x must come out of
    the kernels as the reference makes it: NaN in its block (E4M3's NaN scale; Triton's default
    max skips a NaN, on a GPU and in the interpreter alike, and quantized it to a finite
    +-6 s_b), the global amax NaN, every other value the reference's. On the CPU, whose check
    raises on a NaN, the check is lifted to run the kernels as a GPU does. Multiples of 1/8:
    every rotation exact in any summation order."""
    if device == "cpu":
        monkeypatch.setattr(kq, "_check_input", lambda *args: None)
    g = torch.Generator().manual_seed(9)
    n = 256 if device == "cuda" else 64
    x = torch.randint(-64, 65, (n, n), generator=g).float() / 8
    x[37, 21] = float("nan")
    H = nvfp4.random_hadamard(g) if rotate and block != (16, 16) else None
    k = kquantize(x.to(device), block, rounding, four_over_six, seed=4,
                  hadamard=None if H is None else H.to(device)).dequantize().cpu()
    xr = x if H is None else nvfp4.hadamard_transform(x, H, dim=-1 if block == (1, 16) else -2)
    r = nvfp4.quantize_reference(xr, block, rounding, four_over_six, 4).dequantize()
    assert r.isnan().any() and torch.equal(k.isnan(), r.isnan())
    assert torch.equal(k.nan_to_num(0.0), r.nan_to_num(0.0))


@pytest.mark.gpu
def test_gpu_dequantize_bit_exact():
    x = _heavy_tailed((4096, 4096), torch.Generator().manual_seed(8), torch.bfloat16)
    r = nvfp4.quantize_reference(x, (1, 16), "rtn", False)
    k = kquantize(x.cuda(), (1, 16))
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(kdequantize(k, dtype).cpu(), r.dequantize(dtype))
    assert torch.equal(kd.grid_values_bf16(k).float().cpu(), r.grid_values())


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_packed_source_bit_exact(dtype):
    """Eq. 2's X_hat decoded inside the cols kernel (on the GPU: the hardware bf16 cast) against
    quantizing the reference's dequantize(dtype) of the same packed X: every bit, 4096^2, SR +
    Hadamard + 4/6; and the grid-value decode (dequantize, hardware cast) against the reference."""
    g = torch.Generator().manual_seed(12)
    xq = nvfp4.quantize_reference(_heavy_tailed((4096, 4096), g, torch.bfloat16), (1, 16), "rtn",
                                  True)
    H = nvfp4.random_hadamard(g)
    want = kq.quantize_dequant(xq.dequantize(dtype).cuda(), (16, 1), "sr", True, seed=3,
                               hadamard=H, return_tensor=True)
    packed = nvfp4.NVFP4Tensor(xq.codes.cuda(), xq.scales.cuda(), xq.global_scale.cuda(),
                               xq.shape, xq.block)
    got = kq.quantize_dequant(packed, (16, 1), "sr", True, seed=3, hadamard=H, return_tensor=True,
                              source_dtype=dtype)
    for k, r in zip(got, want):
        assert torch.equal(k.reshape(-1).view(torch.uint8), r.reshape(-1).view(torch.uint8))
    assert torch.equal(kdequantize(packed, dtype).cpu(), xq.dequantize(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(1, 16), (16, 1)])
def test_gpu_hadamard_4096(block):
    g = torch.Generator().manual_seed(4)
    H = nvfp4.random_hadamard(g)
    x = (torch.randint(-64, 65, (4096, 4096), generator=g).float() / 8).to(torch.bfloat16)
    _same(kquantize(x.cuda(), block, "rtn", hadamard=H.cuda()), nvfp4.quantize_reference(
        nvfp4.hadamard_transform(x.float(), H, dim=-1 if block == (1, 16) else -2),
        block, "rtn", False))
    # generic bf16 values: tensor-core accumulation of the 16-term rotation may round differently
    x = torch.randn(4096, 4096, generator=g).to(torch.bfloat16)
    k = kquantize(x.cuda(), block, "rtn", hadamard=H.cuda())
    r = nvfp4.quantize_reference(
        nvfp4.hadamard_transform(x.float(), H, dim=-1 if block == (1, 16) else -2),
        block, "rtn", False)
    assert (k.codes.cpu() != r.codes).float().mean() < 1e-4
    assert (k.scales.view(torch.uint8).cpu() != r.scales.view(torch.uint8)).float().mean() < 1e-4


@pytest.mark.gpu
def test_gpu_gemm_layouts_and_fp32_out_4096():
    g = torch.Generator(device="cuda").manual_seed(6)
    a = kquantize(torch.randn(4096, 4096, device="cuda", generator=g), (1, 16))
    b = kquantize(torch.randn(4096, 4096, device="cuda", generator=g), (16, 16))
    c = kquantize(torch.randn(4096, 2048, device="cuda", generator=g), (16, 1))
    d = kquantize(torch.randn(4096, 1024, device="cuda", generator=g), (16, 1))
    gemm = lambda x, y, trans_a=False, trans_b=False: kg.nvfp4_gemm(x, y, torch.float32, trans_a,
                                                                    trans_b)
    # without torch.mm(out_dtype=float32) (older torch) the grid-value route rounds through bf16
    # once
    od = torch.float32 if kg._MM_FP32_OUT[0] else torch.bfloat16
    _check_gemm(gemm(a, b).to(od), a, b, out_dtype=od)
    _check_gemm(gemm(a, b, trans_b=True).to(od), a, b, trans_b=True, out_dtype=od)
    _check_gemm(gemm(c, d, True, True).to(od), c, d, trans_a=True, trans_b=True, out_dtype=od)
    _check_gemm(kg.nvfp4_gemm(a, b, torch.bfloat16), a, b, out_dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_grid_values_mm_widens_in_the_scale_pass():
    """dX for an fp32 x (nvfp4_linear.backward's dx_dtype): the bf16 result, scaled and rounded as
    ever, returned in fp32 by the scale pass itself, bit for bit the bf16 result's .float()."""
    g = torch.Generator(device="cuda").manual_seed(9)
    A = torch.randn(1000, 1040, device="cuda", generator=g).to(torch.bfloat16)
    B = torch.randn(1040, 3008, device="cuda", generator=g).to(torch.bfloat16)
    gs_a, gs_b = (torch.rand((), device="cuda", generator=g) * 1e-3 for _ in "ab")
    want = kg.grid_values_mm(A, B, gs_a, gs_b, torch.bfloat16)
    got = kg.grid_values_mm(A, B, gs_a, gs_b, torch.bfloat16, torch.float32)
    assert got.dtype == torch.float32 and torch.equal(got, want.float())


@pytest.mark.gpu
def test_gpu_gemm_odd_shapes():
    g = torch.Generator(device="cuda").manual_seed(7)
    a = kquantize(torch.randn(1000, 1040, device="cuda", generator=g), (1, 16))
    b = kquantize(torch.randn(3008, 1040, device="cuda", generator=g), (16, 16))
    _check_gemm(kg.nvfp4_gemm(a, b, torch.float32), a, b)


@pytest.mark.gpu
def test_gpu_nvfp4_matmul_folds_leading_dims():
    """nvfp4.nvfp4_matmul's kernel path (the seam folds a's leading dims into rows) against its CPU
    reference."""
    g = torch.Generator().manual_seed(8)
    a = nvfp4.quantize(torch.randn(3, 64, 256, generator=g).cuda(), (1, 16))
    b = nvfp4.quantize(torch.randn(128, 256, generator=g).cuda(), (16, 16))
    cpu = lambda t: nvfp4.NVFP4Tensor(t.codes.cpu(), t.scales.cpu(), t.global_scale.cpu(),
                                      t.shape, t.block)
    out = nvfp4.nvfp4_matmul(a, b)
    assert out.shape == (3, 64, 128)
    ref = nvfp4.nvfp4_matmul(cpu(a), cpu(b))
    assert torch.allclose(out.cpu(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.gpu
def test_gpu_linear_matches_the_reference():
    """NVFP4Linear on the GPU (kernels/nvfp4_linear.py: on the H200 quantize kernels writing bf16
    grid values, cuBLAS, the scale pass): the forward equals the reference's quantized product up to
    the bf16 output rounding, and the SR backward averages to the straight-through gradients dY Q(W)
    and dY^T Q(X) (eq. 2 is unbiased)."""
    torch.manual_seed(0)
    T, I, O = 2048, 512, 256
    layer = nvfp4.NVFP4Linear(I, O).cuda()
    x = (torch.randn(T, I, device="cuda") * torch.exp(torch.randn(T, I, device="cuda"))).bfloat16()
    x.requires_grad_()
    y = layer(x)
    xq_ref = nvfp4.quantize_reference(x.detach().cpu(), (1, 16), "rtn", False)
    wq_ref = nvfp4.quantize_reference(layer.weight.detach().cpu(), (16, 16), "rtn", False)
    _same(nvfp4.packed(*y.grad_fn.saved_tensors[:3], (1, 16)), xq_ref)
    # W's forward grid values, kept for dX (Q16x16(W) reused, not re-decoded)
    wv, _, s_gw = y.grad_fn.saved_tensors[3:6]
    assert torch.equal(wv.cpu(), wq_ref.grid_values().bfloat16()) \
        and torch.equal(s_gw.cpu(), wq_ref.global_scale)
    ref = xq_ref.dequantize().double() @ wq_ref.dequantize().double().t()
    err = (y.detach().cpu().double() - ref).abs()
    assert (err <= 2 ** -7 * ref.abs() + 1e-6 * ref.abs().max()).all(), err.max()
    dy = torch.randn(T, O, device="cuda").bfloat16()
    ste_dx = dy.cpu().double() @ wq_ref.dequantize().double()
    ste_dw = dy.cpu().double().t() @ xq_ref.dequantize().double()
    n, dxs, dws = 64, 0, 0
    for _ in range(n):
        x.grad = layer.weight.grad = None
        layer(x).backward(dy)
        dxs, dws = dxs + x.grad.cpu().double() / n, dws + layer.weight.grad.cpu().double() / n
    one = nvfp4.relative_mse(ste_dw, layer.weight.grad.cpu().double())
    assert nvfp4.relative_mse(ste_dw, dws) < one / 20
    assert nvfp4.relative_mse(ste_dx, dxs) < 1e-3 and nvfp4.relative_mse(ste_dw, dws) < 1e-3


AMPERE_PATH = """
import torch, triton.language as tl
from kernels import nvfp4_math
nvfp4_math.HW_E4M3 = tl.constexpr(False)  # Ampere's row of kernels/targets.py, before any compile
import nvfp4
from test_kernels_nvfp4 import _same, kdequantize, kquantize
g = torch.Generator().manual_seed(0)
for block, rounding, fos in (((1, 16), "rtn", False), ((16, 16), "rtn", True),
                             ((16, 1), "sr", False), ((1, 16), "sr_up", True)):
    x = torch.randn(256, 512, generator=g)
    x = x * torch.exp(torch.randn(256, 1, generator=g) * 4)
    k = kquantize(x.to(DEVICE), block, rounding, fos, seed=5)
    r = nvfp4.quantize_reference(x, block, rounding, fos, 5)
    _same(k, r)
    assert torch.equal(kdequantize(k, torch.float32).cpu(), r.dequantize())
print("same bits")
"""


@pytest.mark.gpu
def test_gpu_ampere_e4m3_path_gives_the_same_bits():
    """Ampere's kernels (no fp8 type: E4M3 rounding and scale decoding by integer arithmetic,
    nvfp4_math.HW_E4M3 False) run on this GPU: the same bits as the reference for RTN, 4/6, SR and
    SR-up, quantize and dequantize. A subprocess: HW_E4M3 is read at import."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(here), here]))
    out = subprocess.run([sys.executable, "-c", "DEVICE = 'cuda'\n" + AMPERE_PATH], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "same bits" in out.stdout, out.stderr[-3000:]
