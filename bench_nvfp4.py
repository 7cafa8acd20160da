"""
Benchmark the NVFP4 Triton kernels against torch in the same run (issue 3's performance targets):
  (a) quantize 8192x8192 bf16: bandwidth vs a device-to-device copy (RTN 1x16 >= 0.80x, SR + Hadamard >= 0.65x)
  (b) NVFP4 GEMM 8192^3 from packed operands vs torch bf16 matmul (>= 0.85x); both routes, plus model shapes
  (c) NVFP4Linear fwd+bwd, 4096x4096, 16k tokens vs nn.Linear bf16 (<= 1.3x the time)

    python bench_nvfp4.py --out results.json          # H200 (~2-4 min incl. compiles; --model-shapes adds more)
    python bench_nvfp4.py --dry --out /tmp/dry.json    # CPU smoke test of the script (interpreter, tiny shapes)
    python bench_nvfp4.py --rows_sweep                 # only the 1x16 rows kernel's launch settings (~1.5 min)

Bandwidth of a quantize = (bytes read + bytes written by the quantized result) / time; the copy moves 2x the
tensor. "kernel" rows give the global amax (one fused pass); "e2e" rows include the amax pass (a second read
of x, which the format needs: the block scales depend on the tensor-wide amax).
"""

import argparse
import json
import os
import sys
import time

import torch

DRY = "--dry" in sys.argv
if DRY and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kernels/ is imported

import nvfp4  # noqa: E402
from kernels import nvfp4_gemm as kg  # noqa: E402
from kernels import nvfp4_quant as kq  # noqa: E402


def bench(fn, dry):
    """Median milliseconds per call."""
    if dry:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing
    for _ in range(3):  # compile / autotune / pick_route outside the measurement
        fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def report(rows, res, out):
    print(f"{'section':9s} {'case':58s} {'ms':>9s} {'value':>10s} {'ratio':>7s} target")
    for r in rows:
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        tgt = "" if r["target"] is None else f"{'>=' if r['name'].find('NVFP4Linear') < 0 else '<='}{r['target']}" \
            + (" PASS" if r["passed"] else " FAIL")
        print(f"{r['section']:9s} {r['name']:58s} {r['ms']:9.3f} {r['value']:8.1f} {r['metric']:7s} {ratio:>7s} {tgt}")
    res["rows"] = rows
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {out}")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench_nvfp4.json")
    p.add_argument("--dry", action="store_true", help="tiny shapes on CPU through the interpreter (smoke test)")
    p.add_argument("--model-shapes", action="store_true", help="also the 3B model's FFN GEMMs (more compiles)")
    p.add_argument("--rows_sweep", action="store_true",
                   help="only time the 1x16 rows kernel's launch settings (kq.ROWS_LAUNCH, _SR) for RTN and SR+RHT")
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu" and not args.dry:
        sys.exit("bench_nvfp4.py needs a CUDA GPU (or --dry for a CPU smoke test)")
    S = 64 if args.dry else 8192                       # quantize / GEMM size
    T, D = (64, 64) if args.dry else (16384, 4096)      # NVFP4Linear tokens, width
    rows, res = [], {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (dry run)",
                     "torch": torch.__version__, "dry": args.dry}
    g = torch.Generator(device=dev).manual_seed(0)

    def row(section, name, ms, metric, value, ratio=None, target=None, better="higher"):
        ok = None if target is None or ratio is None else (ratio >= target if better == "higher" else ratio <= target)
        rows.append(dict(section=section, name=name, ms=ms, metric=metric, value=value, ratio=ratio, target=target,
                         passed=ok))

    # (a) quantize ---------------------------------------------------------------------------------------------
    x = torch.randn(S, S, device=dev, generator=g, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t_copy = bench(lambda: y.copy_(x), args.dry)
    bw_copy = 2 * x.nbytes / t_copy / 1e6                                  # GB/s
    row("quantize", "copy bf16 (d2d)", t_copy, "GB/s", bw_copy, 1.0)
    H = nvfp4.random_hadamard(device=dev)
    amax = x.float().abs().amax()
    amax_h = kq._global_amax(x.reshape(1, S, S), H.to(dev), 1, kq._tiles((1, 16), x))
    out_bytes_packed = x.numel() // 2 + x.numel() // 16                    # codes + E4M3 scales
    cases = [
        ("RTN 1x16", dict(block=(1, 16)), amax, 0.80),
        ("RTN 1x16 4/6", dict(block=(1, 16), four_over_six=True), amax, None),
        ("RTN 16x16 (weights)", dict(block=(16, 16)), amax, None),
        ("SR+RHT 1x16", dict(block=(1, 16), rounding="sr", hadamard=H), amax_h, 0.65),
        ("SR+RHT 16x1", dict(block=(16, 1), rounding="sr", hadamard=H), None, None),
    ]
    if args.rows_sweep:  # (blocks per chunk, warps, chunks per program), unrolled? of _quantize_rows_kernel
        default = kq.ROWS_LAUNCH, kq.ROWS_LAUNCH_SR, kq.ROWS_UNROLL
        for *launch, unroll in [(128, 4, 4, True), (128, 4, 4, False), (128, 4, 8, False), (128, 4, 16, False),
                                (256, 8, 8, False), (64, 2, 8, False), (128, 4, 2, True), (128, 4, 1, True),
                                (256, 8, 1, True)]:
            kq.ROWS_LAUNCH = kq.ROWS_LAUNCH_SR = tuple(launch)
            kq.ROWS_UNROLL = unroll
            for name, kw, ga, target in cases[:2] + cases[3:4]:  # RTN, RTN 4/6, SR + Hadamard
                ms = bench(lambda: kq.quantize(x, **kw, global_amax=ga), args.dry)
                bw = (x.nbytes + out_bytes_packed) / ms / 1e6
                row("rows sweep", f"{name} kernel, {tuple(launch)}{'' if unroll else ' loop'}", ms, "GB/s", bw,
                    bw / bw_copy, target)
        kq.ROWS_LAUNCH, kq.ROWS_LAUNCH_SR, kq.ROWS_UNROLL = default
        return report(rows, res, args.out)
    for name, kw, ga, target in cases:
        if ga is not None:
            ms = bench(lambda: kq.quantize(x, **kw, global_amax=ga), args.dry)
            bw = (x.nbytes + out_bytes_packed) / ms / 1e6
            row("quantize", f"{name} kernel", ms, "GB/s", bw, bw / bw_copy, target)
        ms = bench(lambda: kq.quantize(x, **kw), args.dry)
        bw = (x.nbytes + out_bytes_packed) / ms / 1e6
        row("quantize", f"{name} e2e (+amax pass)", ms, "GB/s", bw, bw / bw_copy, None)
    # the wgrad operand Q16x1(H^T Q1x16(X)) as NVFP4Linear makes it: dequantize the saved X to bf16, then the
    # SR + Hadamard 16x1 quantization writing the cuBLAS operand (bf16 grid values)
    xq = kq.quantize(x, (1, 16))
    # eq. 2's X operand from the saved packed X, both ways (kq.READ_PACKED_X picks what nvfp4.wgrad runs)
    ms = bench(lambda: kq.quantize_dequant(kq.dequantize(xq, torch.bfloat16), (16, 1), "sr", hadamard=H), args.dry)
    row("quantize", "wgrad X: dequantize + SR+RHT 16x1 -> bf16 values (+amax)", ms, "ms", ms)
    read_packed, kq.READ_PACKED_X = kq.READ_PACKED_X, True
    ms = bench(lambda: kq.quantize_dequant(xq, (16, 1), "sr", hadamard=H), args.dry)
    kq.READ_PACKED_X = read_packed
    row("quantize", "wgrad X: SR+RHT 16x1 from the packed X -> bf16 values (+amax)", ms, "ms", ms)
    ms = bench(lambda: kq.quantize_dequant(x, (1, 16), global_amax=amax), args.dry)
    row("quantize", "RTN 1x16 -> bf16 grid values kernel", ms, "GB/s", 2 * x.nbytes / ms / 1e6,
        2 * x.nbytes / ms / 1e6 / bw_copy)
    del y

    # (b) GEMM -------------------------------------------------------------------------------------------------
    def gemm_rows(M, N, K, label, target=None, with_trans=False):
        a_hi = torch.randn(M, K, device=dev, generator=g, dtype=torch.bfloat16)
        b_hi = torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16)
        flop = 2 * M * N * K
        t_bf16 = bench(lambda: a_hi @ b_hi.t(), args.dry)
        tf_bf16 = flop / t_bf16 / 1e9
        row("gemm", f"{label} torch bf16", t_bf16, "TFLOP/s", tf_bf16, 1.0)
        a, b = kq.quantize(a_hi, (1, 16)), kq.quantize(b_hi, (16, 16))
        del a_hi, b_hi
        for route in ("triton", "cublas", None):
            ms = bench(lambda: kg.nvfp4_gemm(a, b, torch.bfloat16, route=route), args.dry)
            name = f"{label} nvfp4 {route}" if route else f"{label} nvfp4 auto ({kg.pick_route(a, b)})"
            row("gemm", name, ms, "TFLOP/s", flop / ms / 1e9, t_bf16 / ms, None if route else target)
        if with_trans:  # the dX GEMM reads the forward's 16x16 W as its transpose, without repacking
            ms = bench(lambda: kg.nvfp4_gemm(a, b, torch.bfloat16, trans_b=True), args.dry)
            row("gemm", f"{label} nvfp4 auto, b transposed ({kg.pick_route(a, b, trans_b=True)})", ms, "TFLOP/s",
                flop / ms / 1e9, t_bf16 / ms)
        res.setdefault("routes", {})[label] = kg.pick_route(a, b)

    gemm_rows(S, S, S, f"{S}^3", 0.85, with_trans=True)
    if args.model_shapes and not args.dry:  # model shapes (3B FFN up / down); every new K compiles and autotunes once
        for (M, N, K) in [(16384, 9216, 3072), (16384, 3072, 9216)]:
            gemm_rows(M, N, K, f"M{M} N{N} K{K}")

    # (c) NVFP4Linear fwd+bwd ----------------------------------------------------------------------------------
    lin = torch.nn.Linear(D, D, bias=False, device=dev, dtype=torch.bfloat16)
    q_lin = nvfp4.NVFP4Linear.from_linear(lin)
    xin = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, D, device=dev, generator=g, dtype=torch.bfloat16)
    flop = 3 * 2 * T * D * D

    def step(layer):
        def run():
            xin.grad = None
            layer.weight.grad = None
            layer(xin).backward(dy)
        return run
    t_lin = bench(step(lin), args.dry)
    row("linear", f"nn.Linear bf16 fwd+bwd {T}x{D}x{D}", t_lin, "TFLOP/s", flop / t_lin / 1e9, 1.0)
    t_q = bench(step(q_lin), args.dry)
    row("linear", f"NVFP4Linear fwd+bwd {T}x{D}x{D}", t_q, "TFLOP/s", flop / t_q / 1e9, t_q / t_lin, 1.3, "lower")
    # 4/6 (every quantization tries both candidates); the backward's SR seeds change every call, which used to
    # recompile the SR kernels whenever a seed hit a new Triton int specialization (now not specialized)
    q_lin46 = nvfp4.NVFP4Linear.from_linear(lin, four_over_six=True)
    t_q46 = bench(step(q_lin46), args.dry)
    row("linear", f"NVFP4Linear(4/6) fwd+bwd {T}x{D}x{D}", t_q46, "TFLOP/s", flop / t_q46 / 1e9, t_q46 / t_lin)
    with torch.no_grad():
        t_qf = bench(lambda: q_lin(xin), args.dry)
        t_lf = bench(lambda: lin(xin), args.dry)
    row("linear", "NVFP4Linear fwd only", t_qf, "TFLOP/s", flop / 3 / t_qf / 1e9, t_qf / t_lf)
    if not args.dry:  # host time to enqueue one fwd+bwd while the GPU is busy: above the GPU time, it bounds the step
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU spin, so every launch below only queues
        t0 = time.perf_counter()
        for _ in range(20):
            step(q_lin)()
        t_host = (time.perf_counter() - t0) / 20 * 1e3
        torch.cuda.synchronize()
        row("linear", "NVFP4Linear fwd+bwd host enqueue time", t_host, "ms", t_host, t_host / t_q)

        def back_to_back(fn, n=30):  # steady state: no L2 flush between calls, the launch queue kept full
            fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / n
        t_lin_b2b, t_q_b2b = back_to_back(step(lin)), back_to_back(step(q_lin))
        row("linear", "nn.Linear fwd+bwd, 30 back-to-back calls", t_lin_b2b, "ms", t_lin_b2b, 1.0)
        row("linear", "NVFP4Linear fwd+bwd, 30 back-to-back calls", t_q_b2b, "ms", t_q_b2b, t_q_b2b / t_lin_b2b)

        def graphed(layer):  # the GPU's share alone: fwd+bwd captured once, replayed (no Python per call). Timing
            run = step(layer)  # only: a replay reuses the captured SR seeds and Hadamard, training must not
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    run()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run()
            return bench(graph.replay, False)
        try:
            t_lin_g, t_q_g = graphed(lin), graphed(q_lin)
            row("linear", "nn.Linear fwd+bwd, CUDA graph replay", t_lin_g, "ms", t_lin_g, 1.0)
            row("linear", "NVFP4Linear fwd+bwd, CUDA graph replay", t_q_g, "ms", t_q_g, t_q_g / t_lin_g)
        except RuntimeError as e:  # a capture failure is a finding, not a crash of the benchmark
            print(f"CUDA graph capture failed: {e}")
    if not args.dry:  # where NVFP4Linear's fwd+bwd time goes: GPU time per kernel, per call
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step(q_lin)()
            torch.cuda.synchronize()
        kernels = sorted(((e.key, e.device_time_total / 5, e.count // 5) for e in prof.key_averages()
                          if e.device_time_total > 0), key=lambda k: -k[1])
        res["linear_profile_us_per_call"] = [dict(kernel=k[:120], us=us, launches=n) for k, us, n in kernels[:20]]
        print(f"NVFP4Linear fwd+bwd, GPU time per call by kernel (total {sum(k[1] for k in kernels):.0f} us):")
        for k, us, n in kernels[:20]:
            print(f"  {us:8.1f} us  x{n:<3d} {k[:110]}")

    report(rows, res, args.out)


if __name__ == "__main__":
    main()
