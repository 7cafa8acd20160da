"""tools/root_momentum_study.py: the candidate encodings of Root's momentum, the study's fast mode,
and the winner's code (the one that goes into optim.py) against its generic spelling."""
import torch

from tools import root_momentum_study as study


def heavy_rows(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 256, generator=g) * torch.logspace(-3, 0, 64)[:, None]


def test_every_candidate_round_trips_within_its_grid():
    x = heavy_rows()
    errors, budget = {}, {}
    for name, codec in study.CANDIDATES.items():
        state = codec.encode(x, torch.Generator().manual_seed(0))
        y = codec.decode(state)
        assert y.shape == x.shape and y.dtype == torch.float32 and torch.isfinite(y).all(), name
        errors[name] = ((y - x).norm() / x.norm()).item()
        budget[name] = study.nbytes(state) / x.numel()
    assert errors["fp32"] == 0 and budget["fp32"] == 4
    one_level = [n for n in study.CANDIDATES if budget[n] < 0.6]
    two_level = [n for n in study.CANDIDATES if n.startswith(("res_", "nvfp4_residual"))]
    assert len(one_level) == 9 and all(0.03 < errors[n] < 0.25 for n in one_level)
    assert all(errors[n] < 0.03 and 1.12 < budget[n] <= 1.2 for n in two_level)  # the budget: 1.2
    assert budget["m_pipeline"] == 0.5625 + 4 / x.numel()  # codes, E4M3 scales, fp32 global scale


def test_the_winner_is_the_generic_two_level_encoding():
    x = heavy_rows(1)
    generic = study.Residual(study.NVFP4("h16", "rtn", True), study.NVFP4("h16", "rtn", True))
    winner = study.CANDIDATES["nvfp4_residual"]
    a = winner.decode(winner.encode(x, None))
    b = generic.decode(generic.encode(x, None))
    assert torch.allclose(a, b, rtol=0, atol=1e-6 * x.abs().max().item())
    state = study.encode_momentum_residual(x)
    assert set(state) == {"codes", "scales", "global_scale",
                          "res_codes", "res_scales", "res_global_scale"}
    assert state["codes"].dtype == torch.uint8 and state["scales"].dtype == torch.float8_e4m3fn
    zeros = study.decode_momentum_residual(study.encode_momentum_residual(torch.zeros(32, 64)))
    assert (zeros == 0).all()


def test_fast_mode_is_deterministic_and_shows_the_effect(capsys):
    argv = ["--fast", "--jobs", "1", "--problems", "lsq", "--open_seeds", "0"]
    numbers = lambda results: {k: {m: v for m, v in r.items() if m != "seconds"}
                               for k, r in results.items()}
    first = study.main(argv)
    assert numbers(first) == numbers(study.main(argv))  # seeded: the same numbers every time
    out = capsys.readouterr().out
    assert "| `nvfp4_residual` | 1.125 |" in out and "weak_share_of_root_error" in out
    loss = {c: first[("train", "lsq", c, 0, "root")]["loss"]
            for c in ("fp32", "m_pipeline", "nvfp4_residual")}
    # a 30-step trajectory: its digits differ between CPUs, so what is held is the ordering with a
    # wide margin (here one level costs ~25% of fp32's loss, two levels ~0.2%): one NVFP4 level
    # costs Root, even in 30 steps; two levels sit far closer to fp32 than one does
    excess = {c: loss[c] / loss["fp32"] - 1 for c in ("m_pipeline", "nvfp4_residual")}
    assert excess["m_pipeline"] > 0.05 and abs(excess["nvfp4_residual"]) < excess["m_pipeline"] / 5
    m, res = first[("open", "lsq", "m_pipeline", 0)], first[("open", "lsq", "nvfp4_residual", 0)]
    assert m["root_update_error"] > 2 * m["M_error"]  # Root amplifies M's error, SGD passes it
    assert abs(m["sgd_update_error"] - m["M_error"]) < 0.1 * m["M_error"]
    assert res["M_error"] < m["M_error"] / 5


def test_root_with_the_nvfp4_newton_schulz_steps():
    torch.manual_seed(0)
    W = torch.randn(32, 64, requires_grad=True)
    opt = study.StudyRoot([W], study.CANDIDATES["nvfp4_residual"], direction="root_nvfp4")
    W.grad = torch.randn(32, 64)
    before = W.detach().clone()
    opt.step(1e-2)
    step = (W.detach() - before) / (1e-2 * 0.2 * 8)  # lr * ROOT_SCALE * sqrt(max(m, n))
    assert torch.isfinite(step).all() and 0.3 < torch.linalg.matrix_norm(step, 2) < 1.5
    assert opt.bytes_per_param() == 1.125 + 8 / W.numel()


def test_the_shipped_root_momentum_is_the_studys_winner():
    """optim.CONTRACT's Root momentum (two levels) encodes bit for bit as the study's winner."""
    import optim
    x = heavy_rows(2)
    levels = optim.CONTRACT["root.momentum.levels"]
    shipped = optim.encode_first_moment(x, entry="root.momentum", levels=levels)
    winner = study.encode_momentum_residual(x)
    assert set(shipped) == set(winner)
    assert all(torch.equal(shipped[k].view(torch.uint8), winner[k].view(torch.uint8))
               if shipped[k].dtype == torch.float8_e4m3fn else torch.equal(shipped[k], winner[k])
               for k in winner)
    assert torch.equal(optim.decode_first_moment(shipped, entry="root.momentum"),
                       study.decode_momentum_residual(winner))
