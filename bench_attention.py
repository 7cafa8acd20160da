"""
Benchmark of attention.py's flash kernels against torch SDPA's flash backend, same run, same GPU.
  python bench_attention.py --out attention.json            (defaults: B=8 H=16 Hkv=8 T=2048 D=128 causal)
FLOPs (causal): fwd = 2 matmuls * 2 * B*H*T^2*D / 2 = 2*B*H*T^2*D; bwd = 2.5 * fwd (5 matmuls); fwd+bwd = 3.5 * fwd.
Targets (issue 6): bf16 fwd+bwd >= 0.8x SDPA, fp4 fwd+bwd >= 0.7x SDPA. The fp4 timings include quantizing
Q, K, V (nvfp4's quantize kernel); "fp4 kernels only" times the attention kernels on pre-quantized inputs.
--sweep also times a few tile configs per kernel (within --budget seconds) and reports the fastest.
--dry: CPU smoke run of every code path (interpreter, tiny shapes unless given, no sweep, no timing; tests run it).
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

if "--dry" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton and kernels/ are imported
import triton  # noqa: E402

import attention  # noqa: E402
import nvfp4  # noqa: E402
from kernels import flash_attention as fa  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    dry = "--dry" in sys.argv  # tiny default shapes for the interpreter
    ap.add_argument("--B", type=int, default=1 if dry else 8)
    ap.add_argument("--H", type=int, default=2 if dry else 16)
    ap.add_argument("--Hkv", type=int, default=1 if dry else 8)
    ap.add_argument("--T", type=int, default=80 if dry else 2048)
    ap.add_argument("--D", type=int, default=64 if dry else 128)
    ap.add_argument("--no-causal", dest="causal", action="store_false")
    ap.add_argument("--policies", default="bf16,fp4,fp4_pv,fp4_dov,fp4_all")
    ap.add_argument("--sweep", action="store_true", default=not dry)
    ap.add_argument("--no-sweep", dest="sweep", action="store_false")
    ap.add_argument("--budget", type=float, default=100.0, help="seconds for the config sweep")
    ap.add_argument("--sweep_only", action="store_true", help="only the config sweep (no other timings)")
    ap.add_argument("--sweep_variants", default="bf16,fp4,fp4_values",
                    help="operands the sweep times: bf16, fp4 (packed Q/K/V), fp4_values (bf16 grid values)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true", help="CPU smoke run of this script (interpreter, tiny shapes)")
    args = ap.parse_args()
    B, H, Hkv, T, D, causal = args.B, args.H, args.Hkv, args.T, args.D, args.causal
    dev, dt = "cuda", torch.bfloat16
    if args.dry:   # every code path once, no timing
        dev = "cpu"
        triton.testing.do_bench = lambda fn, **kw: (fn(), 1.0)[1]
        torch.cuda.get_device_name = lambda *a: "cpu (dry run)"
    else:
        assert torch.cuda.is_available(), "bench_attention.py needs a CUDA GPU"
    fwd_flop = 2 * 2 * B * H * T * T * D / (2 if causal else 1)
    flops = {"fwd": fwd_flop, "fwd+bwd": 3.5 * fwd_flop, "bwd": 2.5 * fwd_flop}
    result = {"shape": dict(B=B, H=H, Hkv=Hkv, T=T, D=D, causal=causal, dtype="bf16"),
              "flop_formula": "fwd = 2*2*B*H*T^2*D/2 (causal), bwd = 2.5*fwd, fwd+bwd = 3.5*fwd",
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "configs": {"fwd": fa.FWD_CONFIG, "fwd_packed": fa.FWD_CONFIG_PACKED, "dkdv": fa.DKDV_CONFIG,
                          "dkdv_quant_ds": fa.DKDV_CONFIG_QUANT_DS, "dq": fa.DQ_CONFIG,
                          "dq_quant_ds": fa.DQ_CONFIG_QUANT_DS}, "rows": []}

    def save():
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)

    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device=dev, dtype=dt, requires_grad=True)
    do = torch.randn(B, H, T, D, device=dev, dtype=dt)

    def timed(name, fwd, passes=("fwd", "fwd+bwd")):
        row = {"name": name}
        if args.sweep_only:
            return row
        for kind in passes:
            try:
                if kind == "fwd":
                    with torch.no_grad():
                        ms = triton.testing.do_bench(fwd, warmup=25, rep=100)
                else:
                    def step():
                        fwd().backward(do)
                    ms = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v])
                row[kind + "_ms"] = ms
                row[kind + "_tflops"] = flops[kind] / ms / 1e9
            except Exception as e:  # keep going: one failing variant must not lose the others
                row[kind + "_error"] = f"{type(e).__name__}: {e}"[:500]
        result["rows"].append(row)
        print(f"{name:28s} " + "  ".join(f"{kd}: {row[kd + '_tflops']:7.1f} TFLOP/s ({row[kd + '_ms']:.3f} ms)"
                                         if kd + "_ms" in row else f"{kd}: {row.get(kd + '_error')}"
                                         for kd in passes), flush=True)
        save()
        return row

    # --- torch SDPA, flash backend (GQA through enable_gqa, else K/V repeated outside the timing)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if args.dry:
        sdpa_kernel = lambda *a: __import__("contextlib").nullcontext()
    kr, vr = k.detach().repeat_interleave(H // Hkv, 1).requires_grad_(), v.detach().repeat_interleave(H // Hkv, 1).requires_grad_()

    def sdpa_gqa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def sdpa_rep():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
    try:
        sdpa_gqa().backward(do)
        sdpa = timed("sdpa flash (enable_gqa)", sdpa_gqa)
    except Exception as e:
        print("SDPA flash with enable_gqa failed:", e)
        sdpa = timed("sdpa flash (K/V repeated)", sdpa_rep)

    # --- correctness spot check on the benchmark shape: ours bf16 vs SDPA
    with torch.no_grad():
        ref = sdpa_rep()
        ours = attention.attention(q, k, v, causal=causal, policy="bf16", impl="triton")
        result["bf16_max_abs_err_vs_sdpa"] = (ours.float() - ref.float()).abs().max().item()
        print("bf16 max |ours - sdpa| =", result["bf16_max_abs_err_vs_sdpa"])

    rows = {}
    for policy in args.policies.split(","):
        rows[policy] = timed(f"ours {policy}",
                             lambda p=policy: attention.attention(q, k, v, causal=causal, policy=p, impl="triton"))
    # the other backward: a separate dQ pass (7 matmuls, deterministic) instead of atomic dQ (5 matmuls)
    default_mode = fa.DQ_MODE
    fa.DQ_MODE = "separate" if default_mode == "atomic" else "atomic"
    for policy in ("bf16", "fp4"):
        rows[policy + "_" + fa.DQ_MODE] = timed(
            f"ours {policy} (dQ {fa.DQ_MODE})",
            lambda p=policy: attention.attention(q, k, v, causal=causal, policy=p, impl="triton"), passes=("fwd+bwd",))
    fa.DQ_MODE = default_mode
    # the other way the kernels read the NVFP4 Q, K, V (attention.QKV_OPERANDS: packed codes or bf16 grid values)
    default_operands = attention.QKV_OPERANDS
    attention.QKV_OPERANDS = "packed" if default_operands == "values" else "values"
    rows["fp4_" + attention.QKV_OPERANDS] = timed(
        f"ours fp4 ({attention.QKV_OPERANDS} Q/K/V)",
        lambda: attention.attention(q, k, v, causal=causal, policy="fp4", impl="triton"))
    attention.QKV_OPERANDS = default_operands

    # --- where the GPU time of one fp4 / bf16 fwd+bwd goes (kernel times summed by name) and the GPU-busy share
    if not args.dry and not args.sweep_only:
        from torch.profiler import ProfilerActivity, profile
        for policy in ("bf16", "fp4"):
            def step(p=policy):
                attention.attention(q, k, v, causal=causal, policy=p, impl="triton").backward(do)
            step()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                t0 = time.perf_counter()
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
                wall_ms = (time.perf_counter() - t0) / 5 * 1e3
            kernels = {}
            for e in prof.key_averages():
                if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
                    kernels[e.key[:60]] = e.self_device_time_total / 5 / 1e3
            gpu_ms = sum(kernels.values())
            result.setdefault("profile", {})[policy] = {"wall_ms": wall_ms, "gpu_ms": gpu_ms, "kernels_ms": kernels}
            print(f"profile {policy} fwd+bwd: {wall_ms:.3f} ms wall (profiled), GPU kernels {gpu_ms:.3f} ms")
            for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:12]:
                print(f"   {ms:7.3f} ms  {name}")
            q.grad = k.grad = v.grad = None
        save()

    # --- fp4: the kernels alone (Q, K, V quantized beforehand) and the quantization alone
    qq, kq, vq = (nvfp4.quantize(x.detach(), (1, 16), "rtn") for x in (q, k, v))
    ops = [(x.codes, x.scales) for x in (qq, kq, vq)]
    from kernels.nvfp4_quant import grid_values_bf16
    values = [grid_values_bf16(x) for x in (qq, kq, vq)]
    scales = attention._scales(qq.global_scale, kq.global_scale, vq.global_scale, 1.0, 1.0, 1.0, device=dev)
    shape = (B, H, Hkv, T, D)
    sm = 1.0 / math.sqrt(D)
    o, lse = fa.flash_forward(*ops, scales, shape, causal, sm, False, dt)
    delta, do_norm = fa.bwd_preprocess(o, do)
    keys = attention._as_int32(attention.sr_keys(1234, B * H, device=dev))
    ds_scale = attention.ds_global_scale(do_norm, vq.global_scale * 2688.0, delta, D, H // Hkv).reshape(-1)

    def bench_kernel(name, fn, kind):
        if args.sweep_only:
            return {}
        try:
            ms = triton.testing.do_bench(fn, warmup=25, rep=100)
            row = {"name": name, kind + "_ms": ms, kind + "_tflops": flops[kind] / ms / 1e9}
            print(f"{name:28s} {kind}: {row[kind + '_tflops']:7.1f} TFLOP/s ({ms:.3f} ms)", flush=True)
        except Exception as e:
            row = {"name": name, kind + "_error": f"{type(e).__name__}: {e}"[:500]}
            print(name, row)
        result["rows"].append(row)
        save()
        return row

    bench_kernel("fp4 kernels only: fwd", lambda: fa.flash_forward(*ops, scales, shape, causal, sm, False, dt), "fwd")
    bench_kernel("fp4 values kernels: fwd", lambda: fa.flash_forward(*values, scales, shape, causal, sm, False, dt),
                 "fwd")
    bench_kernel("fp4 values kernels: bwd", lambda: fa.flash_backward(
        *values, scales, shape, do, lse, delta, None, None, ds_scale, keys, causal, sm, dt), "bwd")
    bench_kernel("fp4 values, dS in bf16: bwd", lambda: fa.flash_backward(
        *values, scales, shape, do, lse, delta, None, None, None, None, causal, sm, dt), "bwd")
    plain = [x.detach() for x in (q, k, v)]
    ones = attention._scales(1.0, 1.0, 1.0, 1.0, 1.0, 1.0, device=dev)
    o_b, lse_b = fa.flash_forward(*plain, ones, shape, causal, sm, False, dt)
    for mode in ("atomic", "separate"):
        bench_kernel(f"fp4 kernels only: bwd {mode}", lambda m=mode: fa.flash_backward(
            *ops, scales, shape, do, lse, delta, None, None, ds_scale, keys, causal, sm, dt, dq_mode=m), "bwd")
        bench_kernel(f"bf16 kernels only: bwd {mode}", lambda m=mode: fa.flash_backward(
            *plain, ones, shape, do, lse_b, delta, None, None, None, None, causal, sm, dt, dq_mode=m), "bwd")
    bench_kernel("fp4 dS in bf16: bwd", lambda: fa.flash_backward(*ops, scales, shape, do, lse, delta, None, None,
                                                                   None, None, causal, sm, dt), "bwd")
    if not args.sweep_only:
        ms = triton.testing.do_bench(lambda: [nvfp4.quantize(x.detach(), (1, 16), "rtn") for x in (q, k, v)])
        result["quantize_qkv_ms"] = ms
        print(f"quantize Q, K, V: {ms:.3f} ms")
        from kernels.nvfp4_quant import quantize_dequant
        ms = triton.testing.do_bench(lambda: [quantize_dequant(x.detach(), (1, 16), "rtn", return_tensor=True)
                                              for x in (q, k, v)])
        result["quantize_qkv_values_ms"] = ms
        print(f"quantize Q, K, V (codes + bf16 values): {ms:.3f} ms")

    # --- summary against the targets
    summary = {"default_dq_mode": fa.DQ_MODE}
    for policy, target in (("bf16", 0.8), ("fp4", 0.7)):
        if policy in rows and "fwd+bwd_ms" in rows[policy] and "fwd+bwd_ms" in sdpa:
            ratio = sdpa["fwd+bwd_ms"] / rows[policy]["fwd+bwd_ms"]
            summary[policy] = {"fwd+bwd_vs_sdpa": ratio, "target": target, "met": ratio >= target,
                               "fwd_vs_sdpa": sdpa["fwd_ms"] / rows[policy]["fwd_ms"]}
            other = [r for name, r in rows.items() if name.startswith(policy + "_") and "fwd+bwd_ms" in r]
            if other:
                summary[policy]["fwd+bwd_vs_sdpa_other_dq_mode"] = sdpa["fwd+bwd_ms"] / other[0]["fwd+bwd_ms"]
            print(f"{policy}: fwd+bwd {ratio:.2f}x SDPA (target {target}x) -> {'MET' if ratio >= target else 'MISSED'}")
    result["summary"] = summary
    save()

    # --- config sweep: which tiles are fastest for each kernel (bf16 and fp4 operands)
    if args.sweep:
        t_end = time.time() + args.budget
        sweep = result.setdefault("sweep", [])
        cands = {
            "fwd": [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3), dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
                    dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                    dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=4)],
            "dkdv": [dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2), dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=2),
                     dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=4),
                     dict(BLOCK_M=32, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=64, BLOCK_N=64, num_warps=8, num_stages=2),
                     dict(BLOCK_M=32, BLOCK_N=128, num_warps=4, num_stages=3)],
            "dq": [dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2), dict(BLOCK_M=128, BLOCK_N=32, num_warps=4, num_stages=3),
                   dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3), dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                   dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=4), dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=4)],
        }
        variants = {"bf16": (plain, ones, lse_b, None, None), "fp4": (ops, scales, lse, ds_scale, keys),
                    "fp4_values": (values, scales, lse, ds_scale, keys)}
        variants = {name: variants[name] for name in args.sweep_variants.split(",")}
        for kind, configs in cands.items():
            for cfg in configs:
                for vname, (operands, sc, lse_v, dss, ks) in variants.items():
                    if time.time() > t_end:
                        break
                    if kind == "fwd":
                        fn = lambda: fa.flash_forward(*operands, sc, shape, causal, sm, False, dt, config=cfg)
                        fl = flops["fwd"]
                    elif kind == "dkdv":
                        fn = lambda: fa.flash_backward(*operands, sc, shape, do, lse_v, delta, None, None, dss, ks,
                                                       causal, sm, dt, dkdv_config=cfg)
                        fl = flops["bwd"]
                    else:
                        fn = lambda: fa.flash_backward(*operands, sc, shape, do, lse_v, delta, None, None, dss, ks,
                                                       causal, sm, dt, dq_config=cfg,
                                                       dq_mode="separate")
                        fl = flops["bwd"]
                    try:
                        ms = triton.testing.do_bench(fn, warmup=10, rep=50)
                        entry = {"kernel": kind, "operands": vname, "config": cfg, "ms": ms, "tflops": fl / ms / 1e9}
                    except Exception as e:
                        entry = {"kernel": kind, "operands": vname, "config": cfg, "error": f"{type(e).__name__}: {e}"[:300]}
                    sweep.append(entry)
                    print("sweep", entry, flush=True)
                    save()
        print("sweep: dkdv rows time the whole default backward; dq rows the separate-dQ backward (dkdv at default)")
    save()


if __name__ == "__main__":
    main()
