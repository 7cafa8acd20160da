"""optim.py: NVFP4 optimizer states (§3.3), NVFP4 Root / Newton-Schulz (§3.4), routing, fused
kernel."""
import copy
import io
import json
import math

import pytest
import torch
import torch.nn as nn

import lora_svd
import nvfp4
import optim
from oracles import transposed
from tools.fit_root_coefficients import ns_error, polar_error


def gen(seed):
    return torch.Generator().manual_seed(seed)


def heavy_tailed_v(R=64, C=256, seed=0, steps=20):
    """A realistic second moment: EMA of g^2 with log-normal row/column scales and 1% spikes."""
    g0 = gen(seed)
    rs, cs = (torch.exp(torch.randn(R, 1, generator=g0) * 1.5),
              torch.exp(torch.randn(1, C, generator=g0)))
    v = torch.zeros(R, C)
    for _ in range(steps):
        g = (torch.randn(R, C, generator=g0) * rs * cs
             * (1 + 3 * (torch.rand(R, C, generator=g0) < 0.01)))
        v = 0.95 * v + 0.05 * g * g
    return v


# --------------------------------------------------------------------------------------------------
# state encodings

def test_fwht16_is_the_normalized_sylvester_hadamard_and_its_own_inverse():
    x = torch.randn(8, 64, generator=gen(0))
    H = nvfp4.sylvester_hadamard(16) / 4
    torch.testing.assert_close(optim.fwht16(x), nvfp4.hadamard_transform(x, H), atol=1e-6, rtol=0)
    torch.testing.assert_close(optim.fwht16(optim.fwht16(x)), x, atol=1e-6, rtol=0)


def test_first_moment_packed_layout_and_error():
    m = torch.randn(32, 128, generator=gen(1)) * 1e-3
    st = optim.encode_first_moment(m, gen(2))
    assert st["codes"].dtype == torch.uint8 and st["codes"].shape == (32, 64)
    assert st["scales"].dtype == torch.float8_e4m3fn and st["scales"].shape == (32, 8)
    assert st["global_scale"].dtype == torch.float32 and st["global_scale"].dim() == 0
    m_hat = optim.decode_first_moment(st)
    assert ((m_hat - m).norm() / m.norm()).item() < 0.2  # 4-bit SR: ~13%
    # the decoded values are exactly the rotated NVFP4 grid: re-rotating gives grid points
    grid = optim.fwht16(m_hat) / (st["global_scale"]
                                  * st["scales"].float().repeat_interleave(16, -1))
    ok = grid.abs()[..., None].sub(nvfp4.E2M1_VALUES).abs().amin(-1)
    assert ok.max().item() < 1e-4


def test_first_moment_sr_is_unbiased():
    m = torch.randn(16, 64, generator=gen(3))
    m[0, :16] *= 50  # an outlier block
    g = gen(4)
    n = 150
    mean = sum(optim.decode_first_moment(optim.encode_first_moment(m, g)) for _ in range(n)) / n
    single = optim.decode_first_moment(optim.encode_first_moment(m, g))
    err_single = (single - m).norm()
    # independent draws: the error of the mean shrinks like 1/sqrt(n) (12x); a biased rounding
    # would not
    assert (mean - m).norm() < 3 * err_single / n**0.5
    # two levels (Root's momentum layout; SR here) from explicit seeds, as the optimizers pass
    # them: the second level's uniforms must be independent of the first's. Reusing them, it rounds
    # the first level's error up with probability d2/d1 instead of d2, and the mean keeps ~40% of
    # one draw's error
    two = lambda seed: optim.decode_first_moment(optim.encode_first_moment(m, seed=seed, levels=2))
    mean = sum(two(2 * i) for i in range(n)) / n
    assert (mean - m).norm() < 3 * (two(2 * n) - m).norm() / n**0.5


def test_second_moment_never_negative_and_positive_never_zero():
    g0 = gen(5)
    v = torch.exp(torch.empty(32, 256).uniform_(-80, 10, generator=g0))  # v from 1e-35 to 2e4
    v[0, :128] = 0                       # an all-zero tile
    v[1, ::3] = 0                        # zeros mixed into positive tiles
    v[2, 5] = 1e6                        # one huge outlier next to tiny values
    v_hat = optim.decode_second_moment(optim.encode_second_moment(v))
    assert (v_hat >= 0).all()
    assert (v_hat[v > 0] > 0).all()
    assert (v_hat[0, :128] == 0).all()
    direct = optim.decode_direct(optim.encode_direct(v))
    assert (direct[v > 0] == 0).float().mean() > 0.3  # the failure the pipeline exists to avoid


def test_second_moment_pipeline_beats_direct_and_layout():
    v = heavy_tailed_v()
    st = optim.encode_second_moment(v, seed=0)
    tile = optim.CONTRACT["adamw.v.tile"]
    assert st["tile_mean"].shape == (64, 256 // tile) and st["tile_mean"].dtype == torch.float32
    v_dir = optim.decode_direct(optim.encode_direct(v))
    err = lambda a: ((a.clamp(min=0).sqrt() - v.sqrt()).norm() / v.sqrt().norm()).item()
    # SR's error varies from draw to draw: the mean over 8 fixed seeds
    e = sum(err(optim.decode_second_moment(optim.encode_second_moment(v, seed=s)))
            for s in range(8)) / 8
    assert e < 0.1 and e < 0.4 * err(v_dir)
    with pytest.raises(ValueError, match="negative"):
        optim.encode_second_moment(-v)
    with pytest.raises(ValueError, match="multiple of 16"):
        optim.encode_second_moment(v[:, :40])


def test_tile_mean_is_the_mean():
    s = torch.rand(4, 256, generator=gen(6))
    torch.testing.assert_close(optim.tile_mean(s, 64), s.reshape(4, 4, 64).mean(-1),
                               atol=1e-6, rtol=1e-6)


# --------------------------------------------------------------------------------------------------
# QuantizedAdamW

def make_params(seed=0):
    g0 = gen(seed)
    return [nn.Parameter(torch.randn(64, 128, generator=g0)),
            nn.Parameter(torch.randn(64, generator=g0)),
            nn.Parameter(torch.randn(16, 48, generator=g0))]


def set_grads(params, g0):
    for p in params:
        p.grad = torch.randn(p.shape, generator=g0) * 0.1


def test_quantization_off_matches_torch_adamw_exactly(monkeypatch):
    ours, ref = make_params(), make_params()
    monkeypatch.setitem(optim.CONTRACT, "adamw.m", "fp32")   # CONTRACT's full-precision states
    opt = optim.QuantizedAdamW(ours, lr=1e-2, weight_decay=0.1)
    opt_ref = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                foreach=False)
    g0, g1 = gen(7), gen(7)
    for step in range(6):
        if step == 3:
            for o in (opt, opt_ref):
                o.param_groups[0]["lr"] = 3e-3
        set_grads(ours, g0)
        set_grads(ref, g1)
        opt.step()
        opt_ref.step()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_state_bytes_and_which_tensors_are_packed():
    params = make_params()
    opt = optim.QuantizedAdamW(params, states="nvfp4")
    set_grads(params, gen(8))
    opt.step()
    big, bias, small = (opt.state[p] for p in params)
    assert big["m.codes"].dtype == torch.uint8 and big["v.codes"].dtype == torch.uint8
    assert "exp_avg" in bias and "exp_avg" in small  # 1-D and < 4096 elements: fp32
    nbytes = sum(v.nbytes for v in big.values())
    assert nbytes / params[0].numel() <= 1.2


def regression_problem(seed=0):
    g0 = gen(seed)
    W_true = torch.randn(32, 128, generator=g0) / 8
    X = torch.randn(256, 128, generator=g0)
    return X, X @ W_true.t()


def fit_regression(states, steps=30):
    X, Y = regression_problem()
    W = nn.Parameter(torch.zeros(32, 128))  # 4096 elements: packed states
    opt = optim.QuantizedAdamW([W], lr=3e-2, weight_decay=0.0, states=states)
    loss0 = ((X @ W.t() - Y) ** 2).mean().item()
    for _ in range(steps):
        loss = ((X @ W.t() - Y) ** 2).mean()
        W.grad = torch.autograd.grad(loss, W)[0]
        opt.step()
    return loss.item() / loss0


def test_quantized_adamw_converges_on_regression_and_direct_states_do_not():
    pipeline, direct = fit_regression("nvfp4"), fit_regression("direct")
    assert pipeline < 0.05
    # App. 13's collapse in miniature: v entries decoding to 0 turn m / sqrt(v) into huge steps
    assert direct > 10 * pipeline


def constant_gradient_steps(step_fn, steps=4, R=32, C=128):
    """p after each of `steps` AdamW steps from zero moments with one constant gradient
    (magnitude constant along a row, 1e-3 .. 10 across rows, random signs), and the closed form:
    m_k = (1 - b1^k) g and v_k = (1 - b2^k) g^2, so the bias-corrected mhat = g, vhat = g^2 and
    every step moves p by lr * g / (|g| + eps)."""
    g0 = gen(41)
    g = torch.logspace(-3, 1, R)[:, None] * torch.sign(torch.randn(R, C, generator=g0))
    p = torch.randn(R, C, generator=g0)
    lr, b1, b2, eps = 1e-2, 0.9, 0.95, 1e-8
    expected_step = lr * g.double() / (g.double().abs() + eps)
    out = []
    for k in range(1, steps + 1):
        before = p.clone()
        p = step_fn(p, g, k, lr, b1, b2, eps)
        # 1 where the closed form holds
        out.append(((before.double() - p.double()) / expected_step))
    return out


def check_bias_correction(ratios):
    for k, r in enumerate(ratios, 1):
        # m is stored with stochastic rounding (unbiased, ~10% per element); v's roots are equal
        # along a tile, so its pipeline is exact here. A slip in either correction is off by >= 2x
        # at step 1.
        assert abs(r.mean().item() - 1) < 0.02, (k, r.mean().item())
        assert (r - 1).abs().max().item() < 0.5, (k, (r - 1).abs().max().item())


def test_quantized_adamw_bias_correction_matches_the_closed_form_reference_path():
    W, opt = None, None

    def step(p, g, k, lr, b1, b2, eps):
        nonlocal W, opt
        if opt is None:
            W = nn.Parameter(p.clone())
            opt = optim.QuantizedAdamW([W], lr=lr, betas=(b1, b2), eps=eps, weight_decay=0.0,
                                       states="nvfp4")
        W.grad = g.clone()
        opt.step()
        assert "m.codes" in opt.state[W]  # the packed path, not the fp32 one
        return W.detach().clone()

    check_bias_correction(constant_gradient_steps(step))


def test_quantized_adamw_bias_correction_matches_the_closed_form_kernel_path():
    from kernels.optim_fused import fused_adamw_step
    state = {}

    def step(p, g, k, lr, b1, b2, eps):
        nonlocal state
        if not state:
            zeros = torch.zeros(p.shape)
            optim._store(state, "m", optim.encode_first_moment(zeros))
            optim._store(state, "v", optim.encode_second_moment(zeros))
            state = {key: x.to(DEV) for key, x in state.items()}
        p_k = p.to(DEV, copy=True)
        fused_adamw_step(p_k, g.to(DEV), state, lr, b1, b2, eps, 0.0, k, seed_m=k, seed_v=k + 100,
                         floor=optim.CONTRACT["adamw.v.floor"])
        return p_k.cpu()

    check_bias_correction(constant_gradient_steps(step))


# --------------------------------------------------------------------------------------------------
# Newton-Schulz and Root

def singular_values(X):
    return torch.linalg.svdvals(X.double())


STABLE_NVFP4 = (2.0, -1.5, 0.5)  # a conservative stable set: p(1) = 1, p'(1) = 0


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("shape", [(64, 256), (256, 64)])
def test_newton_schulz_orthogonalizes(quantized, shape):
    G = torch.randn(*shape, generator=gen(9))
    coefficients = STABLE_NVFP4 if quantized else optim.MUON_COEFFICIENTS
    X = optim.newton_schulz(G, coefficients=coefficients, quantized=quantized, generator=gen(10))
    assert X.shape == G.shape
    s = singular_values(X)
    lo, hi = (0.6, 1.25) if not quantized else (0.7, 1.3)
    assert s.min() > lo and s.max() < hi, (s.min(), s.max())
    assert singular_values(G / G.norm()).max() < 0.2  # it really moved them
    assert polar_error(X, G) < (0.25 if quantized else 0.3)


@pytest.mark.parametrize("shape", [(32, 96), (96, 32)])
def test_newton_schulz_iterates_on_the_wide_orientation(monkeypatch, shape):
    """NS forms A = X X^T on the wide orientation, (min, min). The tall one gives the same
    polynomial in exact arithmetic (X p(X^T X) = p(X X^T) X), but its Gram matrix is (max, max):
    NVFP4 GEMMs (max/min)^2 as large, each quantized along another dim."""
    products, matmul = [], nvfp4.nvfp4_matmul  # the shapes of the real GEMMs' outputs, in order

    def recording(a, b, *args, **kwargs):
        out = matmul(a, b, *args, **kwargs)
        products.append(tuple(out.shape))
        return out

    monkeypatch.setattr(nvfp4, "nvfp4_matmul", recording)
    G = torch.randn(*shape, generator=gen(15))
    X = optim.newton_schulz(G, steps=2, coefficients=STABLE_NVFP4, generator=gen(16))
    small, large = min(shape), max(shape)
    assert X.shape == G.shape
    assert products == [(small, small), (small, small), (small, large)] * 2  # A, A^2, B X a step


def test_muon_coefficients_blow_up_in_nvfp4_and_fitted_ones_do_not():
    """Fig. 4b's point: NS's large coefficients amplify 4-bit rounding (X_next = a X + B X cancels
    ~70% of a X)."""
    G = torch.randn(64, 192, generator=gen(14))
    muon = ns_error(optim.MUON_COEFFICIENTS, [G], quantized=True)
    safe = ns_error(STABLE_NVFP4, [G], quantized=True)
    assert safe < 0.3 and muon > 3 * safe
    assert ns_error(optim.MUON_COEFFICIENTS, [G], quantized=False) < 0.3


def test_quantized_ns_step_is_the_papers_three_equations():
    X = torch.randn(32, 64, generator=gen(11))
    X = X / X.norm()
    H = nvfp4.random_hadamard(gen(12))
    a, b, c = optim.MUON_COEFFICIENTS
    fq = lambda t, block: nvfp4.fake_quantize(t, block, "rtn", four_over_six=True, hadamard=H)
    # 16x1 blocks on H^T Y, written with (16, 1) quantization and H^T applied from the left
    A = fq(X, (1, 16)) @ fq(X, (1, 16)).t()  # qX qX^T (H H^T = I cancels exactly in exact math)
    B = b * A + c * fq(A, (1, 16)) @ fq(A, (16, 1))
    X1 = a * X + fq(B, (1, 16)) @ fq(X, (16, 1))
    torch.testing.assert_close(optim._ns_step_nvfp4(X, a, b, c, H), X1, atol=1e-5, rtol=1e-4)
    # the transposed-operand trick: Q16x1(H^T Y) is Q1x16(Y^T H), bit for bit
    q16x1 = transposed(nvfp4.quantize(X, (16, 1), "rtn", True, hadamard=H))
    q1x16 = nvfp4.quantize(X.t().contiguous(), (1, 16), "rtn", True, hadamard=H)
    assert torch.equal(q16x1.codes, q1x16.codes) \
        and torch.equal(q16x1.scales.float(), q1x16.scales.float())


def test_quantile_matches_torch_quantile():
    x = torch.randn(1000, generator=gen(13)).abs()
    for q in (0.9, 0.5, 0.0, 1.0):
        torch.testing.assert_close(optim.quantile(x, q), torch.quantile(x, q))


def test_coefficient_lookup_and_stability_check():
    assert optim.coefficients_stable(optim.MUON_COEFFICIENTS)
    # overshoots to 3.3
    assert not optim.coefficients_stable(optim.PUBLISHED_COEFFICIENTS[(2048, 2048)])
    assert not optim.coefficients_stable((4.0, -3.0, 1.0))  # p(1) = 2: blows up
    # fp32 NS: the published set where it is stable (either orientation), Muon's otherwise
    assert optim.root_coefficients(8192, 2048, quantized=False) \
        == optim.PUBLISHED_COEFFICIENTS[(2048, 8192)]
    assert optim.root_coefficients(2048, 2048, quantized=False) == optim.MUON_COEFFICIENTS
    assert optim.root_coefficients(48, 80, quantized=False) == optim.MUON_COEFFICIENTS
    fitted = optim._fitted()
    assert (1024, 1024) in fitted and (3072, 9216) in fitted  # our configs' shapes are in the JSON
    for key, abc in fitted.items():
        assert optim.coefficients_stable(abc), key
    assert optim.root_coefficients(9216, 3072) == fitted[(3072, 9216)]
    # unknown shape: nearest aspect ratio (3)
    assert optim.root_coefficients(320, 960) == fitted[(2048, 6144)] or \
        optim.root_coefficients(320, 960) == fitted[(3072, 9216)]


def test_root_steps_from_zero_state_are_roots_formula():
    """Two fp32 Root steps against ROOT's update written out here: Nesterov momentum, clip at the
    0.9-quantile of |M|, NS5 on the wide orientation with Muon's set (no fitted or published set for
    48x32 in fp32), lr * 0.2 * sqrt(max(m, n)). Two steps, because from a zero state M = (1 + mu) g
    and NS is scale-invariant: only the second step tells Nesterov from plain momentum."""
    m, n, lr, wd, mu = 48, 32, 0.02, 0.1, 0.95  # rows > cols: NS runs on the transpose
    g0 = gen(40)
    p0 = torch.randn(m, n, generator=g0, dtype=torch.float64)
    grads = [torch.randn(m, n, generator=g0, dtype=torch.float64)
             * torch.exp(torch.randn(m, 1, generator=g0)) for _ in range(2)]
    W = nn.Parameter(p0.float())
    opt = optim.Root([W], lr=lr, momentum=mu, weight_decay=wd, states="fp32")
    p, buf = p0.clone(), torch.zeros(m, n, dtype=torch.float64)
    for g in grads:
        W.grad = g.float()
        opt.step()
        buf = mu * buf + g
        M = g + mu * buf                                           # Nesterov
        ordered = M.abs().flatten().sort().values
        pos = 0.9 * (ordered.numel() - 1)  # torch.quantile's linear interpolation
        lo = int(pos)
        eps = ordered[lo] + (ordered[lo + 1] - ordered[lo]) * (pos - lo)
        X = M.clamp(-eps, eps).t()                                 # (n, m): wide
        X = X / (X.norm() + 1e-7)
        a, b, c = 3.4445, -4.7750, 2.0315
        for _ in range(5):
            A = X @ X.t()
            X = a * X + (b * A + c * A @ A) @ X
        p = p * (1 - lr * wd) - lr * 0.2 * math.sqrt(max(m, n)) * X.t()
        torch.testing.assert_close(W.detach().double(), p, atol=2e-6, rtol=0)


def test_root_stores_its_momentum_as_the_contract_says():
    """states="nvfp4": after one step buf = g, stored as CONTRACT["root.momentum"] (H16, RTN, 4/6)
    in CONTRACT["root.momentum.levels"] levels: the second holds the first's error, so the stored
    momentum is several times closer to g than one level (RTN: no seed enters)."""
    g = torch.randn(32, 128, generator=gen(41)) * torch.exp(torch.randn(32, 1, generator=gen(42)))
    W = nn.Parameter(torch.randn(32, 128, generator=gen(43)))
    opt = optim.Root([W], states="nvfp4")
    W.grad = g
    opt.step()
    stored = optim.decode_first_moment(optim._prefixed(opt.state[W], "m"), entry="root.momentum")
    levels = optim.CONTRACT["root.momentum.levels"]
    assert levels == 2
    code = lambda n: optim.decode_first_moment(
        optim.encode_first_moment(g, entry="root.momentum", levels=n), entry="root.momentum")
    assert torch.equal(stored, code(levels))
    assert (stored - g).norm() < (code(1) - g).norm() / 4


def test_root_converges_on_regression():
    X, Y = regression_problem(1)
    for quantized in (False, True):
        W = nn.Parameter(torch.zeros(32, 128))
        opt = optim.Root([W], lr=2e-2, weight_decay=0.0, states="nvfp4" if quantized else "fp32")
        loss0 = ((X @ W.t() - Y) ** 2).mean().item()
        for i in range(40):
            # an orthogonalized step has a fixed size: decay it
            opt.param_groups[0]["lr"] = 0.1 * (1 - i / 40)
            loss = ((X @ W.t() - Y) ** 2).mean()
            W.grad = torch.autograd.grad(loss, W)[0]
            opt.step()
        assert loss.item() < 0.03 * loss0, (quantized, loss.item() / loss0)


def test_root_rejects_bad_shapes():
    with pytest.raises(ValueError, match="2-D"):
        optim.Root([nn.Parameter(torch.zeros(32))])
    with pytest.raises(ValueError, match="multiples of 16"):
        optim.Root([nn.Parameter(torch.zeros(32, 40))], states="nvfp4")


# --------------------------------------------------------------------------------------------------
# build_optimizer, state_dict

class TinyModel(nn.Module):
    def __init__(self, lora=True, narrow=True):
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(96, 64)
        self.attn = nn.Linear(64, 64, bias=False)
        self.mlp = (lora_svd.LoRASVDLinear(64, 128, rank=4) if lora
                    else nn.Linear(64, 128, bias=False))
        self.narrow = nn.Linear(64, 16 * 40, bias=False) if narrow else None  # aspect 10 > 8: AdamW
        self.norm = nn.LayerNorm(64)
        self.lm_head = nn.Linear(64, 96, bias=False)

    def forward(self, idx):
        x = self.wte(idx)
        x = x + self.attn(x) + self.mlp(x)[..., :64]
        if self.narrow is not None:
            x = x + self.narrow(x)[..., :64]
        return self.lm_head(self.norm(x))


def train_steps(model, opt, n, seed):
    g0 = gen(seed)
    for _ in range(n):
        idx = torch.randint(0, 96, (2, 16), generator=g0)
        loss = nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        opt.zero_grad()
        loss.backward()
        lora_svd.project_all(model)  # eqs. 3-4, as train.py runs them before the step
        opt.step()
    return loss.item()


def test_routing():
    model = TinyModel()
    routes = {k: [n for n, _ in v] for k, v in optim.route_parameters(model, "root").items()}
    assert routes["root"] == ["attn.weight", "mlp.weight_res"]
    assert routes["lora"] == ["mlp.L1", "mlp.L2"]
    assert set(routes["adamw"]) == {"wte.weight", "narrow.weight", "lm_head.weight"}
    assert set(routes["adamw_no_decay"]) == {"norm.weight", "norm.bias"}
    assert optim.route_parameters(model, "adamw")["root"] == []
    # found by its L1, L2 (duck typing)
    naive = nn.Sequential(lora_svd.NaiveLoRALinear(64, 128, rank=4))
    routes = {k: [n for n, _ in v] for k, v in optim.route_parameters(naive, "root").items()}
    assert routes["root"] == ["0.weight"] and routes["lora"] == ["0.L1", "0.L2"]
    # the bounds: an aspect of exactly MAX_ROOT_ASPECT is Root's, a wider one and a dim off the
    # 16-grid (NS quantizes in 16-element blocks along both) are AdamW's
    shapes = {"at_max": (16, 128), "wider": (16, 144), "off_grid_in": (32, 40),
              "off_grid_out": (40, 32)}
    edge = nn.ModuleDict({k: nn.Linear(i, o, bias=False) for k, (o, i) in shapes.items()})
    routes = {k: [n for n, _ in v] for k, v in optim.route_parameters(edge, "root").items()}
    assert routes["root"] == ["at_max.weight"] and len(routes["adamw"]) == 3


def test_hallway_optim_imports_only_nvfp4_and_kernels():
    """optim.py -> nvfp4.py -> kernels/ (no model, train or lora_svd, function-local imports
    included); kernels/optim_fused.py imports no project module above kernels/."""
    import ast
    import pathlib
    root = pathlib.Path(optim.__file__).parent
    project = {p.stem for p in root.glob("*.py")} | {"kernels", "tools"}

    def imported(path):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        return names & project

    assert imported(root / "optim.py") == {"nvfp4", "kernels"}
    assert imported(root / "kernels" / "optim_fused.py") == {"kernels"}


@pytest.mark.parametrize("optimizer,states", [("root", "nvfp4"), ("adamw", "fp32"),
                                              ("root", "direct")])
def test_build_optimizer_steps_and_has_base_lr(optimizer, states):
    model = TinyModel(narrow=False)
    opt = optim.build_optimizer(model, optimizer, states, lr=1e-3, lora_lr=2e-3)
    assert all("base_lr" in g for g in opt.param_groups)
    assert sorted({g["base_lr"] for g in opt.param_groups}) == [1e-3, 2e-3]
    n_params = sum(len(g["params"]) for g in opt.param_groups)
    assert n_params == len(list(model.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    train_steps(model, opt, 1, seed=1)
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state_nbytes() > 0
    opt.reset_state(model.attn.weight)
    assert model.attn.weight not in opt.state


def test_state_dict_round_trip_continues_bit_for_bit():
    model = TinyModel(lora=False, narrow=False)  # LoRA-SVD's backward draws from the global RNG
    opt = optim.build_optimizer(model, "root", "nvfp4", lr=1e-3)
    train_steps(model, opt, 1, seed=2)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
    train_steps(model, opt, 2, seed=3)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=False)
    resumed = TinyModel(lora=False, narrow=False)
    resumed.load_state_dict(ckpt["model"])
    opt2 = optim.build_optimizer(resumed, "root", "nvfp4", lr=1e-3)
    opt2.load_state_dict(ckpt["opt"])
    state = opt2.state[resumed.attn.weight]
    assert state["m.codes"].dtype == torch.uint8 and state["m.scales"].dtype == torch.float8_e4m3fn
    assert opt2.state[resumed.wte.weight]["v.tile_mean"].dtype == torch.float32
    train_steps(resumed, opt2, 2, seed=3)
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(a, b)
    # an AdamW-only state (one optimizer) does not load into Root + AdamW (two) by halves
    adamw_only = optim.build_optimizer(resumed, "adamw", "nvfp4", lr=1e-3).state_dict()
    with pytest.raises(ValueError, match="checkpoint has 1 optimizers, this one 2"):
        opt2.load_state_dict(adamw_only)


# --------------------------------------------------------------------------------------------------
# fused kernel (Triton interpreter on CPU, full size on the GPU)

def packed_state(R, C, seed, device="cpu"):
    g0 = gen(seed)
    m = torch.randn(R, C, generator=g0) * 1e-2
    v = (torch.randn(R, C, generator=g0) * 1e-2) ** 2 * torch.exp(torch.randn(R, 1, generator=g0))
    st = {}
    optim._store(st, "m", optim.encode_first_moment(m, g0))
    optim._store(st, "v", optim.encode_second_moment(v))
    return {k: x.to(device) for k, x in st.items()}


def fused_case(R, C, seed):
    """A packed state, a parameter and a gradient for the fused-kernel tests
    (seeds seed .. seed + 2)."""
    return (packed_state(R, C, seed=seed), torch.randn(R, C, generator=gen(seed + 1)),
            torch.randn(R, C, generator=gen(seed + 2)) * 1e-2)


def reference_step(p, g, st, step, hp):
    m = optim.decode_first_moment(optim._prefixed(st, "m"))
    v = optim.decode_second_moment(optim._prefixed(st, "v"))
    return optim.adamw_update_math(p.clone(), g, m, v, *hp, step)


HP = (1e-3, 0.9, 0.95, 1e-8, 0.1)  # lr, beta1, beta2, eps, weight_decay
# the kernel: the GPU, else the Triton interpreter
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def as_bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def decoded_root_residual(st):
    """(s q) H16 + mu of a packed v state: the decoded sqrt(v) before the floor."""
    mu = st["tile_mean"]
    shape = optim._shape(st)
    r = optim.fwht16(optim._packed(st, shape).dequantize())
    return (r.reshape(*mu.shape, -1) + mu[..., None]).reshape(shape)


# v tiles of 128 / gcd(48, 128) = 16; masked rows
@pytest.mark.parametrize("shape", [(24, 256), (40, 48)])
def test_fused_kernel_equals_reference(shape):
    from kernels.optim_fused import fused_adamw_step
    R, C = shape
    st, p, g = fused_case(R, C, seed=20)
    p_ref, m_ref, v_ref = reference_step(p, g, st, 3, HP)
    # the kernel's seeds: the reference's Philox words
    v_enc = optim.encode_second_moment(v_ref, seed=456)
    m_enc = optim.encode_first_moment(m_ref, seed=123)
    p_k, st_k = p.to(DEV), {k: x.to(DEV) for k, x in st.items()}
    fused_adamw_step(p_k, g.to(DEV), st_k, *HP, step=3, seed_m=123, seed_v=456,
                     floor=optim.CONTRACT["adamw.v.floor"])
    p_k, st_k = p_k.cpu(), {k: x.cpu() for k, x in st_k.items()}
    assert torch.equal(p_k, p_ref)  # RTN / exact parts: bit for bit
    # SR too: the same seeds, the same bits
    for key in ("codes", "scales", "global_scale", "tile_mean"):
        assert torch.equal(as_bits(st_k["v." + key]), as_bits(v_enc[key])), key
    for key in ("codes", "scales", "global_scale"):
        assert torch.equal(as_bits(st_k["m." + key]), as_bits(m_enc[key])), key
    assert not torch.equal(st_k["m.codes"], st_k["v.codes"])


def test_fused_kernel_stochastic_rounding_of_m_and_v_is_unbiased():
    from kernels.optim_fused import fused_adamw_step
    R, C = 16, 64
    st, p, g = fused_case(R, C, seed=24)
    _, m_ref, v_ref = reference_step(p, g, st, 2, HP)
    root = optim.sqrt_rn(v_ref)
    n, total_m, total_r = 12, 0, 0
    for seed in range(n):
        # copies: the kernel updates p and the state in place
        st_k = {k: x.to(DEV, copy=True) for k, x in st.items()}
        fused_adamw_step(p.to(DEV, copy=True), g.to(DEV), st_k, *HP, step=2, seed_m=seed,
                         seed_v=seed + 100, floor=optim.CONTRACT["adamw.v.floor"])
        st_k = {k: x.cpu() for k, x in st_k.items()}
        total_m = total_m + optim.decode_first_moment(optim._prefixed(st_k, "m"))
        total_r = total_r + decoded_root_residual(optim._prefixed(st_k, "v"))
    single_m = (optim.decode_first_moment(optim._prefixed(st_k, "m")) - m_ref).norm()
    single_r = (decoded_root_residual(optim._prefixed(st_k, "v")) - root).norm()
    assert ((total_m / n) - m_ref).norm() < 2 * single_m / n**0.5
    assert ((total_r / n) - root).norm() < 2 * single_r / n**0.5


@pytest.mark.gpu
def test_fused_kernel_on_gpu_matches_cpu_reference():
    """Full size: QuantizedAdamW on CUDA (fused kernel) against the reference on the CPU, one
    step."""
    R, C = 1024, 4096
    st, p, g = fused_case(R, C, seed=27)
    p_ref, m_ref, v_ref = reference_step(p, g, st, 5, HP)
    v_enc = optim.encode_second_moment(v_ref)
    from kernels.optim_fused import fused_adamw_step
    p_k, st_k = p.cuda(), {k: x.cuda() for k, x in st.items()}
    fused_adamw_step(p_k, g.cuda(), st_k, *HP, step=5, seed_m=7, seed_v=8,
                     floor=optim.CONTRACT["adamw.v.floor"])
    assert torch.equal(p_k.cpu(), p_ref)
    assert torch.equal(as_bits(st_k["v.scales"].cpu()), as_bits(v_enc["scales"]))
    assert torch.equal(st_k["v.tile_mean"].cpu(), v_enc["tile_mean"])
    r_k = decoded_root_residual({k: x.cpu() for k, x in optim._prefixed(st_k, "v").items()})
    assert ((r_k - optim.sqrt_rn(v_ref)).norm() / optim.sqrt_rn(v_ref).norm()).item() < 0.2
    m_k = optim.decode_first_moment({k: x.cpu() for k, x in optim._prefixed(st_k, "m").items()})
    assert ((m_k - m_ref).norm() / m_ref.norm()).item() < 0.2


@pytest.mark.gpu
def test_quantized_adamw_cuda_converges_and_resumes_bit_exactly():
    X, Y = (t.cuda() for t in regression_problem())
    W = nn.Parameter(torch.zeros(32, 128, device="cuda"))
    opt = optim.QuantizedAdamW([W], lr=3e-2, weight_decay=0.0)
    loss0 = ((X @ W.t() - Y) ** 2).mean().item()
    for i in range(60):
        loss = ((X @ W.t() - Y) ** 2).mean()
        W.grad = torch.autograd.grad(loss, W)[0]
        opt.step()
        if i == 30:  # through a file loaded onto the GPU, as train.py's --resume does
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            buffer.seek(0)
            saved_W, saved = W.detach().clone(), torch.load(buffer, map_location="cuda")
    assert loss.item() < 0.02 * loss0
    W2 = nn.Parameter(saved_W)
    opt2 = optim.QuantizedAdamW([W2], lr=3e-2, weight_decay=0.0)
    opt2.load_state_dict(saved)
    for i in range(29):
        loss = ((X @ W2.t() - Y) ** 2).mean()
        W2.grad = torch.autograd.grad(loss, W2)[0]
        opt2.step()
    assert torch.equal(W, W2)


@pytest.mark.gpu
def test_nvfp4_newton_schulz_on_gpu():
    G = torch.randn(1024, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    X = optim.newton_schulz(G, generator=torch.Generator("cuda").manual_seed(1))
    s = torch.linalg.svdvals(X.double())
    assert s.max() < 1.5 and polar_error(X, G) < 0.3


@pytest.mark.gpu
def test_gpu_quantile_sort_path_matches_torch_quantile():
    x = torch.randn(3001, 17, device="cuda")
    for q in (0.0, 0.5, 0.9, 1.0):
        # lerp: ~1 ulp
        torch.testing.assert_close(optim.quantile(x, q), torch.quantile(x.cpu(), q).cuda())


@pytest.mark.gpu
def test_gpu_root_cuda_graph_equals_eager():
    """The captured Root direction replays the eager computation bit for bit, for fresh inputs and
    rotations on every replay (a graph that kept its capture-time inputs would fail the second
    round)."""
    gen = torch.Generator("cuda").manual_seed(3)
    captured = None
    for _ in range(2):
        M = torch.randn(512, 1536, device="cuda", generator=gen)
        hs = [nvfp4.random_hadamard(gen) for _ in range(5)]
        captured = captured or optim._CapturedDirection(M, 0.9, 5)
        assert torch.equal(captured(M, hs), optim.root_direction(M, 0.9, 5, True, hs))
    p1 = torch.nn.Parameter(torch.randn(256, 512, device="cuda") * 0.02)
    p2 = torch.nn.Parameter(p1.detach().clone())
    o1, o2 = optim.Root([p1], lr=1e-2), optim.Root([p2], lr=1e-2)
    o2.cuda_graphs = False   # the eager NVFP4 NS
    for i in range(3):
        g = torch.randn(256, 512, device="cuda", generator=gen) * 1e-2
        p1.grad, p2.grad = g.clone(), g.clone()
        o1.step()
        o2.step()
        assert torch.equal(p1, p2), i


# --------------------------------------------------------------------------------------------------
# FSDP2 (2 CPU processes, gloo): QuantizedAdamW on local shards, Root gathers the full matrix

def _fsdp_worker(rank, world, store, out):
    import os
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # no TCP port
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    results = {}
    for states, steps in (("fp32", 2), ("nvfp4", 1)):
        model = fsdp_model()
        fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
        opt = train_fsdp_model(model, states, steps)
        results[states] = [p.full_tensor() for p in model.parameters()]
        results[states + "_packed"] = {tuple(p.shape): tuple(opt.state[p]["m.codes"].shape)
                                       for p in model.parameters() if "m.codes" in opt.state[p]}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()
    # Success: leave without the interpreter's teardown, which aborted a rank now and then in CI
    # ("terminate called without an active exception", SIGABRT; 3 of ~20 full runs, never when run
    # alone): a C++ thread destroyed unjoined, most likely gloo's, its group still referenced by
    # FSDP2's device mesh past destroy_process_group.
    # Failures raise before this line and are reported as usual.
    os._exit(0)


def fsdp_model():
    torch.manual_seed(0)
    # (128, 64) and (64, 128) go to Root, the (1152, 64) one (aspect 18) to QuantizedAdamW, the bias
    # to fp32 AdamW
    return nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=True),
                         nn.Linear(64, 1152, bias=False))


def train_fsdp_model(model, states, steps):
    x = torch.randn(256, 64, generator=gen(30))
    opt = optim.build_optimizer(model, "root", states, lr=1e-2)
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return opt


@pytest.mark.slow
def test_fsdp2_sharded_states_and_gathered_root(tmp_path):
    """2 ranks: fp32 states give the single-process numbers; with packed states the first step does
    too (the moments' encoding only matters from the second step; Root's NS runs on the gathered
    matrix with the same Hadamard draws on every rank), and each rank keeps packed states of its own
    (half-row) shard."""
    import torch.multiprocessing as mp
    out = str(tmp_path / "fsdp.pt")
    mp.spawn(_fsdp_worker, args=(2, str(tmp_path / "store"), out), nprocs=2)
    sharded = torch.load(out)
    for states, steps in (("fp32", 2), ("nvfp4", 1)):
        model = fsdp_model()
        train_fsdp_model(model, states, steps)
        for a, b in zip(sharded[states], model.parameters()):
            torch.testing.assert_close(a, b.detach(), atol=1e-6, rtol=1e-5)
    # packed AdamW states / Root momentum of each rank's half-row shard (codes: 2 per byte)
    assert sharded["nvfp4_packed"] == {(1152, 64): (576, 32), (128, 64): (64, 32),
                                       (64, 128): (32, 64)}


def test_the_shipped_root_coefficients_are_what_the_fit_gives():
    """root_coefficients.json holds what tools/fit_root_coefficients.py fits, to its stored digits:
    the 128x128 entry (tiny's square layers, fitted at 64x64 in ~3 s) refitted with the settings of
    the command the file records. A hand-edited or stale set (b off in its third digit) fails."""
    import shlex
    from tools import fit_root_coefficients as fit
    with open(optim.COEFFICIENTS_JSON) as f:
        stored = json.load(f)
    argv = shlex.split(stored["command"])
    setting = lambda flag, default: int(argv[argv.index(flag) + 1]) if flag in argv else default
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ~300 small NVFP4 Newton-Schulz runs: one thread is far faster
    try:
        fresh = fit.fit_coefficients(128, 128, fit_min_dim=setting("--fit-min-dim", 64),
                                     inputs=setting("--inputs", 2), iters=setting("--iters", 40))
    finally:
        torch.set_num_threads(threads)
    assert fresh == stored["coefficients"]["128x128"]
    assert optim.root_coefficients(128, 128) == tuple(fresh["abc"])  # what Root reads
