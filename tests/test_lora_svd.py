"""LoRA-SVD (paper §3.2, App. 8-9): init, eqs. 1-4 against float64, realignment, naive LoRA, kernels."""
import warnings

import pytest
import torch
import torch.nn as nn

import lora_svd
import nvfp4

T, IN, OUT, R = 32, 64, 48, 8


def f64(t):
    return t.detach().double()


def assert_close64(actual, expected, rel=2e-6):
    """fp32-rounding agreement with a float64 result, relative to the result's largest entry."""
    err = (f64(actual) - expected).abs().max().item()
    assert err <= rel * expected.abs().max().item(), f"max error {err:.3g} vs scale {expected.abs().max().item():.3g}"


def make_layer(beta=1.0, seed=0, bias=False):
    torch.manual_seed(seed)
    return lora_svd.LoRASVDLinear.from_linear(nn.Linear(IN, OUT, bias=bias), R, beta=beta)


def planted_weight(out_f, in_f, rank, gen, gap=20.0):
    """A weight with `rank` strong singular directions over a Gaussian bulk (a 'trained-like' spectrum)."""
    U, _ = torch.linalg.qr(torch.randn(out_f, rank, generator=gen))
    V, _ = torch.linalg.qr(torch.randn(in_f, rank, generator=gen))
    s = gap * torch.linspace(2.0, 1.0, rank)
    return (U * s) @ V.t() + torch.randn(out_f, in_f, generator=gen)


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
def test_forward_backward_match_float64_eqs_1_2(four_over_six):
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
    L1, L2 = f64(layer.L1), f64(layer.L2)
    # eq. 1, Y: NVFP4 GEMM on the residual + high-precision branch
    y_ref = f64(qx.dequantize()) @ f64(qw.dequantize()).t() + beta * (f64(x2) @ L1.t()) @ L2.t()
    assert_close64(y.reshape(T, OUT), y_ref)
    # replay the backward's draws in order: SR of dY (dX), then eq. 2's Hadamard and two SR quantizations
    torch.manual_seed(123)
    q_dy = nvfp4.quantize(dy2, (1, 16), "sr", fos)
    H = nvfp4.random_hadamard()
    q_dyt = nvfp4.quantize(dy2.t(), (1, 16), "sr", fos, hadamard=H)  # Q1x16(dY^T H)   (out, T)
    q_hx = nvfp4.quantize(qx.dequantize(), (16, 1), "sr", fos, hadamard=H)  # Q16x1(H^T Q(X))  (T, in)
    # eq. 1, dX: Q16x16(W_res) reused untransposed-requantized + branch
    dx_ref = f64(q_dy.dequantize()) @ f64(qw.dequantize()) + beta * (f64(dy2) @ L2) @ L1
    assert_close64(x.grad.reshape(T, IN), dx_ref)
    # eq. 2, dW
    dw_ref = f64(q_dyt.dequantize()) @ f64(q_hx.dequantize())
    assert_close64(layer.weight_res.grad, dw_ref)
    # the rotations cancel: dW estimates dY^T Q(X) (a wrongly placed H would give ~100% error)
    exact = f64(dy2).t() @ f64(qx.dequantize())
    assert (dw_ref - exact).norm() / exact.norm() < 0.3
    # LoRA grads are deferred to project_gradients: the backward leaves zeros (keeps DDP happy)
    assert torch.equal(layer.L1.grad, torch.zeros_like(layer.L1))
    assert torch.equal(layer.L2.grad, torch.zeros_like(layer.L2))


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


def test_projection_is_idempotent_and_commutes_with_accumulation():
    layer = make_layer(seed=5)
    ref = make_layer(seed=5)
    # layer: project after every micro-batch (and twice); ref: accumulate two micro-batches, project once
    for seed in (10, 11):
        backward_once(layer, seed)
        lora_svd.project_gradients(layer)
        grads = [p.grad.clone() for p in (layer.weight_res, layer.L1, layer.L2)]
        lora_svd.project_gradients(layer)  # same gradient: skipped
        for p, g in zip((layer.weight_res, layer.L1, layer.L2), grads):
            assert torch.equal(p.grad, g)
        backward_once(ref, seed)
    lora_svd.project_all(ref)
    for a, b in zip((layer.weight_res, layer.L1, layer.L2), (ref.weight_res, ref.L1, ref.L2)):
        assert_close64(a.grad, f64(b.grad), rel=1e-5)


def test_orthonormal_basis_is_cholesky_qr():
    A = torch.randn(96, 8, dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback for a well-conditioned A
        Q = lora_svd.orthonormal_basis(A)
    torch.testing.assert_close(Q.t() @ Q, torch.eye(8), atol=1e-5, rtol=0)
    R = Q.t() @ A  # A = Q R with R upper triangular, positive diagonal
    assert (torch.tril(R, -1).abs().max() < 1e-4) and (torch.diag(R) > 0).all()
    torch.testing.assert_close(Q @ R, A, atol=1e-5, rtol=1e-5)


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
    assert_close64(y, xq @ wq.t() + branch)
    branch.backward(dy.double())
    assert_close64(layer.L1.grad, L1.grad)
    assert_close64(layer.L2.grad, L2.grad)
    assert torch.equal(layer.weight.grad, W.grad)
    assert_close64(x.grad, f64(x_main.grad) + x64.grad)


# ---------------------------------------------------------------------------------------------------- Fig. 3

def test_lora_svd_error_lower_on_structured_weight():
    gen = torch.Generator().manual_seed(12)
    W = planted_weight(128, 128, 16, gen, gap=5.0)
    X = torch.randn(64, 128, generator=gen)
    e = lora_svd.lora_svd_error(W, X, 16)
    assert 0 < e["lora_svd"] < e["nvfp4"] < 0.05
    assert e["reduction"] == pytest.approx(1 - e["lora_svd"] / e["nvfp4"])
