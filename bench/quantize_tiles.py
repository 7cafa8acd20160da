"""
The quantize kernels' launch configurations, timed: how kernels/nvfp4_quant.ROWS_LAUNCH,
ROWS_LAUNCH_SR and COLS_WARPS / COLS_MAXNREG are chosen. Each pass a 1b `fullstack` micro-step
makes (8 x 2048 tokens, 4/6 on every linear operand), through nvfp4_quant's calls as
kernels/nvfp4_linear makes them (public ones, and _global_amax for an unshared input's amax
pre-pass, which quantize would otherwise time with its quantize pass), at the step's shapes, once
per candidate configuration of the kernel it runs in; the kernel time of a micro-step is each pass's
time times how often a micro-step makes it. Every candidate's outputs must equal the committed
configuration's bit for bit (a launch configuration moves blocks between programs; each element's
arithmetic and SR draw stay its own).

    python bench/quantize_tiles.py                         # every kernel's candidates
    python bench/quantize_tiles.py --kernel cols --configs 4r168,8r168
    python bench/quantize_tiles.py --dry_run               # CPU smoke run, no timing

A rows configuration is NBxWARPSxCHUNKS[rMAXNREG] (blocks a chunk, warps, chunks a program, and
Triton's register cap: without r none), a cols one WARPS[rMAXNREG].
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

if "--dry_run" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import nvfp4  # noqa: E402
from kernels import nvfp4_quant as nq  # noqa: E402
from layers import kernel_ms  # noqa: E402

# the module constant each kernel's configuration lives in, and its candidates
CANDIDATES = {
    "rows": ("ROWS_LAUNCH", "128x4x4,128x4x8,128x4x2,256x8x4,64x2x4"),  # amax pre-passes (RTN)
    # 4/6 and SR passes; register caps that fit 5 and 6 programs an SM
    "rows_sr": ("ROWS_LAUNCH_SR", "128x4x1,128x4x1r96,128x4x1r80,128x4x2,64x2x1,256x8x1"),
    "cols": (("COLS_WARPS", "COLS_MAXNREG"), "4r168,4,4r128,2,8,8r128"),
}
KERNEL = {"rows": "_quantize_rows_kernel", "rows_sr": "_quantize_rows_kernel",
          "cols": "_quantize_cols_kernel"}


def parse(kernel, spec):
    shape, r, cap = spec.partition("r")
    cap = int(cap) if r else None
    if kernel == "cols":
        return int(shape), cap
    nb, warps, chunks = (int(v) for v in shape.split("x"))
    return nb, warps, chunks, cap


def passes(T, widths, device):
    """{kernel: [(name, calls a micro-step, fn -> outputs)]}: the 1b fullstack micro-step's
    quantize passes per kernel. widths: (d_model, kv width, ffn width)."""
    C, KV, F = widths
    g = torch.Generator(device=device).manual_seed(0)
    bf16 = lambda n: torch.randn(T, n, device=device, dtype=torch.bfloat16, generator=g)
    H = nvfp4.random_hadamard(device=device)
    seed = 12345
    x32 = torch.randn(T, C, device=device, generator=g)  # a normalized input, fp32 (autocast's)
    xs = {n: bf16(n) for n in (C, F)}
    dys = {n: bf16(n) for n in (C, KV, F)}
    packed = {n: nq.quantize(xs[n], (1, 16), "rtn", True) for n in (C, F)}
    amax = {id(t): t.abs().amax() for t in (*xs.values(), *dys.values())}
    r = 32  # LoRA-SVD's branch columns in the GEMM operand

    def x_forward(n):  # Q1x16(X), RTN + 4/6, codes and values into [X_hat | branch]
        buf = torch.empty(T, n + r, device=device, dtype=torch.bfloat16)
        return lambda: nq.quantize_dequant(xs[n], (1, 16), "rtn", True, return_tensor=True,
                                           out=buf[:, :n], global_amax=amax[id(xs[n])])

    def dy_for_dx(n):  # Q1x16(dY), SR + 4/6, values into [dY_hat | branch]
        buf = torch.empty(T, n + r, device=device, dtype=torch.bfloat16)
        return lambda: nq.quantize_dequant(dys[n], (1, 16), "sr", True, seed=seed, out=buf[:, :n],
                                           global_amax=amax[id(dys[n])])

    def dy_for_dw(n):  # Q16x1(H^T dY), SR + 4/6, values
        return lambda: nq.quantize_dequant(dys[n], (16, 1), "sr", True, seed=seed, hadamard=H,
                                           global_amax=amax[id(dys[n])])

    def xhat_for_dw(n):  # Q16x1(H^T Q1x16(X)) from the packed X, its amax pre-pass included
        codes, scales, s_g = packed[n]
        src = nvfp4.NVFP4Tensor(codes, scales, s_g, (T, n), (1, 16))
        return lambda: nq.quantize_dequant(src, (16, 1), "sr", True, seed=seed, hadamard=H,
                                           source_dtype=torch.bfloat16)

    # per layer: q, k, v and gate, up share one input each; dY of q, k, v, o, gate, up, down
    dy_widths = {C: 3, KV: 2, F: 2}  # (C: q, o, down)
    L = 16
    return {
        "rows": [("cast + amax, fp32 input", 2 * L, lambda: nq.cast_bf16_amax(x32)),
                 (f"amax, bf16 x {C}", L, lambda: nq._global_amax(xs[C][None], None, 0, (1, 16))),
                 (f"amax, bf16 x {F}", L, lambda: nq._global_amax(xs[F][None], None, 0, (1, 16)))],
        "rows_sr": [(f"X forward {C}", 3 * L, x_forward(C)), (f"X forward {F}", L, x_forward(F))]
        + [(f"dY for dX {n}", k * L, dy_for_dx(n)) for n, k in dy_widths.items()],
        "cols": [(f"dY amax pair {n}", k * L, lambda n=n: nq.global_amax_pair(dys[n], H))
                 for n, k in dy_widths.items()]
        + [(f"dY for dW {n}", k * L, dy_for_dw(n)) for n, k in dy_widths.items()]
        + [(f"X_hat for dW {C}", 6 * L, xhat_for_dw(C)), (f"X_hat for dW {F}", L, xhat_for_dw(F))],
    }


def configure(kernel, cfg):
    names = CANDIDATES[kernel][0]
    if kernel == "cols":
        nq.COLS_WARPS, nq.COLS_MAXNREG = cfg
    else:
        setattr(nq, names, cfg)


def committed(kernel):
    names = CANDIDATES[kernel][0]
    return (nq.COLS_WARPS, nq.COLS_MAXNREG) if kernel == "cols" else getattr(nq, names)


def outputs(fn):
    out = fn()
    return [t.clone() for t in (out if isinstance(out, (tuple, list)) else (out,))
            if torch.is_tensor(t)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--kernel", default=None, choices=sorted(CANDIDATES),
                   help="one kernel's candidates (default: every kernel's)")
    p.add_argument("--configs", default=None, help="comma-separated candidates of --kernel "
                   "(rows: NBxWARPSxCHUNKS[rMAXNREG], cols: WARPS[rMAXNREG])")
    p.add_argument("--dry_run", action="store_true", help="tiny shapes on the CPU's interpreter: "
                   "checks the script, no timing claim")
    args = p.parse_args(argv)
    if args.configs and not args.kernel:
        print("quantize_tiles.py: --configs needs --kernel (rows, rows_sr or cols)",
              file=sys.stderr)
        sys.exit(2)
    kernels = [args.kernel] if args.kernel else list(CANDIDATES)
    try:
        configs = {k: [parse(k, s) for s in (args.configs or CANDIDATES[k][1]).split(",")]
                   for k in kernels}
    except ValueError:
        print(f"quantize_tiles.py: --configs {args.configs!r} is not "
              "NBxWARPSxCHUNKS[rMAXNREG],... (rows) or WARPS[rMAXNREG],... (cols)", file=sys.stderr)
        sys.exit(2)
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("quantize_tiles.py: needs a CUDA GPU (--dry_run for the CPU)", file=sys.stderr)
        sys.exit(2)
    T, widths = (64, (64, 32, 96)) if args.dry_run else (8 * 2048, (2048, 1024, 6144))
    work = passes(T, widths, device)
    print(f"1b fullstack micro-step's quantize passes, {T} tokens; ms of kernel time a "
          "micro-step (a pass's kernel time x its calls)")
    different = []
    for kernel in kernels:
        base = committed(kernel)
        want = {name: outputs(fn) for name, _, fn in work[kernel]}
        names = [name for name, _, _ in work[kernel]]
        print(f"\n| {kernel} ({CANDIDATES[kernel][0]}) | total | " + " | ".join(names)
              + " | bits |")
        print("|---" * (len(names) + 3) + "|")
        try:
            for cfg in configs[kernel]:
                configure(kernel, cfg)
                same = all(all(torch.equal(a, b) for a, b in zip(outputs(fn), want[name]))
                           for name, _, fn in work[kernel])
                ms = [calls * kernel_ms(fn, device, name=KERNEL[kernel])
                      for _, calls, fn in work[kernel]]
                mark = " (committed)" if cfg == base else ""
                different += [] if same else [f"{kernel} {cfg}"]
                print(f"| {cfg}{mark} | {sum(ms):.2f} | " + " | ".join(f"{t:.2f}" for t in ms)
                      + f" | {'same' if same else 'DIFFERENT'} |", flush=True)
        finally:
            configure(kernel, base)
    if different:  # a launch configuration must not move a bit
        print(f"quantize_tiles.py: outputs differ from the committed configuration's under "
              f"{', '.join(different)}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
