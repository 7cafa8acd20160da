"""
Optimizer-state numerics, decided by measurement (paper §3.3 leaves v's rounding, its mean tile and
our floor open).

AdamW with its moments stored each step through optim.py's encoders, against fp32 AdamW, on two
problems:
  lsq   an ill-conditioned least-squares fit: W (64, 256), inputs whose 256 feature scales span
        1e-3 .. 1 in random order along W's rows (Hessian condition ~1e6), target weights
        ~ 1 / sqrt(scale) (the small features carry signal), label noise 0.1: the loss floor is
        0.01 * (1 - 256/1024) = 0.0075, so the table shows how close each variant gets to the floor.
        Full batch, constant lr. Training loss after 300 and 600 steps.
  mlp   an easy teacher-student MLP 64 -> 256 -> 64 (GELU), 2048 training points, batch 256,
        held-out loss after 300 steps.
Three seeds each. Variants are named "v rounding, v tile, floor": RTN / SR, 16 .. 128 elements per
fp32 mean, the floor on the decoded sqrt(v) as a fraction of the tile mean (0: max(., 0)); m is
always optim's (SR). Plus diagnostics with only one moment quantized and App. 13's direct states.
"sr 128 1/4" is optim's default.
bytes/param counts the stored state of the quantized tensors (codes, E4M3 scales, global scales,
tile means).

    python tools/optim_states_study.py      # the table in docs/optim.md (~15 min on 2 CPU cores)
    python tools/optim_states_study.py --variants "fp32,rtn 128 1/4,sr 128 1/4" --seeds 0
"""

import argparse
import math
import os
import statistics
import sys

import torch
import torch.nn.functional as F

# the repo root: optim
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import optim  # noqa: E402

# name -> (m encoding, v encoding): "fp32", "direct", "sr" (m: optim.encode_first_moment) or, for v,
# the arguments of optim.encode_second_moment / decode_second_moment as "rounding tile floor"
def v_pipeline(rounding, tile, floor):
    return dict(rounding=rounding, tile=tile, floor=floor)


VARIANTS = {
    "fp32": ("fp32", "fp32"),
    "direct": ("direct", "direct"),                                   # App. 13's naive states
    "m only": ("sr", "fp32"),  # diagnostics: one moment quantized
    "v only rtn": ("fp32", v_pipeline("rtn", 128, 1 / 4)),
    "v only sr": ("fp32", v_pipeline("sr", 128, 1 / 4)),
    "rtn 128 1/4": ("sr", v_pipeline("rtn", 128, 1 / 4)),  # the default before this study
    "rtn 64 1/4": ("sr", v_pipeline("rtn", 64, 1 / 4)),
    "rtn 32 1/4": ("sr", v_pipeline("rtn", 32, 1 / 4)),
    "rtn 16 1/4": ("sr", v_pipeline("rtn", 16, 1 / 4)),
    "rtn 128 1/16": ("sr", v_pipeline("rtn", 128, 1 / 16)),
    "rtn 128 0": ("sr", v_pipeline("rtn", 128, 0.0)),                 # no floor: max(root, 0)
    "sr 128 1/4": ("sr", v_pipeline("sr", 128, 1 / 4)),               # optim's default
    "sr 64 1/4": ("sr", v_pipeline("sr", 64, 1 / 4)),
    "sr 16 1/4": ("sr", v_pipeline("sr", 16, 1 / 4)),
    "sr 128 1/16": ("sr", v_pipeline("sr", 128, 1 / 16)),
    "sr 128 0": ("sr", v_pipeline("sr", 128, 0.0)),
}
assert VARIANTS["sr 128 1/4"][1] == v_pipeline(optim.CONTRACT["adamw.v"].rounding,
                                               optim.CONTRACT["adamw.v.tile"],
                                               optim.CONTRACT["adamw.v.floor"])


class StudyAdamW:
    """AdamW (optim.adamw_update_math) whose m and v go through the variant's encoders every step;
    2-D tensors of >= optim.MIN_QUANT_NUMEL elements only (as QuantizedAdamW), others keep fp32
    states."""

    def __init__(self, params, variant, lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, seed=0):
        self.params, (self.m_enc, self.v_enc) = list(params), VARIANTS[variant]
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        self.gen = torch.Generator().manual_seed(seed)
        self.state = {p: {"step": 0} for p in self.params}

    def _encode(self, kind, x, quantized):
        if not quantized or kind == "fp32":
            return {"x": x}
        if kind == "direct":
            return optim.encode_direct(x)
        if kind == "sr":
            return optim.encode_first_moment(x, self.gen)
        return optim.encode_second_moment(x, kind["tile"], kind["rounding"])

    def _decode(self, kind, st, quantized):
        if not quantized or kind == "fp32":
            return st["x"]
        if kind == "direct":
            return optim.decode_direct(st)
        if kind == "sr":
            return optim.decode_first_moment(st)
        return optim.decode_second_moment(st, kind["floor"])

    @torch.no_grad()
    def step(self):
        b1, b2 = self.betas
        for p in self.params:
            st = self.state[p]
            q = p.dim() == 2 and p.numel() >= optim.MIN_QUANT_NUMEL and p.shape[-1] % 16 == 0
            if st["step"] == 0:
                st["m"] = self._encode(self.m_enc, torch.zeros_like(p), q)
                st["v"] = self._encode(self.v_enc, torch.zeros_like(p), q)
            st["step"] += 1
            m, v = self._decode(self.m_enc, st["m"], q), self._decode(self.v_enc, st["v"], q)
            p_new, m, v = optim.adamw_update_math(p, p.grad, m, v, self.lr, b1, b2, self.eps,
                                                  self.wd, st["step"])
            p.copy_(p_new)
            st["m"], st["v"] = self._encode(self.m_enc, m, q), self._encode(self.v_enc, v, q)

    def bytes_per_param(self):
        """Stored state bytes per parameter of the quantized tensors (fp32 states: 8)."""
        n = b = 0
        for p, st in self.state.items():
            if p.dim() == 2 and p.numel() >= optim.MIN_QUANT_NUMEL:
                n += p.numel()
                b += sum(t.nbytes for key in ("m", "v") for t in st[key].values()
                         if torch.is_tensor(t))
        return b / n


def least_squares(variant, seed, checkpoints=(300, 600), lr=1e-2, d=256, out=64, N=1024, noise=0.1):
    g = torch.Generator().manual_seed(seed)
    # ill-conditioned, no order along a tile
    scales = torch.logspace(-3, 0, d)[torch.randperm(d, generator=g)]
    X = torch.randn(N, d, generator=g) * scales                         # (N, d)
    # small features carry signal
    W_true = torch.randn(out, d, generator=g) / (scales.sqrt() * math.sqrt(d))
    Y = X @ W_true.t() + noise * torch.randn(N, out, generator=g)       # (N, out)
    W = torch.zeros(out, d, requires_grad=True)
    opt = StudyAdamW([W], variant, lr, seed=seed)
    losses = {}
    for step in range(1, max(checkpoints) + 1):
        loss = ((X @ W.t() - Y) ** 2).mean()
        W.grad = torch.autograd.grad(loss, W)[0]
        opt.step()
        if step in checkpoints:
            losses[step] = ((X @ W.detach().t() - Y) ** 2).mean().item()
    return losses, opt.bytes_per_param()


def teacher_student(seed, d, h, N):
    """The teacher-student GELU MLP problem (also tools/root_momentum_study.py's): (generator, f,
    X, Y, X_val, Y_val, W1, W2), the student's weights requiring grad; the generator goes on to draw
    the batches."""
    g = torch.Generator().manual_seed(seed)
    teacher = [torch.randn(h, d, generator=g) / math.sqrt(d),
               torch.randn(d, h, generator=g) / math.sqrt(h)]
    f = lambda x, W1, W2: F.gelu(x @ W1.t()) @ W2.t()
    X, X_val = torch.randn(N, d, generator=g), torch.randn(1024, d, generator=g)
    Y = f(X, *teacher) + 0.1 * torch.randn(N, d, generator=g)
    Y_val = f(X_val, *teacher) + 0.1 * torch.randn(1024, d, generator=g)
    W1 = (torch.randn(h, d, generator=g) / math.sqrt(d)).requires_grad_()
    W2 = (torch.randn(d, h, generator=g) / math.sqrt(h)).requires_grad_()
    return g, f, X, Y, X_val, Y_val, W1, W2


def mlp(variant, seed, steps=300, lr=3e-3, d=64, h=256, N=2048, batch=256):
    g, f, X, Y, X_val, Y_val, W1, W2 = teacher_student(seed, d, h, N)
    opt = StudyAdamW([W1, W2], variant, lr, weight_decay=0.0, seed=seed)
    for _ in range(steps):
        idx = torch.randint(0, N, (batch,), generator=g)
        loss = ((f(X[idx], W1, W2) - Y[idx]) ** 2).mean()
        W1.grad, W2.grad = torch.autograd.grad(loss, (W1, W2))
        opt.step()
    with torch.no_grad():
        return {steps: ((f(X_val, W1, W2) - Y_val) ** 2).mean().item()}, opt.bytes_per_param()


def fmt(values):
    if any(not math.isfinite(x) for x in values):
        return "diverged"
    return (f"{statistics.mean(values):.4g} ± "
            f"{statistics.stdev(values) if len(values) > 1 else 0:.2g}")


def main():
    parser = argparse.ArgumentParser(
        description="AdamW state encodings vs fp32 AdamW (docs/optim.md's table)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated names of VARIANTS")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--problems", default="lsq,mlp")
    args = parser.parse_args()
    variants = args.variants.split(",")
    unknown = ([v for v in variants if v not in VARIANTS]
               + [p for p in args.problems.split(",") if p not in ("lsq", "mlp")])
    if unknown:
        print(f"optim_states_study: unknown variant or problem {unknown[0]!r}; "
              f"variants: {', '.join(VARIANTS)}", file=sys.stderr)
        sys.exit(2)
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        print(f"optim_states_study: --seeds {args.seeds!r}: expected comma-separated integers",
              file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    problems = {"lsq": least_squares, "mlp": mlp}
    columns = [("lsq", 300), ("lsq", 600), ("mlp", 300)]
    columns = [c for c in columns if c[0] in args.problems.split(",")]
    print("| variant | bytes/param | " + " | ".join(f"{p} @{s}" for p, s in columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for variant in variants:
        results, nbytes = {}, None
        for name in dict.fromkeys(p for p, _ in columns):
            for seed in seeds:
                losses, nbytes = problems[name](variant, seed)
                for step, loss in losses.items():
                    results.setdefault((name, step), []).append(loss)
        cells = [fmt(results[c]) for c in columns]
        print(f"| {variant} | {nbytes:.3f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
