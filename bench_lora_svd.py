"""
Benchmark of LoRA-SVD (lora_svd.py, paper §3.2 / App. 9) against direct NVFP4 (nvfp4.NVFP4Linear), same run,
same GPU, both with 4/6 scaling. (Fig. 3's error measurement: figures.py --fig 3, on lora_svd.lora_svd_error.)
  python bench_lora_svd.py --out lora_svd.json                      (4096x4096, rank 64, 16384 tokens, bf16 X)
Target (issue 4): LoRA-SVD fwd+bwd <= 1.15x NVFP4Linear. Rows: bf16 nn.Linear, NVFP4Linear, LoRA-SVD fused (App. 9
kernels; the route lora_fused picks, then each route forced: "triton" = GEMM with the up-projection in its
epilogue, "cublas" = one bf16 GEMM over [X_hat | X L1^T] [W_hat | L2]^T) and unfused (separate quantize, GEMM and
bf16 branch matmuls), naive LoRA; then the pieces the fusion changes and the per-step / per-realignment costs
(project_gradients, realign) that live outside fwd+bwd.
--dry: CPU smoke run of every code path (interpreter, tiny shapes unless given, no timing; tests run it).
"""

import argparse
import json
import math
import os
import sys

import torch

if "--dry" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton and kernels/ are imported
import torch.nn as nn
import triton  # noqa: E402

import lora_svd  # noqa: E402
import nvfp4  # noqa: E402


def bench(args):
    dev = "cpu" if args.dry else "cuda"
    T, IN, OUT, R = args.tokens, args.in_features, args.out_features, args.rank
    torch.manual_seed(0)
    x = torch.randn(T, IN, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, OUT, device=dev, dtype=torch.bfloat16)
    lin = nn.Linear(IN, OUT, bias=False, device=dev)
    layers = {
        "bf16 nn.Linear": nn.Linear(IN, OUT, bias=False, device=dev, dtype=torch.bfloat16),
        "nvfp4 (4/6)": nvfp4.NVFP4Linear.from_linear(lin, four_over_six=True),
        "lora_svd fused": lora_svd.LoRASVDLinear.from_linear(lin, R),
        "lora_svd unfused": lora_svd.LoRASVDLinear.from_linear(lin, R),
        "naive lora": lora_svd.NaiveLoRALinear.from_linear(lin, R),
    }
    layers["lora_svd unfused"].fused = False
    result = {"shape": dict(tokens=T, in_features=IN, out_features=OUT, rank=R, x_dtype="bf16"),
              "device": "cpu (dry run)" if args.dry else torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "rows": [], "pieces": []}
    do_bench = (lambda fn, **kw: (fn(), 1.0)[1]) if args.dry else triton.testing.do_bench

    from kernels import lora_fused
    pick_route = lora_fused._pick_route
    variants = [(name, layer, None) for name, layer in layers.items()]
    variants += [(f"lora_svd fused {r}", layers["lora_svd fused"], r) for r in ("triton", "cublas")]
    for name, layer, route in variants:
        params = list(layer.parameters())
        row = {"name": name}
        # a forced route for the fused kernels (default: lora_fused times both once per shape, keeps the faster)
        lora_fused._pick_route = pick_route if route is None else (lambda *a, route=route: route)
        try:
            with torch.no_grad():
                row["fwd_ms"] = do_bench(lambda: layer(x), warmup=10, rep=50)
            row["fwd+bwd_ms"] = do_bench(lambda: layer(x).backward(dy), warmup=10, rep=50,
                                         grad_to_none=[x] + params)
        except Exception as e:  # keep going: one failing variant must not lose the others
            row["error"] = f"{type(e).__name__}: {e}"[:500]
        result["rows"].append(row)
    lora_fused._pick_route = pick_route
    result["fused_routes_picked"] = {str(k): v for k, v in lora_fused._ROUTES.items()}
    base = next(r for r in result["rows"] if r["name"] == "nvfp4 (4/6)")
    for row in result["rows"]:
        for k in ("fwd_ms", "fwd+bwd_ms"):
            if k in row and k in base:
                row[k.replace("_ms", "_vs_nvfp4")] = row[k] / base[k]

    # the pieces the fusion changes (forward shapes)
    layer = layers["lora_svd fused"]
    L1, L2 = layer.L1.detach().to(torch.bfloat16), layer.L2.detach().to(torch.bfloat16)
    xd = x.detach()
    qw = nvfp4.quantize(layer.weight_res.detach(), (16, 16), "rtn", True)
    qx, xl1 = lora_fused.quantize_down_proj(xd, L1, 1.0, "rtn", True)
    y0 = torch.zeros(T, OUT, device=dev, dtype=torch.bfloat16)
    pieces = {
        "quantize X (1x16, RTN, 4/6)": lambda: nvfp4.quantize(xd, (1, 16), "rtn", True),
        "quantize X + down-projection (fused)": lambda: lora_fused.quantize_down_proj(xd, L1, 1.0, "rtn", True),
        "down-projection X L1^T (torch bf16)": lambda: xd @ L1.t(),
        "cuBLAS operand [X_hat | X L1^T / s_g], quantize + mm + cat":
            lambda: lora_fused._cublas_operand(xd, L1, 1.0, "rtn", True, None, qw.global_scale, "x", True),
        "NVFP4 GEMM": lambda: nvfp4.nvfp4_matmul(qx, qw, out_dtype=torch.bfloat16),
        "NVFP4 GEMM + up-projection epilogue (fused)":
            lambda: lora_fused.nvfp4_matmul_up_proj(qx, qw, xl1, L2, out_dtype=torch.bfloat16),
        "up-projection + add (torch bf16)": lambda: torch.addmm(y0, xl1, L2.t()),
        "fused forward, Triton route (quantize+down, GEMM+up)":
            lambda: lora_fused.lora_forward(xd, qw, L1, L2, 1.0, True, torch.bfloat16, route="triton"),
        "fused forward, cuBLAS route ([X|XL1] [W|L2]^T)":
            lambda: lora_fused.lora_forward(xd, qw, L1, L2, 1.0, True, torch.bfloat16, route="cublas"),
        "project_gradients (once per optimizer step)": None,
        "realign (once per 4k steps)": lambda: lora_svd.realign(layer),
    }
    layer(x).backward(dy)  # a gradient for project_gradients to split
    g = layer.weight_res.grad.clone()

    def project():
        layer.weight_res.grad.copy_(g)  # a fresh gradient each call (a copy bumps its version)
        lora_svd.project_gradients(layer)
    pieces["project_gradients (once per optimizer step)"] = project
    for name, fn in pieces.items():
        try:
            result["pieces"].append({"name": name, "ms": do_bench(fn, warmup=5, rep=25)})
        except Exception as e:
            result["pieces"].append({"name": name, "error": f"{type(e).__name__}: {e}"[:500]})

    print(f"LoRA-SVD vs NVFP4Linear (4/6): tokens={T} in={IN} out={OUT} rank={R} on {result['device']}")
    print(f"{'layer':<24}{'fwd ms':>10}{'fwd+bwd ms':>12}{'fwd x':>8}{'fwd+bwd x':>11}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['name']:<24}  ERROR {r['error']}")
            continue
        print(f"{r['name']:<24}{r['fwd_ms']:>10.3f}{r['fwd+bwd_ms']:>12.3f}{r.get('fwd_vs_nvfp4', math.nan):>8.3f}"
              f"{r.get('fwd+bwd_vs_nvfp4', math.nan):>11.3f}")
    fused = next(r for r in result["rows"] if r["name"] == "lora_svd fused")
    if "fwd+bwd_vs_nvfp4" in fused:
        ok = fused["fwd+bwd_vs_nvfp4"] <= 1.15
        result["target"] = {"lora_svd_fused_fwd+bwd_vs_nvfp4": fused["fwd+bwd_vs_nvfp4"], "max": 1.15, "met": ok}
        print(f"target fwd+bwd <= 1.15x NVFP4Linear: {fused['fwd+bwd_vs_nvfp4']:.3f}x {'MET' if ok else 'MISSED'}")
    for p in result["pieces"]:
        print(f"  {p['name']:<54}" + (f"{p['ms']:>9.3f} ms" if "ms" in p else f"  ERROR {p['error']}"))
    return result


def main():
    ap = argparse.ArgumentParser()
    dry = "--dry" in sys.argv  # tiny default shapes for the interpreter
    ap.add_argument("--tokens", type=int, default=64 if dry else 16384)
    ap.add_argument("--in_features", type=int, default=64 if dry else 4096)
    ap.add_argument("--out_features", type=int, default=64 if dry else 4096)
    ap.add_argument("--rank", type=int, default=16 if dry else 64)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true", help="CPU smoke run (the interpreter, tiny shapes)")
    args = ap.parse_args()
    if not args.dry:
        assert torch.cuda.is_available(), "bench_lora_svd.py needs a CUDA GPU (or --dry)"
    else:  # the fused kernels run in the interpreter on CPU tensors
        lora_svd.use_fused_kernels = lambda x, fused: fused
    result = bench(args)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
