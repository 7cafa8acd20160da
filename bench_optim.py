"""
Benchmarks of optim.py on the GPU (paper §3.3-3.4). Prints a table and writes JSON (--out).

  1. Fused QuantizedAdamW step (kernels/optim_fused.py) on a 4096 x 4096 fp32 parameter: time, effective
     bandwidth over the useful bytes (p, g read; p written; packed m, v and tile means read and written once:
     14.3 B/param) and over the bytes actually moved (plus the amax pre-pass's re-read: 19.5 B/param), as a
     fraction of a same-run copy's bandwidth (read + write). Target: >= 0.60 x copy on the useful bytes.
     Next to it torch.optim.AdamW(fused=True) (28 B/param: fp32 p, g, m, v) and the whole optimizer.step().
  2. Root: NS time per matrix shape of the toy and 1b configs, NVFP4 (§3.4, Triton GEMM) vs bf16 NS, and a
     full quantized Root.step().
Run: python bench_optim.py --out bench_optim.json   (needs CUDA)
     python bench_optim.py --dry --out /tmp/x.json  (CPU smoke run: interpreter, 64 x 64 and the tiny config's
                                                     shapes, no timing, no CUDA graph; tests run it)
"""
import argparse
import json
import os
import sys

import torch
import torch.nn as nn

DRY = "--dry" in sys.argv
if DRY and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton and kernels/ are imported
from triton.testing import do_bench as _do_bench  # noqa: E402

import nvfp4  # noqa: E402
import optim  # noqa: E402

DEV = "cpu" if DRY else "cuda"
do_bench = (lambda fn, **kw: (fn(), 1.0)[1]) if DRY else _do_bench  # dry: every call once, "1 ms"


def bench_adamw(R, C):
    dev = DEV
    rows = {}
    x = torch.randn(R, C, device=dev)
    y = torch.empty_like(x)
    t = do_bench(lambda: y.copy_(x)) * 1e-3
    copy_bw = 2 * x.nbytes / t
    rows["copy"] = {"ms": t * 1e3, "GBps": copy_bw / 1e9}

    p = nn.Parameter(torch.randn(R, C, device=dev) * 0.02)
    p.grad = torch.randn(R, C, device=dev) * 1e-3
    opt = optim.QuantizedAdamW([p], lr=1e-4)
    for _ in range(3):
        opt.step()  # states populated, kernels compiled
    state = opt.state[p]
    from kernels.optim_fused import fused_adamw_step
    n = R * C
    useful = n * (4 + 4 + 4 + 4 * 0.5625) + 2 * state["v.tile_mean"].nbytes
    moved = useful + n * (4 + 2 * 0.5625) + state["v.tile_mean"].nbytes
    sweep = {}
    for elements in (1024, 2048, 4096):
        for warps in (4, 8):
            run = lambda: fused_adamw_step(p.data, p.grad, state, 1e-4, 0.9, 0.95, 1e-8, 0.1, 10, 1,
                                           elements_per_program=elements, num_warps=warps)
            sweep[f"{elements}el_{warps}w"] = do_bench(run) * 1e-3
    rows["fused_launch_sweep_ms"] = {k: v * 1e3 for k, v in sweep.items()}
    t = sweep["2048el_4w"]  # the default launch
    best = min(sweep, key=sweep.get)
    rows["fused_quantized_adamw_kernel"] = {"ms": t * 1e3, "useful_GBps": useful / t / 1e9,
                                            "moved_GBps": moved / t / 1e9, "useful_vs_copy": useful / t / copy_bw,
                                            "moved_vs_copy": moved / t / copy_bw,
                                            "best_launch_useful_vs_copy": useful / sweep[best] / copy_bw}
    rows["fused_best_launch"] = best
    t = do_bench(opt.step) * 1e-3
    rows["quantized_adamw_step"] = {"ms": t * 1e3, "useful_vs_copy": useful / t / copy_bw,
                                    "state_bytes_per_param": opt.state_nbytes() / n}
    q = nn.Parameter(torch.randn(R, C, device=dev) * 0.02)
    q.grad = p.grad.clone()
    ref = torch.optim.AdamW([q], lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=not DRY)
    ref.step()
    t = do_bench(ref.step) * 1e-3
    rows["torch_adamw_fused"] = {"ms": t * 1e3, "GBps": 28 * n / t / 1e9, "vs_copy": 28 * n / t / copy_bw,
                                 "state_bytes_per_param": 8.0}
    return rows


def bench_root(configs):
    rows = []
    for m, n in optim.config_shapes(configs):
        G = torch.randn(m, n, device=DEV)
        gen = torch.Generator(DEV).manual_seed(0)
        t_q = do_bench(lambda: optim.newton_schulz(G, quantized=True, generator=gen))
        Gb = G.bfloat16()
        t_b = do_bench(lambda: optim.newton_schulz(Gb, coefficients=optim.MUON_COEFFICIENTS, quantized=False))
        hs = [nvfp4.random_hadamard(gen) for _ in range(5)]
        t_eager = do_bench(lambda: optim.root_direction(G, hadamards=hs))
        t_graph = None if DRY else do_bench(lambda c=optim._CapturedDirection(G, 0.9, 5): c(G, hs))
        p = nn.Parameter(torch.randn(m, n, device=DEV) * 0.02)
        p.grad = torch.randn(m, n, device=DEV) * 1e-3
        root = optim.Root([p], lr=1e-4)
        root.step()
        t_step = do_bench(root.step)
        rows.append({"shape": [m, n], "ns_nvfp4_ms": t_q, "ns_bf16_ms": t_b, "nvfp4_vs_bf16": t_q / t_b,
                     "direction_eager_ms": t_eager, "direction_graph_ms": t_graph, "root_step_nvfp4_ms": t_step})
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="bench_optim.json")
    parser.add_argument("--size", type=int, default=64 if DRY else 4096)
    parser.add_argument("--configs", default="tiny" if DRY else "toy,1b")
    parser.add_argument("--dry", action="store_true", help="CPU smoke run (the interpreter, tiny shapes)")
    args = parser.parse_args()
    if not DRY and not torch.cuda.is_available():
        raise SystemExit("bench_optim.py needs a CUDA GPU (or --dry)")
    result = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(),
              "adamw": bench_adamw(args.size, args.size),
              "root": bench_root(args.configs.split(","))}
    print(f"AdamW step on {args.size}x{args.size} fp32 ({result['device']})")
    for name, row in result["adamw"].items():
        if isinstance(row, dict):
            print(f"  {name:30s} " + "  ".join(f"{k}={v:.3f}" for k, v in row.items()))
        else:
            print(f"  {name:30s} {row}")
    print("Root / Newton-Schulz (5 steps), ms")
    print(f"  {'shape':>12s} {'NS nvfp4':>9s} {'NS bf16':>9s} {'ratio':>6s} {'dir eager':>9s} {'dir graph':>9s}"
          f" {'Root step':>9s}")
    for r in result["root"]:
        graph_ms = r["direction_graph_ms"] or float("nan")  # None in a dry run (no CUDA graph on the CPU)
        print(f"  {r['shape'][0]:>5d}x{r['shape'][1]:<6d} {r['ns_nvfp4_ms']:9.3f} {r['ns_bf16_ms']:9.3f} "
              f"{r['nvfp4_vs_bf16']:6.2f} {r['direction_eager_ms']:9.3f} {graph_ms:9.3f} {r['root_step_nvfp4_ms']:9.3f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
