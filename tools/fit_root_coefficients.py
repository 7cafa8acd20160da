"""
Fit Root's Newton-Schulz coefficients (a, b, c) per matrix shape for the NVFP4 iteration
(paper §3.4) and write root_coefficients.json, which optim.root_coefficients reads; print the
numbers behind Fig. 4a / 4b.

Why fit at all: ROOT publishes sets for four shapes and Muon one for everything, all tuned for
fp32/bf16 NS. With every NS matmul in NVFP4 those sets amplify 4-bit rounding until the iteration
explodes (Fig. 4b, taken to its end at our sizes). We minimize the orthogonality error
||X5 - U V^T|| / ||U V^T|| of the 5-step NVFP4 NS over representative inputs (Gaussian and
momentum-like, soft-thresholded as Root does) with Nelder-Mead (the quantized NS is not
differentiable), rejecting every set that fails optim.coefficients_stable. On a CPU the fit runs at
a reduced size with the aspect ratio kept (--fit-min-dim): shapes with one aspect ratio share one
set.

    # writes the JSON
    python tools/fit_root_coefficients.py --configs tiny,toy,1b,3b --fit-min-dim 64 --iters 25
    # full size, GPU
    python tools/fit_root_coefficients.py --configs toy,1b,3b --fit-min-dim 0 --device cuda
    # Fig. 4a/4b numbers
    python tools/fit_root_coefficients.py --fig4 --configs toy
"""

import argparse
import json
import math
import os
import sys
import time

import torch

# the repo root: optim, model
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import model  # noqa: E402  (config_shapes: the Root-routed shapes of the configs)
import optim  # noqa: E402


# --------------------------------------------------------------------------------------------------
# The objective: distance of NS's output to the exact polar factor

def polar_factor(G):
    """U V^T of G = U S V^T (float64 SVD): the exact orthogonalization NS approximates."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def polar_error(X, G, P=None):
    """Orthogonality error ||X - U V^T||_F / ||U V^T||_F: the distance of NS's output to the exact
    orthogonal polar factor of its input G (pass P = polar_factor(G) to reuse it)."""
    P = polar_factor(G) if P is None else P
    return ((X.double() - P).norm() / P.norm()).item()


def representative_inputs(m, n, count=2, seed=0, device=None):
    """Matrices like Root's NS input: half Gaussian, half momentum-like (a decaying low-rank part
    plus noise), each soft-thresholded at its 0.9-quantile as Root does."""
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    inputs = []
    for i in range(count):
        G = torch.randn(m, n, generator=g, device=device)
        if i % 2:
            r = max(1, min(m, n) // 8)
            U = torch.randn(m, r, generator=g, device=device)
            V = torch.randn(r, n, generator=g, device=device)
            decay = torch.logspace(0, -2, r, device=device)
            G = 0.3 * G + (U * decay) @ V * (3.0 / math.sqrt(r))
        eps = optim.quantile(G.abs(), 0.9)
        inputs.append(G.clamp(-eps, eps))
    return inputs


def ns_error(coefficients, inputs, quantized=True, seed=0, cap=10.0, polars=None):
    """Mean polar_error of NS(input) over `inputs` (the same Hadamard draws for every coefficient
    set).
    polars: the inputs' polar factors, if already computed (the fit evaluates the same inputs many
    times)."""
    errors = []
    for i, G in enumerate(inputs):
        g = torch.Generator(device=G.device).manual_seed(seed + i)
        X = optim.newton_schulz(G, coefficients=coefficients, quantized=quantized, generator=g)
        e = polar_error(X, G, None if polars is None else polars[i])
        errors.append(e if math.isfinite(e) else cap)
    return min(sum(errors) / len(errors), cap)


def nelder_mead(f, x0, step=0.3, iters=40, tol=1e-4):
    """Minimize f over R^d (derivative-free: the quantized NS is not differentiable)."""
    d = len(x0)
    simplex = [list(x0)] + [[x + (step if j == i else 0.0) for j, x in enumerate(x0)]
                            for i in range(d)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = sorted(range(d + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / d for j in range(d)]
        towards = lambda t: [c + t * (w - c) for c, w in zip(centroid, simplex[-1])]
        reflected = towards(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = towards(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = towards(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink towards the best point
                simplex = [simplex[0]] + [[b + 0.5 * (x - b) for x, b in zip(p, simplex[0])]
                                          for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    best = min(range(d + 1), key=values.__getitem__)
    return simplex[best], values[best]


def reduced_shape(m, n, fit_min_dim):
    """(m, n) scaled so that min(m, n) = fit_min_dim, aspect ratio kept, multiples of 16
    (0: full size)."""
    if not fit_min_dim or min(m, n) <= fit_min_dim:
        return m, n
    scale = fit_min_dim / min(m, n)
    return tuple(max(16, 16 * round(d * scale / 16)) for d in (m, n))


def fit_coefficients(m, n, fit_min_dim=64, inputs=2, iters=40, seed=0, device=None):
    """Fit (a, b, c) for the quantized NS of an m x n matrix: minimize the mean orthogonality error
    after 5 NVFP4 steps over representative inputs, rejecting every set that fails
    optim.coefficients_stable (objective +inf).
    Started from a conservative stable set and from Muon's."""
    fm, fn = reduced_shape(min(m, n), max(m, n), fit_min_dim)
    data = representative_inputs(fm, fn, inputs, seed, device)
    polars = [polar_factor(G) for G in data]

    def objective(abc):
        return (ns_error(tuple(abc), data, seed=seed, polars=polars)
                if optim.coefficients_stable(abc) else float("inf"))

    best, best_err = None, float("inf")
    for start in ((2.0, -1.5, 0.5), optim.MUON_COEFFICIENTS):
        abc, err = nelder_mead(objective, start, iters=iters)
        if err < best_err:
            best, best_err = abc, err
    return {"abc": [round(x, 4) for x in best], "fit_shape": [fm, fn],
            "fit_error": round(best_err, 4),
            "muon_error": round(ns_error(optim.MUON_COEFFICIENTS, data, seed=seed,
                                         polars=polars), 4)}


def config_shapes(names):
    """(min, max) shapes of the Root-routed matrices of model.py's configs (q/o, k/v,
    gate/up/down)."""
    shapes = set()
    for name in names:
        cfg = model.config_from_name(name)
        kv = cfg.n_kv_head * cfg.head_dim
        for a, b in ((cfg.n_embd, cfg.n_embd), (kv, cfg.n_embd), (cfg.ffn_hidden, cfg.n_embd)):
            if max(a, b) <= optim.MAX_ROOT_ASPECT * min(a, b):
                shapes.add((min(a, b), max(a, b)))
    return sorted(shapes)


# --------------------------------------------------------------------------------------------------
# Fig. 4 numbers (figures.py plots them)

@torch.no_grad()
def fig4a_numbers(v, m=None):
    """Fig. 4a: error of storing v directly in NVFP4 against the §3.3 pipeline (SR, optim's
    default; and with RTN).
    Returns {method: {v_rel_err, sqrt_rel_err, zero_fraction, update_rel_err}}: relative Frobenius
    errors of v and of sqrt(v) (Adam's denominator), the fraction of positive entries decoding to
    <= 0, and (given m) the error of the Adam direction m / (sqrt(v) + 1e-8)."""
    v = v.float()
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    decoded = {"direct": optim.decode_direct(optim.encode_direct(v)),
               "pipeline": optim.decode_second_moment(optim.encode_second_moment(
                   v, rounding="sr", generator=torch.Generator(v.device).manual_seed(0))),
               "pipeline_rtn": optim.decode_second_moment(
                   optim.encode_second_moment(v, rounding="rtn"))}
    out = {}
    for name, v_hat in decoded.items():
        row = {"v_rel_err": rel(v_hat, v), "sqrt_rel_err": rel(v_hat.clamp(min=0).sqrt(), v.sqrt()),
               "zero_fraction": (v_hat[v > 0] <= 0).float().mean().item()}
        if m is not None:
            u = m / (v.sqrt() + 1e-8)
            row["update_rel_err"] = rel(m / (v_hat.clamp(min=0).sqrt() + 1e-8), u)
        out[name] = row
    for key in ("v_rel_err", "sqrt_rel_err"):
        out[f"pipeline_reduction_{key}"] = 1 - out["pipeline"][key] / out["direct"][key]
    return out


@torch.no_grad()
def ema_requantization_error(steps=200, R=64, C=512, seed=0):
    """v re-encoded every step (as in training) against the exact fp32 EMA, for RTN and SR in the
    pipeline and for the direct encoding: relative error of sqrt(v) after `steps` steps
    (the RTN-vs-SR question)."""
    g0 = torch.Generator().manual_seed(seed)
    rs = torch.exp(torch.randn(R, 1, generator=g0) * 1.5)
    exact = torch.zeros(R, C)
    stored = {"rtn": torch.zeros(R, C), "sr": torch.zeros(R, C), "direct": torch.zeros(R, C)}
    for _ in range(steps):
        g2 = (torch.randn(R, C, generator=g0) * rs) ** 2
        exact = 0.95 * exact + 0.05 * g2
        for name, v in stored.items():
            v = 0.95 * v + 0.05 * g2
            stored[name] = (optim.decode_direct(optim.encode_direct(v)) if name == "direct" else
                            optim.decode_second_moment(
                                optim.encode_second_moment(v, rounding=name)))
    return {name: (v.clamp(min=0).sqrt() - exact.sqrt()).norm().item() / exact.sqrt().norm().item()
            for name, v in stored.items()}


def synthetic_moments(R=256, C=1024, row_sigma=1.5, col_sigma=1.0, steps=30, seed=0):
    """Adam moments of a synthetic gradient stream: Gaussian with log-normal row and column scales
    (LLM weight gradients have strongly varying row/column magnitudes) and 1% spikes. Returns
    bias-corrected (m, v)."""
    g0 = torch.Generator().manual_seed(seed)
    rs = torch.exp(torch.randn(R, 1, generator=g0) * row_sigma)
    cs = torch.exp(torch.randn(1, C, generator=g0) * col_sigma)
    m, v = torch.zeros(R, C), torch.zeros(R, C)
    for _ in range(steps):
        g = (torch.randn(R, C, generator=g0) * rs * cs
             * (1 + 3 * (torch.rand(R, C, generator=g0) < 0.01)))
        m, v = 0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g * g
    return m / (1 - 0.9**steps), v / (1 - 0.95**steps)


def fig4b_numbers(shapes, fit_min_dim=64, inputs=2, seed=1234, device=None):
    """Fig. 4b: orthogonality error (polar_error) of the NVFP4 NS (5 steps) with the shape's Root
    coefficients against Muon's and against ROOT's published set of the nearest aspect ratio, plus
    the fp32 NS with Muon's as the unquantized reference. Fresh inputs (seed differs from the
    fit's). Errors are capped at 10 (exploded)."""
    rows = []
    for m, n in shapes:
        fm, fn = reduced_shape(m, n, fit_min_dim)
        data = representative_inputs(fm, fn, inputs, seed, device)
        root = optim.root_coefficients(m, n, quantized=True)
        aspect = math.log(max(m, n) / min(m, n))
        published = min(optim.PUBLISHED_COEFFICIENTS,
                        key=lambda k: abs(math.log(k[1] / k[0]) - aspect))
        rows.append({"shape": [m, n], "eval_shape": [fm, fn], "root_abc": list(root),
                     "nvfp4_root": ns_error(root, data, seed=seed),
                     "nvfp4_muon": ns_error(optim.MUON_COEFFICIENTS, data, seed=seed),
                     "nvfp4_published_nearest": ns_error(optim.PUBLISHED_COEFFICIENTS[published],
                                                         data, seed=seed),
                     "published_nearest": list(published),
                     "fp32_muon": ns_error(optim.MUON_COEFFICIENTS, data,
                                           quantized=False, seed=seed)})
    return rows


def parse_shapes(text):
    """"1024x1024,1024x4096" -> [(1024, 1024), (1024, 4096)] (min dim first); exit 2 on a malformed
    entry."""
    shapes = []
    for s in filter(None, text.split(",")):
        dims = s.split("x")
        if len(dims) != 2 or not all(d.isdigit() and int(d) > 0 and int(d) % 16 == 0 for d in dims):
            print(f"fit_root_coefficients: --shapes entry {s!r}: expected MxN with positive "
                  "multiples of 16", file=sys.stderr)
            sys.exit(2)
        shapes.append(tuple(sorted(int(d) for d in dims)))
    return shapes


def main():
    parser = argparse.ArgumentParser(
        description="Fit Root's NVFP4 NS coefficients per shape; print Fig. 4 numbers")
    parser.add_argument("--fig4", action="store_true",
                        help="print the Fig. 4a/4b numbers instead of fitting")
    parser.add_argument("--shapes", default="",
                        help="comma-separated MxN, e.g. 1024x1024,1024x4096")
    parser.add_argument("--configs", default="toy,1b,3b",
                        help="model.py configs whose Root shapes to fit")
    parser.add_argument("--fit-min-dim", type=int, default=64,
                        help="fit at this min dim (aspect kept); 0 = full")
    parser.add_argument("--inputs", type=int, default=2)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=optim.COEFFICIENTS_JSON)
    args = parser.parse_args()
    shapes = parse_shapes(args.shapes)
    if args.configs:
        try:
            shapes = sorted(set(shapes) | set(config_shapes(args.configs.split(","))))
        except (KeyError, ValueError) as e:
            print(f"fit_root_coefficients: --configs {args.configs!r}: {e}", file=sys.stderr)
            sys.exit(2)
    if args.fig4:
        m, v = synthetic_moments()
        print(json.dumps({"fig4a": fig4a_numbers(v, m),
                          "v_ema_200_steps_sqrt_rel_err": ema_requantization_error(),
                          "fig4b": fig4b_numbers(shapes, args.fit_min_dim)}, indent=1))
        return
    entries, by_reduced = {}, {}
    for m, n in shapes:
        reduced = reduced_shape(m, n, args.fit_min_dim)
        t0 = time.time()
        if reduced not in by_reduced:  # same reduced problem: same fit
            by_reduced[reduced] = fit_coefficients(m, n, args.fit_min_dim, args.inputs, args.iters,
                                                   device=args.device)
        entries[f"{m}x{n}"] = by_reduced[reduced]
        print(f"{m}x{n}: {entries[f'{m}x{n}']}  ({time.time() - t0:.0f} s)", flush=True)
    result = {"command": "python " + " ".join(sys.argv),
              "note": "fitted on the NVFP4 NS (tools/fit_root_coefficients.py); shapes scaled to "
                      "min dim fit_shape, aspect ratio kept; every set passes "
                      "optim.coefficients_stable",
              "coefficients": entries}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
