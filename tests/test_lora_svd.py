"""LoRA-SVD (paper §3.2, App. 8-9): init, eqs. 1-4 against float64, realignment, naive LoRA, kernels."""
import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn

import lora_svd
import nvfp4
from kernels import nvfp4_linear, nvfp4_quant

T, IN, OUT, R = 32, 64, 48, 8


def f64(t):
    return t.detach().double()


def assert_close64(actual, expected, rel=2e-6):
    """fp32-rounding agreement with a float64 result, relative to the result's largest entry."""
    err = (f64(actual) - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max error {err:.3g} vs scale {expected.abs().max().item():.3g}"


def branch(a, A, B):
    """(a A^T) B^T as lora_svd.BRANCH "bf16" computes it: bf16 operands, the rank-r intermediate
    accumulated in fp32 and rounded to bf16; the last product in float64 (the exact sum)."""
    bf = lambda t: t.detach().bfloat16().float()
    return f64((bf(a) @ bf(A).t()).bfloat16()) @ f64(bf(B)).t()


def make_layer(beta=1.0, seed=0, bias=False):
    torch.manual_seed(seed)
    return lora_svd.LoRASVDLinear.from_linear(nn.Linear(IN, OUT, bias=bias), R, beta=beta)


def planted_weight(out_f, in_f, rank, gen, gap=20.0):
    """A weight with `rank` strong singular directions over a Gaussian bulk (a 'trained-like' spectrum)."""
    U, _ = torch.linalg.qr(torch.randn(out_f, rank, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(in_f, rank, generator=gen))
    s = gap * torch.linspace(2.0, 1.0, rank)
    return (U * s) @ V.t() + torch.randn(out_f, in_f, generator=gen)


def with_spectrum(s, rows, cols, gen):
    """A float32 (rows, cols) matrix U diag(s) V^T, U and V random with orthonormal columns
    (float64 QR): a chosen spectrum, hence a chosen condition number."""
    U, _ = torch.linalg.qr(torch.randn(rows, len(s), generator=gen, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(cols, len(s), generator=gen, dtype=torch.float64))
    return ((U * s) @ V.t()).float()


# ---------------------------------------------------------------------------------------------------------- init

@pytest.mark.parametrize("beta", [1.0, 0.25])
def test_init_reconstructs_weight_and_is_top_r_svd(beta):
    torch.manual_seed(1)
    lin = nn.Linear(IN, OUT)
    layer = lora_svd.LoRASVDLinear.from_linear(lin, R, beta=beta)
    W = lin.weight.detach()
    recon = layer.weight_res + beta * (layer.L2 @ layer.L1)  # the fp32 sum the forward represents
    # exact up to one fp32 rounding per element
    assert (recon - W).abs().max() <= 2 * torch.finfo(torch.float32).eps * W.abs().max()
    torch.testing.assert_close(layer.bias, lin.bias)
    # beta L2 L1 is the best rank-r approximation, with the singular values split evenly between L1 and L2
    U, S, Vh = torch.linalg.svd(W.double())
    best = (U[:, :R] * S[:R]) @ Vh[:R]
    assert_close64(beta * (layer.L2 @ layer.L1), best, rel=1e-5)
    assert_close64(layer.L2.t() @ layer.L2, torch.diag(S[:R] / beta), rel=1e-5)
    assert_close64(layer.L1 @ layer.L1.t(), torch.diag(S[:R] / beta), rel=1e-5)


@pytest.mark.parametrize("rank", [0, -1, OUT + 1, 2.5])
def test_bad_rank_raises(rank):
    for cls in (lora_svd.LoRASVDLinear, lora_svd.NaiveLoRALinear):
        with pytest.raises(ValueError, match="rank"):
            cls(IN, OUT, rank)


def test_bad_features_raise():
    with pytest.raises(ValueError, match="multiples of 16"):
        lora_svd.LoRASVDLinear(IN, 40, 4)


# ---------------------------------------------------------------------------------------------------- eqs. 1-2

@pytest.mark.parametrize("four_over_six", [True, False])
@pytest.mark.parametrize("sr", ["sr", "sr_up"])
def test_forward_backward_match_float64_eqs_1_2(four_over_six, sr, monkeypatch):
    for name in ("dgrad.dy", "wgrad.dy", "wgrad.x"):  # the gradients' SR mode, as a fork sets it
        monkeypatch.setitem(nvfp4.LINEAR, name, dataclasses.replace(nvfp4.LINEAR[name], rounding=sr))
    beta = 0.5
    layer = make_layer(beta=beta, seed=2)
    layer.four_over_six = four_over_six
    x = torch.randn(2, T // 2, IN, requires_grad=True)  # (B, T, C): leading dims are flattened
    dy = torch.randn(2, T // 2, OUT)
    torch.manual_seed(123)  # the backward's SR and Hadamard draw from the global RNG
    y = layer(x)
    y.backward(dy)

    x2, dy2 = x.detach().reshape(T, IN), dy.reshape(T, OUT)
    fos = four_over_six
    qx = nvfp4.quantize(x2, (1, 16), "rtn", fos)
    qw = nvfp4.quantize(layer.weight_res.detach(), (16, 16), "rtn", fos)
    # eq. 1, Y: NVFP4 GEMM on the residual + the branch
    y_ref = f64(qx.dequantize()) @ f64(qw.dequantize()).t() + beta * branch(x2, layer.L1, layer.L2)
    assert_close64(y.reshape(T, OUT), y_ref)
    # replay the backward's draws in order: dX's SR seed, then eq. 2's Hadamard and its two SR seeds
    torch.manual_seed(123)
    seed_dx, H, seed_dy, seed_x = nvfp4.sr_seed(), nvfp4.random_hadamard(), nvfp4.sr_seed(), nvfp4.sr_seed()
    q_dy = nvfp4.quantize(dy2, (1, 16), sr, fos, seed=seed_dx)
    q_dyt = nvfp4.quantize(dy2, (16, 1), sr, fos, hadamard=H, seed=seed_dy)  # Q16x1(H^T dY)  (T, out)
    q_hx = nvfp4.quantize(qx.dequantize(), (16, 1), sr, fos, hadamard=H, seed=seed_x)  # Q16x1(H^T Q(X))
    # eq. 1, dX: Q16x16(W_res) reused untransposed-requantized + branch
    dx_ref = f64(q_dy.dequantize()) @ f64(qw.dequantize()) + beta * branch(dy2, layer.L2.t(), layer.L1.t())
    assert_close64(x.grad.reshape(T, IN), dx_ref)
    # eq. 2, dW
    dw_ref = f64(q_dyt.dequantize()).t() @ f64(q_hx.dequantize())
    assert_close64(layer.weight_res.grad, dw_ref)
    # the rotations cancel: dW estimates dY^T Q(X) (a wrongly placed H would give ~100% error)
    exact = f64(dy2).t() @ f64(qx.dequantize())
    assert (dw_ref - exact).norm() / exact.norm() < 0.3
    # LoRA grads are deferred to project_gradients: autograd gives none (no zeros to fill and add)
    assert layer.L1.grad is None and layer.L2.grad is None


def bf16_ulps(actual, exact):
    """max |actual - exact| in units of the bf16 spacing at exact (2^(e - 8) for |exact| in
    [2^(e-1), 2^e)), over the entries |exact| >= 1/16: there fp32's accumulation error is a few
    hundredths of a spacing on any CPU, where a cancelling sum could make it any number of them."""
    _, e = torch.frexp(exact.float())
    ulps = (f64(actual) - exact).abs() / torch.ldexp(torch.ones_like(exact), e - 8)
    return ulps[exact.abs() >= 1 / 16].max().item()


def test_bf16_y_and_dx_are_the_fp32_sum_rounded_once():
    """Under bf16 autocast, Y and dX sum the NVFP4 product and beta times the branch in fp32 and
    round once: within half a bf16 spacing of the exact sum (and fp32's accumulation error).
    Rounding the product to bf16 before adding the branch errs by up to a whole one. (The Hopper
    kernels round the branch's intermediate elsewhere, kernels/nvfp4_linear.py says where; their
    tests compare them with the reference.)"""
    beta = 0.5
    layer = make_layer(beta=beta, seed=2)
    x = torch.randn(T, IN, requires_grad=True)
    dy = torch.randn(T, OUT).bfloat16()
    torch.manual_seed(123)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.backward(dy)
    assert y.dtype == torch.bfloat16
    xb = x.detach().bfloat16().float()  # autocast's copy, what the layer quantizes
    qx = nvfp4.quantize(xb, (1, 16), "rtn", True)
    qw = nvfp4.quantize(layer.weight_res.detach(), (16, 16), "rtn", True)
    y_exact = (f64(qx.dequantize()) @ f64(qw.dequantize()).t()
               + beta * branch(xb, layer.L1, layer.L2))
    torch.manual_seed(123)
    q_dy = nvfp4.quantize(dy.float(), (1, 16), "sr", True, seed=nvfp4.sr_seed())
    dx_exact = (f64(q_dy.dequantize()) @ f64(qw.dequantize())
                + beta * branch(dy, layer.L2.t(), layer.L1.t()))
    assert bf16_ulps(y, y_exact) <= 0.53 and bf16_ulps(x.grad, dx_exact) <= 0.53


def test_bias_and_input_grad_flags():
    layer = make_layer(seed=3, bias=True)
    x = torch.randn(T, IN)  # no grad needed for x
    y = layer(x)
    y.sum().backward()
    torch.testing.assert_close(layer.bias.grad, torch.full((OUT,), float(T)))
    assert layer.weight_res.grad is not None and x.grad is None


# ---------------------------------------------------------------------------------------------------- eqs. 3-4

def backward_once(layer, seed):
    torch.manual_seed(seed)  # inputs and the backward's SR / Hadamard draws
    x = torch.randn(T, IN)
    dy = torch.randn(T, OUT)
    layer(x).backward(dy)


def projection_reference(layer, dW):
    """eqs. 3-4 in float64 with Householder bases: dW_LoRA = P2 dW P1 does not depend on the basis."""
    Q2 = torch.linalg.qr(f64(layer.L2))[0]
    Q1 = torch.linalg.qr(f64(layer.L1).t())[0]
    dW_lora = Q2 @ (Q2.t() @ dW @ Q1) @ Q1.t()
    b = layer.beta
    return dW - dW_lora, b * f64(layer.L2).t() @ dW_lora, b * dW_lora @ f64(layer.L1).t(), Q1, Q2


def test_projection_matches_float64_and_removes_subspace():
    layer = make_layer(beta=0.5, seed=4)
    backward_once(layer, 0)
    dW = f64(layer.weight_res.grad)
    lora_svd.project_all(nn.Sequential(nn.Identity(), nn.Sequential(layer)))  # walks nested modules
    dres_ref, dl1_ref, dl2_ref, Q1, Q2 = projection_reference(layer, dW)
    assert_close64(layer.weight_res.grad, dres_ref, rel=1e-5)
    assert_close64(layer.L1.grad, dl1_ref, rel=1e-5)
    assert_close64(layer.L2.grad, dl2_ref, rel=1e-5)
    # dW_res has no component in span(L2) x span(L1), and the split is not trivial
    assert (Q2.t() @ f64(layer.weight_res.grad) @ Q1).abs().max() < 1e-5 * dW.abs().max()
    assert dl1_ref.norm() > 1e-2 * dW.norm()


def test_projection_commutes_with_accumulation():
    layer = make_layer(seed=5)
    ref = make_layer(seed=5)
    # layer: project after every micro-batch; ref: accumulate two micro-batches, project once
    for seed in (10, 11):
        backward_once(layer, seed)
        lora_svd.project_gradients(layer)
        backward_once(ref, seed)
    lora_svd.project_all(ref)
    for a, b in zip((layer.weight_res, layer.L1, layer.L2), (ref.weight_res, ref.L1, ref.L2)):
        assert_close64(a.grad, f64(b.grad), rel=1e-5)


def test_project_all_batches_same_shaped_layers_with_per_layer_results():
    """project_all factors the bases of same-shaped layers in one batched Cholesky-QR: every layer's grads must
    equal what project_gradients alone gives it (same factorizations, bit for bit on the CPU)."""
    layers = [make_layer(seed=20 + i) for i in range(3)] + [lora_svd.LoRASVDLinear(IN, 32, 4)]
    singles = [copy.deepcopy(l) for l in layers]
    for i, (a, b) in enumerate(zip(layers, singles)):
        torch.manual_seed(30 + i)
        a(torch.randn(T, IN)).square().mean().backward()
        torch.manual_seed(30 + i)
        b(torch.randn(T, IN)).square().mean().backward()
        lora_svd.project_gradients(b)
    lora_svd.project_all(nn.Sequential(*layers))
    for a, b in zip(layers, singles):
        for p, q in zip((a.weight_res, a.L1, a.L2), (b.weight_res, b.L1, b.L2)):
            assert torch.equal(p.grad, q.grad)
    assert layers[0].L1.grad.abs().max() > 0


def test_orthonormal_basis_is_cholesky_qr():
    A = torch.randn(96, 8, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback for a well-conditioned A
        Q = lora_svd.orthonormal_basis(A)
    torch.testing.assert_close(Q.t() @ Q, torch.eye(8), atol=1e-5, rtol=0)
    R = Q.t() @ A  # A = Q R with R upper triangular, positive diagonal
    assert (torch.tril(R, -1).abs().max() < 1e-4) and (torch.diag(R) > 0).all()
    torch.testing.assert_close(Q @ R, A, atol=1e-5, rtol=1e-5)
    # cond(A) = 1e3: Cholesky-QR from the fp64 Gram matrix stays orthonormal (from an fp32 one it
    # loses ~3e-3 and falls back)
    A = with_spectrum(torch.logspace(0, -3, 8, dtype=torch.float64), 96, 8,
                      torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Q = lora_svd.orthonormal_basis(A)
    torch.testing.assert_close(Q.t() @ Q, torch.eye(8), atol=1e-5, rtol=0)


def test_cholesky_failure_falls_back_to_householder(monkeypatch):
    monkeypatch.setattr(lora_svd, "_warned_householder", False)
    layer = make_layer(seed=6)
    with torch.no_grad():
        layer.L2[:, 0] = 0.0  # rank-deficient: the Gram matrix is singular, Cholesky fails
    backward_once(layer, 1)
    dW = f64(layer.weight_res.grad)
    with pytest.warns(UserWarning, match="Householder"):
        lora_svd.project_gradients(layer)
    Q2 = lora_svd.orthonormal_basis(layer.L2).double()
    torch.testing.assert_close(Q2.t() @ Q2, torch.eye(R, dtype=torch.float64), atol=1e-5, rtol=0)
    torch.testing.assert_close(Q2 @ (Q2.t() @ f64(layer.L2)), f64(layer.L2), atol=1e-5, rtol=1e-5)
    Q1 = lora_svd.orthonormal_basis(layer.L1.t()).double()
    assert (Q2.t() @ f64(layer.weight_res.grad) @ Q1).abs().max() < 1e-5 * dW.abs().max()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once only
        lora_svd.orthonormal_basis(layer.L2)


def test_an_ill_conditioned_basis_that_cholesky_factors_falls_back_too(monkeypatch):
    """cond(A) = 1e6: the fp64 Gram matrix (cond 1e12) still factors, but Cholesky-QR's Q loses
    orthogonality like eps * cond(A)^2 (~2e-5 here): the check catches it and Householder QR gives
    an orthonormal basis of A's span."""
    monkeypatch.setattr(lora_svd, "_warned_householder", False)
    A = with_spectrum(torch.logspace(0, -6, 8, dtype=torch.float64), 96, 8,
                      torch.Generator().manual_seed(0))                             # (96, 8)
    with pytest.warns(UserWarning, match="Householder"):
        Q = lora_svd.orthonormal_basis(A).double()
    assert (Q.t() @ Q - torch.eye(8, dtype=torch.float64)).abs().max() < 1e-6
    A64 = A.double()
    assert (Q @ (Q.t() @ A64) - A64).abs().max() < 1e-6 * A64.abs().max()  # A's span


# ---------------------------------------------------------------------------------------------------- realign

def test_realign_preserves_effective_weight_and_finds_new_subspace():
    gen = torch.Generator().manual_seed(7)
    layer = make_layer(beta=2.0, seed=7)
    with torch.no_grad():  # subspace drift: training moved a new strong low-rank part into W
        layer.weight_res.add_(planted_weight(OUT, IN, R, gen, gap=50.0) - torch.randn(OUT, IN, generator=gen))
    W = f64(layer.effective_weight())
    lora_svd.realign(layer, generator=gen)
    assert_close64(layer.effective_weight(), W, rel=4 * torch.finfo(torch.float32).eps)
    U, S, Vh = torch.linalg.svd(W)
    assert_close64(layer.beta * layer.L2 @ layer.L1, (U[:, :R] * S[:R]) @ Vh[:R], rel=1e-4)
    assert_close64(layer.L2.t() @ layer.L2, torch.diag(S[:R] / layer.beta), rel=1e-4)


def test_randomized_svd_finds_a_slowly_decaying_top_r():
    """A trained weight's spectrum decays slowly (here s_i = 1 / (1 + i / 20)): the sketch's
    oversampling and power iterations are what bring the top-r values within 2% of s_r (~0.02%
    here; without oversampling ~5%, without power iterations ~26%)."""
    S = 1 / (1 + 0.05 * torch.arange(256, dtype=torch.float64))
    W = with_spectrum(S, 256, 512, torch.Generator().manual_seed(0))                 # (256, 512)
    _, s, _ = lora_svd.randomized_svd(W, R, generator=torch.Generator().manual_seed(1))
    assert (s.double() - S[:R]).abs().max() < 0.02 * S[R - 1]


def test_realign_without_a_generator_splits_alike_whatever_the_global_rng():
    """realign's default sketch is seeded on its own: DDP / FSDP ranks, whose global RNGs train.py
    seeds differently, split the same weight into the same W_res, L1, L2."""
    splits = []
    for rank_seed in (0, 1):
        layer = make_layer(beta=2.0, seed=7)
        torch.manual_seed(rank_seed)
        lora_svd.realign(layer)
        splits.append([t.detach().clone() for t in (layer.weight_res, layer.L1, layer.L2)])
    assert all(torch.equal(a, b) for a, b in zip(*splits))


class ResettingOptimizer(torch.optim.SGD):
    """Stands in for optim.py's optimizers, which expose reset_state(param)."""
    def __init__(self, params):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.resets = []

    def reset_state(self, p):
        self.resets.append(p)
        self.state.pop(p, None)


@pytest.mark.parametrize("opt_kind", ["adamw", "reset_state"])
def test_realign_model_resets_optimizer_state(opt_kind):
    model = nn.Sequential(make_layer(seed=8), nn.Linear(OUT, 16), make_layer(seed=9))
    model[2] = lora_svd.LoRASVDLinear(16, 32, 4)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3) if opt_kind == "adamw" else ResettingOptimizer(params)
    x = torch.randn(T, IN)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        lora_svd.project_all(model)
        opt.step()
    lora_layers = [model[0], model[2]]
    W = [f64(l.effective_weight()) for l in lora_layers]
    assert lora_svd.realign_model(model, opt) == 2
    lora_params = [p for l in lora_layers for p in (l.weight_res, l.L1, l.L2)]
    for p in lora_params:
        assert len(opt.state.get(p, {})) == 0
    for p in model[1].parameters():  # other parameters keep their state
        assert len(opt.state[p]) > 0
    if opt_kind == "reset_state":
        assert {id(p) for p in opt.resets} == {id(p) for p in lora_params}
    for l, w in zip(lora_layers, W):
        assert_close64(l.effective_weight(), w, rel=4 * torch.finfo(torch.float32).eps)
    opt.zero_grad()  # training continues
    model(x).square().mean().backward()
    lora_svd.project_all(model)
    opt.step()
    assert all(torch.isfinite(p).all() for p in params)


def fsdp2_worker(rank, world, store):
    """One rank of test_fsdp2_two_ranks_match_a_single_process (module level: spawn pickles it by name). The
    ranks meet through a file (no TCP port to collide, no store server thread)."""
    import os
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(lora_svd.LoRASVDLinear(IN, OUT, R), nn.ReLU(), lora_svd.LoRASVDLinear(OUT, 32, 4))
        ref = copy.deepcopy(model)
        for m in model[0], model[2], model:
            fully_shard(m)
        x = torch.randn(T, IN)
        for net in (model, ref):
            torch.manual_seed(1)  # same SR / Hadamard draws
            net(x).square().mean().backward()
            lora_svd.project_all(net)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert p.to_local().shape[0] < q.shape[0]  # really sharded
            assert_close64(p.grad.full_tensor(), f64(q.grad), rel=1e-6)
        # a step changes the sharded W in place: the next forward quantizes it again (WeightCache),
        # as a reference with no cache does
        with torch.no_grad():
            for p, q in zip(model.parameters(), ref.parameters()):
                p.sub_(0.1 * p.grad)
                q.sub_(0.1 * q.grad)
        for m in ref[0], ref[2]:
            m.weight_cache = nvfp4.WeightCache()
        assert_close64(model(x), f64(ref(x)), rel=1e-6)
        W = [f64(m.effective_weight()) for m in (ref[0], ref[2])]
        lora_svd.realign_model(model)
        for m, w in zip((model[0], model[2]), W):
            assert_close64(m.effective_weight(), w, rel=4 * torch.finfo(torch.float32).eps)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # success: skip the interpreter's teardown (why: test_optim.py's FSDP2 worker)


def test_fsdp2_two_ranks_match_a_single_process(tmp_path):
    """FSDP2 shards parameters and grads as DTensors: projection and realignment gather them and write back the
    local shards; two gloo ranks on CPU must give the single-process gradients and effective weights."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    torch.multiprocessing.spawn(fsdp2_worker, args=(2, str(tmp_path / "store")), nprocs=2)


def ddp_worker(rank, world, store):
    """One rank of test_ddp_two_ranks_match_a_single_process (module level, as fsdp2_worker)."""
    import os
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(lora_svd.LoRASVDLinear(IN, OUT, R), nn.ReLU(), lora_svd.LoRASVDLinear(OUT, 32, 4))
        ref = copy.deepcopy(model)
        ddp = nn.parallel.DistributedDataParallel(model)  # as train.py wraps it
        x = torch.randn(T, IN)  # the same on both ranks: the all-reduced mean is one rank's gradient
        for step in range(2):  # a second step: DDP took the first's missing L1, L2 gradients
            for net in (ddp, ref):
                torch.manual_seed(1 + step)  # same SR / Hadamard draws
                net(x).square().mean().backward()
            for net in (model, ref):
                lora_svd.project_all(net)
            for p, q in zip(model.parameters(), ref.parameters()):
                assert_close64(p.grad, f64(q.grad), rel=1e-6)
                p.grad = q.grad = None
    finally:
        dist.destroy_process_group()
    os._exit(0)  # success: skip the interpreter's teardown (why: test_optim.py's FSDP2 worker)


def test_ddp_two_ranks_match_a_single_process(tmp_path):
    """DDP with LoRA-SVD layers, whose L1 and L2 get no gradient from autograd (project_gradients
    writes them from the all-reduced dW): two gloo ranks on CPU give the single-process gradients
    after the projection, step after step."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed unavailable")
    torch.multiprocessing.spawn(ddp_worker, args=(2, str(tmp_path / "store")), nprocs=2)


# ---------------------------------------------------------------------------------------------------- naive LoRA

def test_naive_lora_matches_autograd_through_fake_quantized_reference():
    torch.manual_seed(10)
    layer = lora_svd.NaiveLoRALinear(IN, OUT, R)
    assert torch.equal(layer.L2, torch.zeros_like(layer.L2))  # standard LoRA init: starts as the main weight
    with torch.no_grad():
        layer.L2.normal_()  # a trained branch, so that dL1 != 0
    x = torch.randn(T, IN, requires_grad=True)
    dy = torch.randn(T, OUT)
    torch.manual_seed(11)
    y = layer(x)
    y.backward(dy)
    # main weight: NVFP4Linear with the same RNG state (its SR draws), checked in test_nvfp4.py
    W = layer.weight.detach().clone().requires_grad_()
    x_main = x.detach().clone().requires_grad_()
    torch.manual_seed(11)
    y_main = nvfp4.nvfp4_linear(x_main, W, four_over_six=True)
    y_main.backward(dy)
    # forward vs the fake-quantized float64 reference; branch grads vs float64 autograd
    x64 = f64(x).requires_grad_()
    L1, L2 = f64(layer.L1).requires_grad_(), f64(layer.L2).requires_grad_()
    xq = f64(nvfp4.fake_quantize(x.detach(), (1, 16), four_over_six=True))
    wq = f64(nvfp4.fake_quantize(layer.weight.detach(), (16, 16), four_over_six=True))
    branch = (x64 @ L1.t()) @ L2.t()
    # the branch runs on bf16 operands (lora_svd.BRANCH): within a few bf16 roundings of float64
    assert_close64(y, xq @ wq.t() + branch, rel=2**-7)
    branch.backward(dy.double())
    assert_close64(layer.L1.grad, L1.grad, rel=2**-6)
    assert_close64(layer.L2.grad, L2.grad, rel=2**-6)
    assert torch.equal(layer.weight.grad, W.grad)
    assert_close64(x.grad, f64(x_main.grad) + x64.grad, rel=2**-7)


# ---------------------------------------------------------------------------------------------------- Fig. 3

def test_lora_svd_error_lower_on_structured_weight():
    gen = torch.Generator().manual_seed(12)
    W = planted_weight(128, 128, 16, gen, gap=5.0)
    X = torch.randn(64, 128, generator=gen)
    e = lora_svd.lora_svd_error(W, X, 16)
    assert 0 < e["lora_svd"] < e["nvfp4"] < 0.05
    assert e["reduction"] == pytest.approx(1 - e["lora_svd"] / e["nvfp4"])


# ---------------------------------------------------------------------------------------------------- kernels (App. 9)
# On CPU these run in Triton's interpreter (conftest sets TRITON_INTERPRET=1): small shapes.

def heavy_tailed(shape, gen):
    x = torch.randn(shape, generator=gen) * torch.exp(1.5 * torch.randn(shape, generator=gen))
    x[:16, :16] = 0.0  # an all-zero block
    return x


def same_nvfp4(k, r):
    assert k.shape == r.shape and k.block == r.block
    assert torch.equal(k.global_scale.cpu(), r.global_scale.cpu())
    assert torch.equal(k.scales.view(torch.uint8).cpu(), r.scales.view(torch.uint8).cpu())
    assert torch.equal(k.codes.cpu(), r.codes.cpu())


def kernel_quantize(x, block, *args, **kwargs):
    return nvfp4.NVFP4Tensor(*nvfp4_quant.quantize(x, block, *args, **kwargs), x.shape, block)


@pytest.mark.parametrize("rounding", ["rtn", "sr"])
def test_kernel_operand_is_grid_values_and_branch_columns(rounding):
    """The fused GEMM's left operand [X_hat | beta X L^T / (s_g s_g_other)]: exactly the grid values of
    nvfp4_quant's quantization of X (the same SR draws given the seed), then the branch columns in bf16."""
    gen = torch.Generator().manual_seed(23)
    x = heavy_tailed((48, 96), gen)
    L = torch.randn(5, 96, generator=gen)
    gs_other = torch.tensor(0.37)
    buf, s_g, (codes, scales) = nvfp4_linear._operand(x, rounding, True, 7, "x", 5, return_tensor=True)
    nvfp4_linear._branch_columns(buf, x, L, 0.5, s_g, gs_other)
    ref = kernel_quantize(x, (1, 16), rounding, True, seed=7)
    same_nvfp4(nvfp4.NVFP4Tensor(codes, scales, s_g, x.shape, (1, 16)), ref)
    if rounding == "rtn":
        same_nvfp4(ref, nvfp4.quantize_reference(x, (1, 16), "rtn", True))
    assert buf.shape == (48, 101) and buf.dtype == torch.bfloat16
    assert torch.equal(buf[:, :96].float(), ref.grid_values())
    branch = 0.5 * f64(x) @ f64(L).t() / (f64(s_g) * f64(gs_other))
    assert_close64(buf[:, 96:], branch, rel=2**-8)  # one bf16 rounding


def test_fused_path_of_the_layer_replays_eqs_1_2(monkeypatch):
    """The module's kernel path (kernels/nvfp4_linear.py in the interpreter) against float64 eqs. 1-2, replaying its
    draws (nvfp4.backward_draws); the branch operands are rounded to bf16."""
    monkeypatch.setenv("NANOFP4_ROUTE", "kernels")
    beta = 0.5
    layer = make_layer(beta=beta, seed=22)
    x = torch.randn(T, IN, requires_grad=True)
    dy = torch.randn(T, OUT)
    torch.manual_seed(5)
    y = layer(x)
    y.backward(dy)
    qx = nvfp4.quantize(x.detach(), (1, 16), "rtn", True)
    qw = nvfp4.quantize(layer.weight_res.detach(), (16, 16), "rtn", True)
    L1, L2 = f64(layer.L1), f64(layer.L2)
    torch.manual_seed(5)  # replay: dX's SR seed, then eq. 2's H and seeds
    seed_dx, H, (seed_dy, seed_x) = nvfp4.backward_draws(nvfp4.linear_contract(True), True, True, "cpu")
    q_dy = kernel_quantize(dy, (1, 16), "sr", True, seed=seed_dx)
    q_dyt = kernel_quantize(dy, (16, 1), "sr", True, seed=seed_dy, hadamard=H)
    q_hx = kernel_quantize(qx.dequantize(), (16, 1), "sr", True, seed=seed_x, hadamard=H)
    y_branch = beta * (f64(x) @ L1.t()) @ L2.t()
    dx_branch = beta * (f64(dy) @ L2) @ L1
    y_ref = f64(qx.dequantize()) @ f64(qw.dequantize()).t() + y_branch
    dx_ref = f64(q_dy.dequantize()) @ f64(qw.dequantize()) + dx_branch
    for got, ref, branch in ((y, y_ref, y_branch), (x.grad, dx_ref, dx_branch)):
        # bf16 branch operands: error within a few bf16 roundings of the branch
        assert (f64(got) - ref).abs().max() <= 2**-6 * branch.abs().max()
        assert (f64(got) - ref).abs().max() >= 1e-9  # (the bf16 rounding is really there)
    assert_close64(layer.weight_res.grad, f64(q_dyt.dequantize()).t() @ f64(q_hx.dequantize()))


@pytest.mark.gpu
def test_gpu_kernels_equal_the_reference_at_full_size(monkeypatch):
    torch.manual_seed(0)
    layer = lora_svd.LoRASVDLinear(4096, 4096, 64, device="cuda")
    x = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    outs = {}
    for fused in (False, True):  # the reference on the GPU, then the kernels
        monkeypatch.setenv("NANOFP4_ROUTE", "kernels" if fused else "reference")
        layer.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(1)  # same SR seeds (nvfp4.sr_seed) in the same order on both paths
        y = layer(x)
        y.backward(dy)
        outs[fused] = (y.float(), x.grad.float(), layer.weight_res.grad.clone())
    for a, b in zip(outs[True], outs[False]):  # differ by bf16 roundings of the output and of the branch
        assert ((a - b).norm() / b.norm()).item() < 1e-2
    dw_k, dw_r = outs[True][2], outs[False][2]  # eq. 2's dW: the same draws; summation order differs
    assert ((dw_k - dw_r).norm() / dw_r.norm()).item() < 1e-4


@pytest.mark.gpu
def test_gpu_projection_and_realign_at_full_size():
    torch.manual_seed(0)
    layer = lora_svd.LoRASVDLinear(4096, 4096, 64, device="cuda")
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    layer(x).float().square().mean().backward()
    dW = f64(layer.weight_res.grad)
    lora_svd.project_gradients(layer)
    Q2 = torch.linalg.qr(f64(layer.L2))[0]
    Q1 = torch.linalg.qr(f64(layer.L1).t())[0]
    dW_lora = Q2 @ (Q2.t() @ dW @ Q1) @ Q1.t()
    assert_close64(layer.weight_res.grad, dW - dW_lora, rel=1e-5)
    assert_close64(layer.L1.grad, f64(layer.L2).t() @ dW_lora, rel=1e-5)
    W = f64(layer.effective_weight())
    lora_svd.realign(layer)
    assert_close64(layer.effective_weight(), W, rel=4 * torch.finfo(torch.float32).eps)
