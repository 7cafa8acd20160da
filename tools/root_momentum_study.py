"""
Root's momentum buffer in 4 bits, decided by measurement. In the seeded ablation the momentum's
storage, not the NVFP4 Newton-Schulz, is what `fullstack`/Root loses (docs/optim.md).

Root (optim.Root's update, op for op) whose momentum buffer goes through a candidate encoding every
step, against the same Root with an fp32 buffer. Newton-Schulz runs in fp32
(optim.root_direction(quantized=False)), so the buffer's storage is the only difference. Two
problems, three seeds, paired by seed:
  lsq   an ill-conditioned least-squares fit (tools/optim_states_study.py's): W (64, 256), feature
        scales 1e-3..1, full batch, cosine lr to lr/10; training loss at the end.
  mlp   a teacher-student MLP 64 -> 256 -> 64 (GELU), minibatch 64, cosine lr to lr/10; held-out
        loss.
Excess: 100 (loss - fp32 momentum's loss) / fp32 momentum's loss per seed, mean +- standard error.
bytes/param: the stored buffer (codes, E4M3 scales, global and row scales) over its elements; it is
Root's whole optimizer state for a matrix. The budget: 1.2.

The hypothesis ("an orthogonalizing update gives every direction of M the same weight, so
quantization noise in M's weak directions becomes a full-size step"), measured two ways:
  open loop  the buffer re-encoded every step along the fp32 run's own gradients, next to the exact
             buffer: relative error of M = g + mu buf, of Root's update NS5(clip(M)) and of
             SGD-Nesterov's M / ||M||; and for M's singular directions below the noise's spectral
             norm, their share of M's energy (what SGD weighs them by), of Root's update and of its
             error.
  training   the same momentum encodings with a normalized SGD-Nesterov step in place of NS5.

    python tools/root_momentum_study.py                # the default candidates (~3 min, 2 cores)
    python tools/root_momentum_study.py --candidates all --out results/root_momentum   # the record
    python tools/root_momentum_study.py --fast         # a smoke run (the test)
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root

import nvfp4  # noqa: E402
import optim  # noqa: E402
from tools.optim_states_study import teacher_student  # noqa: E402

MU = 0.95  # Root's momentum (optim.Root's default)


# --------------------------------------------------------------------------------------------------
# Candidate encodings of the buffer: encode(x, generator) -> state (a dict of tensors and
# NVFP4Tensors), decode(state) -> fp32. Built from nvfp4's public API so that the winner moves into
# optim.py as it is.

def nbytes(state):
    return sum(v.nbytes for v in state.values() if hasattr(v, "nbytes"))


class FP32:
    def encode(self, x, gen):
        return {"x": x.clone()}

    def decode(self, st):
        return st["x"]


class BF16:
    def encode(self, x, gen):
        return {"x": x.bfloat16()}

    def decode(self, st):
        return st["x"].float()


class FP8Row:
    """E4M3 per element, one fp32 scale per row (amax / 448), RTN: 1 byte + 4 / cols."""

    def encode(self, x, gen):
        s = x.abs().amax(dim=1, keepdim=True) / 448
        s = torch.where(s > 0, s, torch.ones_like(s))
        return {"q": (x / s).to(torch.float8_e4m3fn), "row_scale": s}

    def decode(self, st):
        return st["q"].float() * st["row_scale"]


class NVFP4:
    """NVFP4 1x16 of x R, R a rotation of each 16-element block: "h16" (the fixed H16 / 4,
    optim.fwht16), "rht" (diag(random signs) H16 / 4, drawn at every encoding, its 16 signs stored),
    "none". rounding: nvfp4.quantize's rtn / sr / sr_up; four_over_six: 4/6 scaling; row_scale:
    divide each row by its amax first (one fp32 per row): E4M3 block scales relative to the row."""

    def __init__(self, rotation="h16", rounding="sr", four_over_six=True, row_scale=False):
        self.rotation, self.rounding = rotation, rounding
        self.four_over_six, self.row_scale = four_over_six, row_scale

    def encode(self, x, gen):
        st = {}
        if self.row_scale:
            s = x.abs().amax(dim=1, keepdim=True)
            st["row_scale"] = torch.where(s > 0, s, torch.ones_like(s))
            x = x / st["row_scale"]
        H = None
        if self.rotation == "h16":
            x = optim.fwht16(x)
        elif self.rotation == "rht":
            st["signs"] = torch.randint(0, 2, (16,), generator=gen, dtype=torch.uint8)
            H = self._rht(st["signs"])
        st["q"] = nvfp4.quantize(x, (1, 16), self.rounding, four_over_six=self.four_over_six,
                                 generator=gen, hadamard=H, name="Root momentum")
        return st

    @staticmethod
    def _rht(signs):
        return (2.0 * signs.float() - 1)[:, None] * nvfp4.sylvester_hadamard(16, "cpu") / 4

    def decode(self, st):
        y = st["q"].dequantize()
        if self.rotation == "h16":
            y = optim.fwht16(y)
        elif self.rotation == "rht":
            y = nvfp4.hadamard_transform(y, self._rht(st["signs"]).t())  # (x H) H^T = x
        if self.row_scale:
            y = y * st["row_scale"]
        return y


class Residual:
    """Two encodings: the first of x, the second of what the first missed (x - decode(first)). The
    same state as error feedback with the error stored: decode = first + second."""

    def __init__(self, first, second):
        self.first, self.second = first, second

    def encode(self, x, gen):
        a = self.first.encode(x, gen)
        b = self.second.encode(x - self.first.decode(a), gen)
        return {**{f"a.{k}": v for k, v in a.items()}, **{f"b.{k}": v for k, v in b.items()}}

    def decode(self, st):
        part = lambda p: {k[2:]: v for k, v in st.items() if k.startswith(p)}
        return self.first.decode(part("a.")) + self.second.decode(part("b."))


# The winner, written as it goes into optim.py (optim's helpers spelled out with nvfp4's public API)

def encode_momentum_residual(buf):
    """Root's momentum buffer as two NVFP4 levels of buf H16 (1x16 blocks, RTN, 4/6): the first
    level, then its error quantized again. 2 x 0.5625 = 1.125 bytes/param, plus two fp32 global
    scales."""
    optim.check_quantizable(buf, "Root momentum")
    x = optim.fwht16(buf.float())
    hi = nvfp4.quantize(x, (1, 16), "rtn", four_over_six=True, name="Root momentum buf H")
    lo = nvfp4.quantize(x - hi.dequantize(), (1, 16), "rtn", four_over_six=True,
                        name="Root momentum residual")
    return {"codes": hi.codes, "scales": hi.scales, "global_scale": hi.global_scale,
            "res_codes": lo.codes, "res_scales": lo.scales, "res_global_scale": lo.global_scale}


def decode_momentum_residual(state):
    shape = (*state["codes"].shape[:-1], 2 * state["codes"].shape[-1])
    hi = nvfp4.NVFP4Tensor(state["codes"], state["scales"], state["global_scale"], shape, (1, 16))
    lo = nvfp4.NVFP4Tensor(state["res_codes"], state["res_scales"], state["res_global_scale"],
                           shape, (1, 16))
    return optim.fwht16(hi.dequantize() + lo.dequantize())  # (s q + s' q') H16, H16 = H16^-1


class Functions:
    def __init__(self, encode, decode):
        self.encode_fn, self.decode = encode, decode

    def encode(self, x, gen):
        return self.encode_fn(x)


CANDIDATES = {
    "fp32": FP32(),
    "bf16": BF16(),                                                      # 2 bytes: over the budget
    "fp8_row": FP8Row(),
    "m_pipeline": NVFP4("h16", "sr", True),                              # optim.encode_first_moment
    "h16_rtn_46": NVFP4("h16", "rtn", True),
    "h16_sr": NVFP4("h16", "sr", False),
    "h16_sr_up_46": NVFP4("h16", "sr_up", True),
    "none_sr_46": NVFP4("none", "sr", True),
    "none_rtn": NVFP4("none", "rtn", False),                             # optim.encode_direct
    "rht_rtn_46": NVFP4("rht", "rtn", True),
    "rht_sr_46": NVFP4("rht", "sr", True),
    "h16_sr_46_row": NVFP4("h16", "sr", True, row_scale=True),
    "nvfp4_residual": Functions(encode_momentum_residual, decode_momentum_residual),  # the choice
    "res_rtn_sr": Residual(NVFP4("h16", "rtn", True), NVFP4("h16", "sr", True)),
    "res_sr_sr": Residual(NVFP4("h16", "sr", True), NVFP4("h16", "sr", True)),
    "res_rtn_rtn_no46": Residual(NVFP4("h16", "rtn", False), NVFP4("h16", "rtn", False)),
    "res_direct": Residual(NVFP4("none", "rtn", False), NVFP4("none", "rtn", False)),
}
# the default set (< 3 min on 2 cores); "all" adds variants the record found no better than kin
SKIPPED_BY_DEFAULT = ("h16_sr_up_46", "rht_sr_46", "res_sr_sr")


# --------------------------------------------------------------------------------------------------
# Root with the candidate buffer (optim.Root's arithmetic; NS in fp32)

class StudyRoot:
    """buf = mu buf + g (stored through the codec); M = g + mu buf (the fresh buf, as
    optim.Root._momentum); X = NS5(clip(M, 0.9-quantile));
    p <- p (1 - lr wd) - lr 0.2 sqrt(max(m, n)) X. direction="sgd": M / ||M||_F * sqrt(min(m, n))
    instead of X (X's Frobenius norm is sqrt(min(m, n)))."""

    def __init__(self, params, codec, mu=MU, weight_decay=0.0, seed=0, direction="root",
                 trace=None):
        self.params, self.codec, self.mu, self.wd = list(params), codec, mu, weight_decay
        self.direction, self.trace = direction, trace  # trace: gets every step's gradients
        self.gen = torch.Generator().manual_seed(seed)
        self.state = {}

    def direction_of(self, M):
        if self.direction.startswith("root"):  # "root_nvfp4": §3.4's NVFP4 Newton-Schulz
            quantized = self.direction == "root_nvfp4"
            return optim.root_direction(M, quantized=quantized, generator=self.gen)
        return M * (math.sqrt(min(M.shape)) / (M.norm() + 1e-7))

    @torch.no_grad()
    def step(self, lr):
        if self.trace is not None:
            self.trace.append([p.grad.float().clone() for p in self.params])
        for p in self.params:
            g = p.grad.float()
            buf = self.codec.decode(self.state[p]) if p in self.state else torch.zeros_like(g)
            buf = self.mu * buf + g
            self.state[p] = self.codec.encode(buf, self.gen)
            X = self.direction_of(g + self.mu * buf)
            p.mul_(1 - lr * self.wd)
            p.add_(X, alpha=-lr * optim.ROOT_SCALE * math.sqrt(max(p.shape)))

    def bytes_per_param(self):
        return sum(nbytes(st) for st in self.state.values()) / sum(p.numel() for p in self.state)


def cosine(step, steps, lr, warmup=10, floor=0.1):
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


# --------------------------------------------------------------------------------------------------
# Problems

def lsq_data(seed, d=256, out=64, N=1024, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 0, d)[torch.randperm(d, generator=g)]
    X = torch.randn(N, d, generator=g) * scales
    W_true = torch.randn(out, d, generator=g) / (scales.sqrt() * math.sqrt(d))
    Y = X @ W_true.t() + noise * torch.randn(N, out, generator=g)
    return X, Y


def lsq(codec, seed, steps=300, lr=8e-2, direction="root", trace=None):
    """Full-batch Root on the least-squares fit: (final training loss, bytes/param). lr: fp32 Root's
    best of 5e-3 .. 1.6e-1 (x2 steps) at 300 steps."""
    X, Y = lsq_data(seed)
    W = torch.zeros(Y.shape[1], X.shape[1], requires_grad=True)
    opt = StudyRoot([W], codec, seed=seed, direction=direction, trace=trace)
    for step in range(steps):
        loss = ((X @ W.t() - Y) ** 2).mean()
        W.grad = torch.autograd.grad(loss, W)[0]
        opt.step(cosine(step, steps, lr))
    with torch.no_grad():
        return ((X @ W.t() - Y) ** 2).mean().item(), opt.bytes_per_param()


def mlp(codec, seed, steps=300, lr=2e-2, direction="root", trace=None, d=64, h=256, N=2048,
        batch=64):
    """Minibatch Root on the teacher-student MLP: (held-out loss, bytes/param). lr: fp32 Root's best
    of 5e-3 .. 4e-2 (x2 steps) at 300 steps."""
    g, f, X, Y, X_val, Y_val, W1, W2 = teacher_student(seed, d, h, N)
    opt = StudyRoot([W1, W2], codec, seed=seed, direction=direction, trace=trace)
    for step in range(steps):
        idx = torch.randint(0, N, (batch,), generator=g)
        loss = ((f(X[idx], W1, W2) - Y[idx]) ** 2).mean()
        W1.grad, W2.grad = torch.autograd.grad(loss, (W1, W2))
        opt.step(cosine(step, steps, lr))
    with torch.no_grad():
        return ((f(X_val, W1, W2) - Y_val) ** 2).mean().item(), opt.bytes_per_param()


PROBLEMS = {"lsq": lsq, "mlp": mlp}


# --------------------------------------------------------------------------------------------------
# The hypothesis: open-loop error of M and of the update, and where Root's update error goes

def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def spectrum_shares(M, M_hat):
    """For M's singular directions weaker than the quantization noise (sigma_i < ||M_hat - M||_2,
    the ones the noise can turn): their share of the directions, of M's energy (what an SGD step
    weighs them by), of Root's update's energy and of the error in Root's update (projections on
    M's singular vectors along the shorter side)."""
    wide = M.shape[0] <= M.shape[1]
    M, M_hat = (M, M_hat) if wide else (M.t(), M_hat.t())
    U, S, _ = torch.linalg.svd(M, full_matrices=False)
    weak = S < torch.linalg.matrix_norm(M_hat - M, ord=2)
    X = optim.root_direction(M, quantized=False)
    X_hat = optim.root_direction(M_hat, quantized=False)
    Uw = U[:, weak]
    share = lambda Y: ((Uw.t() @ Y).norm() ** 2 / Y.norm() ** 2).item()
    return {"weak_directions": weak.float().mean().item(), "weak_share_of_M": share(M),
            "weak_share_of_root_update": share(X), "weak_share_of_root_error": share(X_hat - X),
            "root_update_error": rel(X_hat, X)}


def open_loop(codec, trace, seed, every=25):
    """The buffer re-encoded every step along a fixed gradient sequence (the fp32 run's), next to
    the exact buffer; at every `every`-th step of the second half: relative errors of
    M = g + mu buf, of Root's update NS5(clip(M)) and of SGD-Nesterov's M / ||M||, and
    spectrum_shares. Means over those steps and the matrices."""
    gen = torch.Generator().manual_seed(seed)
    exact = [torch.zeros_like(g) for g in trace[0]]
    states = [None] * len(exact)
    rows = []
    for t, grads in enumerate(trace):
        for i, g in enumerate(grads):
            buf = codec.decode(states[i]) if states[i] is not None else torch.zeros_like(g)
            buf = MU * buf + g
            states[i] = codec.encode(buf, gen)
            exact[i] = MU * exact[i] + g
            if t >= len(trace) // 2 and (t + 1) % every == 0:
                M, M_hat = g + MU * exact[i], g + MU * buf
                row = {"M_error": rel(M_hat, M),
                       "sgd_update_error": rel(M_hat / M_hat.norm(), M / M.norm())}
                rows.append({**row, **spectrum_shares(M, M_hat)})
    return {k: statistics.fmean(r[k] for r in rows) for k in rows[0]}


# --------------------------------------------------------------------------------------------------
# The grid: training runs and open-loop errors, on worker processes; then tables, JSON, plot

SGD_LR = {"lsq": 4e-2, "mlp": 2e-2}  # normalized SGD-Nesterov's best of 1e-2 .. 3.2e-1 (x2 steps)
_TRACES = {}


def run_job(job):
    """("train", problem, candidate, seed, direction, steps) -> final loss, bytes/param;
    ("open", problem, candidate, seed, steps) -> open_loop's errors along the fp32 run's
    gradients."""
    torch.set_num_threads(1)
    kind, problem, candidate, seed, *rest = job
    start = time.time()
    if kind == "train":
        direction, steps = rest
        lr = PROBLEMS_LR[problem] if direction.startswith("root") else SGD_LR[problem]
        loss, nb = PROBLEMS[problem](CANDIDATES[candidate], seed, steps=steps, lr=lr,
                                     direction=direction)
        return job, {"loss": loss, "bytes_per_param": nb, "seconds": time.time() - start}
    (steps,) = rest
    key = (problem, seed, steps)
    if key not in _TRACES:  # one fp32 run per worker and (problem, seed): jobs come sorted by them
        _TRACES.clear()
        _TRACES[key] = []
        PROBLEMS[problem](CANDIDATES["fp32"], seed, steps=steps, trace=_TRACES[key])
    errors = open_loop(CANDIDATES[candidate], _TRACES[key], seed)
    return job, {**errors, "seconds": time.time() - start}


PROBLEMS_LR = {"lsq": 8e-2, "mlp": 2e-2}


def jobs_for(candidates, problems, seeds, steps, open_seeds, sgd_candidates, root="root"):
    jobs = [("train", p, c, s, root, steps) for p in problems for c in candidates for s in seeds]
    jobs += [("train", p, c, s, "sgd", steps)
             for p in problems for c in sgd_candidates for s in seeds]
    jobs += [("open", p, c, s, steps) for p in problems for s in open_seeds for c in candidates
             if c != "fp32"]
    return jobs


def excess(results, problem, candidate, seeds, direction="root"):
    """Per seed 100 (loss - fp32's) / fp32's; (mean, standard error, [per seed])."""
    d = [100 * (results[("train", problem, candidate, s, direction)]["loss"] /
                results[("train", problem, "fp32", s, direction)]["loss"] - 1) for s in seeds]
    se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else None
    return statistics.fmean(d), se, d


def seed_std(results, problem, seeds, direction="root"):
    """fp32's seed-to-seed std of the loss, in % of its mean: the noise one seed makes."""
    losses = [results[("train", problem, "fp32", s, direction)]["loss"] for s in seeds]
    return 100 * statistics.stdev(losses) / statistics.fmean(losses) if len(losses) > 1 else None


def pm(mean, se, digits=2):
    return f"{mean:+.{digits}f}" + (f" ± {se:.{digits}f}" if se is not None else "")


def tables(results, candidates, problems, seeds, open_seeds, sgd_candidates, root="root"):
    lines = ["| candidate | bytes/param | " + " | ".join(f"{p} excess %" for p in problems) + " | "
             + " | ".join(f"{p} M err / Root update err" for p in problems) + " |",
             "|---|---|" + "---|" * 2 * len(problems)]
    for c in candidates:
        nb = results[("train", problems[0], c, seeds[0], root)]["bytes_per_param"]
        cells = [f"{nb:.3f}"]
        for p in problems:
            cells.append("–" if c == "fp32" else pm(*excess(results, p, c, seeds, root)[:2]))
        for p in problems:
            o = [results[("open", p, c, s)] for s in open_seeds if ("open", p, c, s) in results]
            cells.append("–" if not o else f"{statistics.fmean(r['M_error'] for r in o):.3f} / "
                         f"{statistics.fmean(r['root_update_error'] for r in o):.3f}")
        lines.append(f"| `{c}` | " + " | ".join(cells) + " |")
    noise = ", ".join(f"{p} {seed_std(results, p, seeds, root):.2f}%" for p in problems
                      if seed_std(results, p, seeds, root) is not None)
    lines += ["", f"fp32 momentum's seed-to-seed std of the loss: {noise or 'n/a (one seed)'}."]
    if sgd_candidates:
        lines += ["", "| problem | candidate | Root excess % | SGD-Nesterov excess % |",
                  "|---|---|---|---|"]
        for p in problems:
            for c in sgd_candidates:
                if c != "fp32":
                    lines.append(f"| {p} | `{c}` | {pm(*excess(results, p, c, seeds, root)[:2])} | "
                                 f"{pm(*excess(results, p, c, seeds, 'sgd')[:2])} |")
    keys = ("M_error", "sgd_update_error", "root_update_error", "weak_directions",
            "weak_share_of_M", "weak_share_of_root_update", "weak_share_of_root_error")
    if open_seeds:
        lines += ["", "| problem | candidate | " + " | ".join(keys) + " |",
                  "|---|---|" + "---|" * len(keys)]
    for p in problems:
        for c in candidates:
            o = [results[("open", p, c, s)] for s in open_seeds if ("open", p, c, s) in results]
            if o:
                lines.append(f"| {p} | `{c}` | " + " | ".join(
                    f"{statistics.fmean(r[k] for r in o):.3f}" for k in keys) + " |")
    return "\n".join(lines)


def plot(results, candidates, problems, seeds, path, root="root"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [c for c in candidates if c != "fp32"]
    fig, axes = plt.subplots(1, len(problems), figsize=(6 * len(problems), 0.35 * len(names) + 1.5),
                             sharey=True, squeeze=False)
    for ax, p in zip(axes[0], problems):
        ex = [excess(results, p, c, seeds, root) for c in names]
        nb = [results[("train", p, c, seeds[0], root)]["bytes_per_param"] for c in names]
        colors = ["tab:green" if b <= 1.2 else "tab:gray" for b in nb]
        ax.barh(range(len(names)), [e[0] for e in ex], xerr=[e[1] or 0 for e in ex], color=colors)
        for i, (e, b) in enumerate(zip(ex, nb)):
            ax.text(max(e[0], 0) + 0.2, i, f"{b:.2f} B", va="center", fontsize=7)
        std = seed_std(results, p, seeds, root)
        if std is not None:
            ax.axvspan(-std, std, color="tab:blue", alpha=0.15, label="fp32 seed std")
            ax.legend(fontsize=8, loc="lower right")
        ax.axvline(0, color="k", lw=0.8)
        ax.set_title(f"{p}: loss over fp32 momentum (%), mean ± SE of {len(seeds)} seeds")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Root momentum encodings vs fp32 momentum")
    default = ",".join(c for c in CANDIDATES if c not in SKIPPED_BY_DEFAULT)
    parser.add_argument("--candidates", default=default, help="comma-separated names, or all")
    parser.add_argument("--problems", default=",".join(PROBLEMS))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--open_seeds", default="0",
                        help="seeds of the open-loop errors ('' for none)")
    parser.add_argument("--sgd", default="fp32,m_pipeline",
                        help="candidates also trained with SGD-Nesterov ('' for none)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ns", default="fp32", choices=("fp32", "nvfp4"),
                        help="Root's Newton-Schulz: fp32 (the buffer's storage the only "
                        "difference) or §3.4's NVFP4 iteration (as in fullstack)")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (one thread each)")
    parser.add_argument("--out", default=None,
                        help="write study.json, table.md, study.png into this folder")
    parser.add_argument("--fast", action="store_true",
                        help="a smoke run: 30 steps, 3 candidates, seed 0")
    args = parser.parse_args(argv)
    if args.fast:
        args.candidates, args.seeds, args.steps = "fp32,m_pipeline,nvfp4_residual", "0", 30
    if args.candidates == "all":
        args.candidates = ",".join(CANDIDATES)
    split = lambda s: [x for x in s.split(",") if x]
    candidates, problems, sgd = split(args.candidates), split(args.problems), split(args.sgd)
    bad = [c for c in candidates + sgd if c not in CANDIDATES]
    bad += [p for p in problems if p not in PROBLEMS]
    if bad:
        parser.error(f"unknown candidate or problem {bad[0]!r}; "
                     f"candidates: {', '.join(CANDIDATES)}")
    candidates = ["fp32"] + [c for c in candidates if c != "fp32"]
    sgd = (["fp32"] + [c for c in sgd if c != "fp32"]) if sgd else []
    try:
        seeds = [int(s) for s in split(args.seeds)]
        open_seeds = [int(s) for s in split(args.open_seeds)]
    except ValueError:
        parser.error("--seeds / --open_seeds: comma-separated integers")
    root = "root" if args.ns == "fp32" else "root_nvfp4"
    jobs = jobs_for(candidates, problems, seeds, args.steps, open_seeds, sgd, root)
    start = time.time()
    cpu0 = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                   resource.getrusage(resource.RUSAGE_CHILDREN)))
    if args.jobs > 1:
        import multiprocessing
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            done = pool.map(run_job, jobs, chunksize=1)
    else:
        done = [run_job(j) for j in jobs]
    results = {j[:5] if j[0] == "train" else j[:4]: r for j, r in done}
    text = tables(results, candidates, problems, seeds, open_seeds, sgd, root)
    wall = time.time() - start
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    cpu = sum(u.ru_utime + u.ru_stime for u in usage) - cpu0
    print(text)
    print(f"\n{len(jobs)} jobs, {wall:.0f} s on {args.jobs} worker(s), {cpu:.0f} CPU s")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        command = "python tools/root_momentum_study.py " + " ".join(argv or sys.argv[1:])
        record = {"command": command,
                  "date": time.strftime("%Y-%m-%d"), "wall_s": round(wall, 1), "steps": args.steps,
                  "mu": MU, "ns": args.ns, "lr_root": PROBLEMS_LR, "lr_sgd": SGD_LR, "seeds": seeds,
                  "open_seeds": open_seeds, "hardware": f"CPU ({os.cpu_count()} cores)",
                  "cpu_s": round(cpu, 1),
                  "runs": [{"job": list(j), **{k: round(v, 6) for k, v in r.items()}}
                           for j, r in done]}
        with open(os.path.join(args.out, "study.json"), "w") as f:
            json.dump(record, f, indent=1)
        with open(os.path.join(args.out, "table.md"), "w") as f:
            f.write(text + "\n")
        plot(results, candidates, problems, seeds, os.path.join(args.out, "study.png"), root)
    return results


if __name__ == "__main__":
    main()
