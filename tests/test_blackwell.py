"""Blackwell's route: every FP4 product of the fullstack step on the NVFP4 tensor cores, in one
kernel (kernels/nvfp4_gemm.py: tl.dot_scaled with e2m1 operands and E4M3 block-16 scales),
checked as far as a machine without a Blackwell GPU allows:

  numerics  each product runs in Triton's interpreter (Triton >= 3.8; CI installs 3.9.0) on
            fresh seeded random inputs, edge shapes included, and equals the reference:
            nvfp4.nvfp4_matmul's CPU path on the same packed operands (built with
            nvfp4.quantize), up to fp32 summation order. tests/interpreter_nvfp4_scales.py makes
            the interpreter decode E4M3 scales as the hardware does.
            The GEMM products run on each FP4 tile table of kernels/targets.py (sm_100: 10.x,
            sm_120: 12.x's smaller tiles; `-k sm_120` selects those).
  lowering  tests/test_targets.py: every launch compiles for 10.x and 12.x (and the rest of the
            matrix) and its FP4 products lower to the block-scaled FP4 MMA.
Neither speed nor numerics on Blackwell hardware is tested here (docs/blackwell.md).
"""

import os

import pytest
import torch

import nvfp4
from interpreter_nvfp4_scales import e4m3_dot_scaled_scales, interpreter_dot_scaled_skip_reason
from kernels import nvfp4_gemm, targets

SKIP_INTERPRETED = interpreter_dot_scaled_skip_reason()
needs_interpreted_dot_scaled = pytest.mark.skipif(
    SKIP_INTERPRETED is not None or os.environ.get("TRITON_INTERPRET") != "1",
    reason=SKIP_INTERPRETED or "runs the Blackwell kernel in the interpreter (TRITON_INTERPRET=1)")


# --------------------------------------------------------------------------------------------
# Numerics, in the interpreter

# the FP4 rows of kernels/targets.py, one per tile table
BLACKWELL = {"sm_100": (10, 0), "sm_120": (12, 0)}


@pytest.fixture(params=list(BLACKWELL))
def blackwell_route(request, monkeypatch):
    """nvfp4_gemm.nvfp4_gemm as a Blackwell GPU of each tile table runs it (CPU tensors taken for
    that GPU by kernels/targets.py), in the interpreter."""
    monkeypatch.setattr(targets, "capability", lambda device: BLACKWELL[request.param])
    assert nvfp4_gemm.use_dot_scaled(torch.device("cpu"))
    with e4m3_dot_scaled_scales():
        yield nvfp4_gemm.nvfp4_gemm


def check_product(gemm, a, b, trans_a=False, trans_b=False, out_dtype=torch.float32):
    """The Blackwell product of packed a, b equals nvfp4.nvfp4_matmul's CPU path: fp32 sums in
    another order (each product of E2M1 values and E4M3 scales is exact in fp32), then one
    rounding to out_dtype."""
    out = gemm(a, b, out_dtype, trans_a=trans_a, trans_b=trans_b)
    ref = nvfp4.nvfp4_matmul(a, b, torch.float32, trans_a, trans_b)
    abs_a = nvfp4.NVFP4Tensor(a.codes & 0x77, a.scales, a.global_scale, a.shape, a.block)  # |a_hat|
    abs_b = nvfp4.NVFP4Tensor(b.codes & 0x77, b.scales, b.global_scale, b.shape, b.block)
    bound = nvfp4.nvfp4_matmul(abs_a, abs_b, torch.float32, trans_a, trans_b)  # sum of |products|
    assert out.dtype == out_dtype and out.shape == ref.shape
    K = a.shape[0] if trans_a else a.shape[1]
    ulp = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -10}
    err = (out.float() - ref).abs()  # K terms summed in any order: within K 2^-24 sum |terms|
    assert bool((err <= K * 2.0 ** -24 * bound + ulp[out_dtype] * ref.abs()).all()), \
        f"max error {err.max().item():.3g} (largest |ref| {ref.abs().max().item():.3g})"
    assert ref.abs().max() > 0
    return out


def randn(*shape, seed, scale=1.0):
    """Seeded inputs with a spread of magnitudes per row (so block scales differ)."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.exp(torch.randn(shape[0], 1, generator=g))
    return torch.randn(shape, generator=g) * scale * spread


@needs_interpreted_dot_scaled
def test_the_interpreter_needs_the_e4m3_scale_helper():
    """Without tests/interpreter_nvfp4_scales.py the interpreter decodes E4M3 scales as E8M0 and the
    product is wrong; if this fails, Triton decodes them itself now: delete the helper."""
    a = nvfp4.quantize(randn(32, 64, seed=1), (1, 16))
    b = nvfp4.quantize(randn(32, 64, seed=2), (1, 16))
    ref = nvfp4.nvfp4_matmul(a, b)
    out = nvfp4_gemm._gemm_sm100(a, b, torch.float32)
    assert not torch.allclose(out, ref, rtol=1e-2, atol=1e-3 * ref.abs().max().item())
    with e4m3_dot_scaled_scales():
        out = nvfp4_gemm._gemm_sm100(a, b, torch.float32)
    assert torch.allclose(out, ref, rtol=1e-6, atol=1e-6)


# (tokens T, in, out): M past the 128-row tile and not a multiple of it; the smallest K (16, 48, 64)
LINEAR_SHAPES = [(200, 512, 96), (37, 16, 48), (130, 48, 272), (64, 64, 32)]


@needs_interpreted_dot_scaled
@pytest.mark.parametrize("T,n_in,n_out", LINEAR_SHAPES)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_blackwell_linear_forward(blackwell_route, T, n_in, n_out, out_dtype):
    """Y = Q1x16(X) Q16x16(W)^T, RTN (4/6 as nvfp4_46 uses it)."""
    xq = nvfp4.quantize(randn(T, n_in, seed=T), (1, 16), "rtn", four_over_six=True)
    w = randn(n_out, n_in, seed=n_out, scale=0.02)
    wq = nvfp4.quantize(w, (16, 16), "rtn", four_over_six=True)
    check_product(blackwell_route, xq, wq, out_dtype=out_dtype)


@needs_interpreted_dot_scaled
@pytest.mark.parametrize("T,n_in,n_out", LINEAR_SHAPES)
def test_blackwell_linear_dgrad(blackwell_route, T, n_in, n_out):
    """dX = Q1x16(dY, SR) Q16x16(W): W's forward quantization, stored (out, in), read
    transposed."""
    g = torch.Generator().manual_seed(T + n_in)
    dyq = nvfp4.quantize(randn(T, n_out, seed=T + 1, scale=1e-3), (1, 16), "sr", generator=g)
    wq = nvfp4.quantize(randn(n_out, n_in, seed=n_out, scale=0.02), (16, 16), "rtn")
    check_product(blackwell_route, dyq, wq, trans_b=True, out_dtype=torch.bfloat16)


@needs_interpreted_dot_scaled
@pytest.mark.parametrize("T,n_in,n_out",
                         [(512, 96, 200), (16, 48, 32), (48, 272, 130), (64, 32, 64)])
def test_blackwell_linear_wgrad(blackwell_route, T, n_in, n_out):
    """Eq. 2, dW = Q1x16(dY^T H) Q16x1(H^T X_hat): both operands quantized as stored, (T, out)
    and (T, in), with 16x1 blocks along T (SR, one random Hadamard), read transposed; K = T."""
    g = torch.Generator().manual_seed(T + n_out)
    H = nvfp4.random_hadamard(generator=g)
    dy = randn(T, n_out, seed=T, scale=1e-3)
    dyq = nvfp4.quantize(dy, (16, 1), "sr", generator=g, hadamard=H)
    xq = nvfp4.quantize(randn(T, n_in, seed=T + 2), (16, 1), "sr", generator=g, hadamard=H)
    check_product(blackwell_route, dyq, xq, trans_a=True, trans_b=True)


@needs_interpreted_dot_scaled
@pytest.mark.parametrize("T,n_in,n_out,rank", [(200, 256, 96, 16), (37, 64, 48, 8)])
def test_blackwell_lora_svd_residual(blackwell_route, T, n_in, n_out, rank):
    """LoRA-SVD (§3.2): the NVFP4 residual W_res = W - L2 L1 on the FP4 MMA, forward and dgrad
    (the BF16 branch (beta X L1^T) L2^T is a bf16 GEMM beside it, not an FP4 product)."""
    import lora_svd
    W = randn(n_out, n_in, seed=n_in, scale=0.02)
    U, S, Vh = lora_svd.top_r_svd(W, rank)
    W_res, L1, L2 = lora_svd.split_from_svd(W, U, S, Vh, 1.0)
    wq = nvfp4.quantize(W_res, (16, 16), "rtn", four_over_six=True)
    xq = nvfp4.quantize(randn(T, n_in, seed=T), (1, 16), "rtn", four_over_six=True)
    check_product(blackwell_route, xq, wq, out_dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(T)
    dyq = nvfp4.quantize(randn(T, n_out, seed=T + 3, scale=1e-3), (1, 16), "sr", generator=g)
    check_product(blackwell_route, dyq, wq, trans_b=True)


@needs_interpreted_dot_scaled
@pytest.mark.parametrize("m,n", [(48, 80), (64, 64), (144, 272)])
def test_blackwell_newton_schulz_gemms(blackwell_route, m, n):
    """Root's NVFP4 Newton-Schulz step (optim._ns_step_nvfp4, §3.4), X (m, n), m <= n, every
    operand Q1x16(. H) with RTN + 4/6: A = qX qX^T, qA qA'^T, qB qX'^T."""
    g = torch.Generator().manual_seed(m * n)
    H = nvfp4.random_hadamard(generator=g)
    q = lambda t: nvfp4.quantize(t, (1, 16), "rtn", four_over_six=True, hadamard=H)
    X = randn(m, n, seed=m + n)
    X = X / X.norm()
    qX = q(X)
    A = check_product(blackwell_route, qX, qX)                                # (m, m), K = n
    B = 2.0 * A + check_product(blackwell_route, q(A), q(A.t()))              # K = m
    check_product(blackwell_route, q(B), q(X.t()))                            # (m, n), K = m


def _first_columns(t, n):
    """The first n (a multiple of 16) logical columns of a packed t blocked along them, as
    strided views."""
    return nvfp4.NVFP4Tensor(t.codes[:, :n // 2], t.scales[:, :n // 16], t.global_scale,
                             (t.shape[0], n), t.block)


@needs_interpreted_dot_scaled
def test_blackwell_route_takes_strided_operands_and_checks_blocks(blackwell_route):
    """Non-contiguous stored operands (their strides go to the kernel), and the entry's error for an
    operand not blocked along K."""
    xq = _first_columns(nvfp4.quantize(randn(64, 192, seed=5), (1, 16)), 96)
    wq = _first_columns(nvfp4.quantize(randn(160, 192, seed=6), (16, 16)), 96)
    assert not xq.codes.is_contiguous() and not wq.scales.is_contiguous()
    check_product(blackwell_route, xq, wq)
    with pytest.raises(ValueError, match="blocked along K"):
        blackwell_route(xq, nvfp4.quantize(randn(96, 64, seed=7), (16, 1)))


# --------------------------------------------------------------------------------------------
# The layers on the Blackwell route: NANOFP4_ROUTE=kernels with use_dot_scaled forced, in the
# interpreter, against the reference route (nvfp4.py, lora_svd.py, optim.py) with the same draws

@pytest.fixture
def blackwell_gpu(monkeypatch):
    """The kernel routes as a Blackwell GPU takes them; counts the FP4 GEMM launches, and fails any
    call to the grid-value route (Hopper's)."""
    from kernels import nvfp4_linear
    calls = []
    sm100 = nvfp4_gemm._gemm_sm100

    def counted(*args, **kwargs):
        calls.append(args[3:5] if len(args) > 3 else (kwargs.get("trans_a"), kwargs.get("trans_b")))
        return sm100(*args, **kwargs)

    def hopper(*args, **kwargs):
        raise AssertionError("the grid-value GEMM ran on the Blackwell route")

    for module in (nvfp4_gemm, nvfp4_linear):
        monkeypatch.setattr(module, "use_dot_scaled", lambda device: True)
        monkeypatch.setattr(module, "grid_values_mm", hopper)
    monkeypatch.setattr(nvfp4_gemm, "_gemm_sm100", counted)
    with e4m3_dot_scaled_scales():
        yield calls


def on_grid(shape, seed, scale=8.0):
    """Seeded values k / scale, |k| <= 127: exact in bf16, and 16-term Hadamard sums of them are
    exact in fp32 in any order (the kernels' butterfly and the reference's matmul agree)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-127, 128, shape, generator=g).float() / scale


def routes(monkeypatch, step, calls):
    """step() on the reference route, then on the Blackwell route, from the same global RNG state
    (the same SR seeds and Hadamard signs); -> (reference outputs, Blackwell outputs, FP4 GEMMs)."""
    out = []
    for route in ("reference", "kernels"):
        monkeypatch.setenv("NANOFP4_ROUTE", route)
        torch.manual_seed(7)
        calls.clear()
        out.append(step())
    return out[0], out[1], list(calls)


def close(a, b, rel):
    err = (a.double() - b.double()).abs().max().item()
    assert err <= rel * b.double().abs().max().item(), (err, b.double().abs().max().item())


def backward_step(layer, weight, x, dy):
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = layer(x)
    y.backward(dy)
    return y.detach(), x.grad, weight.grad


@needs_interpreted_dot_scaled
@pytest.mark.parametrize("T,n_in,n_out", [(80, 48, 32), (144, 64, 160)])
def test_blackwell_nvfp4_linear_layer_equals_the_reference(blackwell_gpu, monkeypatch, T, n_in,
                                                           n_out):
    """nvfp4.NVFP4Linear (4/6) forward and backward: Y, dX (W's packed forward quantization read
    transposed) and eq. 2's dW (both 16x1 operands read transposed), all three on the FP4 MMA."""
    torch.manual_seed(T)
    layer = nvfp4.NVFP4Linear(n_in, n_out, four_over_six=True)
    x, dy = on_grid((T, n_in), T), on_grid((T, n_out), T + 1, scale=64.0)
    ref, bw, calls = routes(monkeypatch, lambda: backward_step(layer, layer.weight, x, dy),
                            blackwell_gpu)
    assert calls == [(False, False), (False, True), (True, True)]
    for name, r, b in zip(("Y", "dX", "dW"), ref, bw):
        assert r.dtype == b.dtype and r.shape == b.shape, name
        close(b, r, rel=1e-6)


@needs_interpreted_dot_scaled
def test_blackwell_lora_svd_layer_equals_the_reference(blackwell_gpu, monkeypatch):
    """lora_svd.LoRASVDLinear: the NVFP4 residual's Y, dX and dW on the FP4 MMA, the BF16 branch
    as two bf16 GEMMs beside it, as the reference computes it."""
    import lora_svd
    torch.manual_seed(3)
    layer = lora_svd.LoRASVDLinear(48, 32, rank=8, beta=0.5)
    x, dy = on_grid((64, 48), 11), on_grid((64, 32), 12, scale=64.0)
    ref, bw, calls = routes(monkeypatch, lambda: backward_step(layer, layer.weight_res, x, dy),
                            blackwell_gpu)
    assert calls == [(False, False), (False, True), (True, True)]
    for name, r, b in zip(("Y", "dX", "dW"), ref, bw):
        assert r.dtype == b.dtype and r.shape == b.shape, name
        close(b, r, rel=1e-6)


@needs_interpreted_dot_scaled
def test_blackwell_root_step_equals_the_reference(blackwell_gpu, monkeypatch):
    """optim.Root with NVFP4 Newton-Schulz (§3.4): 5 NS steps x 3 GEMMs per matrix on the FP4 MMA;
    the parameter after two steps equals the reference's up to summation order."""
    import optim

    def root_steps():
        g = torch.Generator().manual_seed(9)
        p = torch.nn.Parameter(torch.randn(64, 128, generator=g) * 0.02)
        opt = optim.Root([p], lr=1e-2, states="nvfp4")
        for _ in range(2):
            p.grad = torch.randn(64, 128, generator=g)
            opt.step()
        return p.detach().clone()

    ref, bw, calls = routes(monkeypatch, root_steps, blackwell_gpu)
    assert calls == [(False, False)] * 30
    close(bw, ref, rel=1e-5)


# --------------------------------------------------------------------------------------------
# Attention's FP4 products (kernels/flash_attention.py, FP4_MMA): Q K^T in the forward and both
# backward passes, dO V^T and P^T dO where the policy quantizes dO; the products that contract
# over T with an operand blocked along D (P V, dS K, dS^T Q) stay on the bf16 MMA
# (docs/blackwell.md)

# packed operands a launch takes to the FP4 MMA: forward Q, K; dK/dV Q, K (+ V, dO, dO^T);
# dQ Q, K (+ V, dO)
ATTENTION_PACKED = {"fp4": [2, 2, 2], "fp4_pv": [2, 2, 2], "fp4_dov": [2, 4, 4],
                    "fp4_all": [2, 5, 4]}


@pytest.fixture
def blackwell_attention(monkeypatch):
    """attention.py's kernel route as a Blackwell GPU takes it (FP4_MMA), on CPU tensors in the
    interpreter; yields the number of packed operands of each flash launch."""
    from kernels import flash_attention as fa
    counts, packed = [], fa._packed

    def counted(*tensors):
        counts.append(sum(t is not None for t in tensors))
        return packed(*tensors)

    monkeypatch.setattr(fa, "use_dot_scaled", lambda device: True)
    monkeypatch.setattr(fa, "_packed", counted)
    with e4m3_dot_scaled_scales():
        yield counts


def attention_grads(q, k, v, do, policy, causal, route):
    """O, dQ, dK, dV of attention.attention on route (NANOFP4_ROUTE) with the SR draws of seed
    5."""
    import attention
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.manual_seed(5)
    with pytest.MonkeyPatch.context() as m:
        m.setenv("NANOFP4_ROUTE", route)
        o = attention.attention(*xs, causal=causal, policy=policy)
        return (o, *torch.autograd.grad(o, xs, do))


def check_attention(counts, policy, causal, T, D, H=4, Hkv=2):
    """The Blackwell kernels equal attention.py's reference with the same draws: fp32 sums in
    another order, then the same roundings (as tests/test_attention.py's kernel == reference)."""
    g = torch.Generator().manual_seed(T * D + H)
    q, k, v, do = (torch.randn(1, h, T, D, generator=g) for h in (H, Hkv, Hkv, H))
    v = v + 3.0  # |D_i| >> |dP - D|: a stray P on a padded key would own its dS block's amax
    ref = attention_grads(q, k, v, do, policy, causal, "reference")
    counts.clear()
    out = attention_grads(q, k, v, do, policy, causal, "kernels")
    assert counts == ATTENTION_PACKED[policy]
    for name, a, b in zip(("O", "dQ", "dK", "dV"), out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert nvfp4.relative_mse(b, a) < 1e-10, (name, nvfp4.relative_mse(b, a))


@needs_interpreted_dot_scaled
@pytest.mark.parametrize("policy,causal,T,D", [
    ("fp4", True, 37, 64), ("fp4", False, 37, 128), ("fp4_pv", True, 40, 64),
    ("fp4_dov", False, 50, 64), ("fp4_all", True, 70, 128), ("fp4_all", False, 37, 64)])
def test_blackwell_attention_equals_the_reference(blackwell_attention, policy, causal, T, D):
    """Forward and backward of each FP4 policy with FP4_MMA, GQA (4 query heads on 2 kv heads), T
    not a multiple of any tile; the interpreter's small tiles."""
    check_attention(blackwell_attention, policy, causal, T, D)


@needs_interpreted_dot_scaled
def test_blackwell_attention_on_its_gpu_tiles(blackwell_attention, monkeypatch):
    """fp4_all (every FP4 product) on the tiles a Blackwell GPU runs (SM100_CONFIGS: 128-row
    tiles, a 64-query tile for P^T dO's contraction), T a multiple of neither."""
    from kernels import flash_attention as fa
    monkeypatch.setattr(fa, "INTERPRET_CONFIGS", {
        kind: {k: c[k] for k in ("BLOCK_M", "BLOCK_N")} for kind, c in fa.SM100_CONFIGS.items()})
    check_attention(blackwell_attention, "fp4_all", True, 150, 64, H=2, Hkv=1)
