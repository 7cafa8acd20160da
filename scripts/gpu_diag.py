"""
GPU diagnostics for the NVFP4 kernels: every primitive against the CPU reference (nvfp4.py, the spec) on the
same inputs, plus the speed probes of the backward's quantizers.

    python scripts/gpu_diag.py [--sections quant,gemm,ns,speed] [--workers 12] [--log diag.txt]

One line per case: PASS/FAIL, section, case, numbers. Stdout gets the FAIL lines and a summary (the full list
goes to --log); exit code 1 if anything failed. Cases run in a pool of processes (spawn) so that the many
kernel variants compile in parallel; the speed section then times in the main process alone.

quant   kernels.nvfp4_quant.quantize vs nvfp4.quantize on CPU: every block x RTN/SR(given uniforms) x 4/6 x
        Hadamard x fp32/bf16 x contiguous/transposed view, at 1024^2, 1024x3072 and 1040x1008. Bit-exact expected
        (Hadamard on generic values: its fp32 rounding depends on summation order, so <= 1e-3 of codes may
        differ); also dequantize.
gemm    kernels.nvfp4_gemm (each Hopper config, the autotuned kernel, cuBLAS, and nvfp4.nvfp4_matmul's pick) vs an
        fp64 product of the same grid values, for NN / NT / TT / TN layouts, 1x16 / 16x16 / 16x1 blocks,
        fp32 / bf16 out, at 1024^3, 1024x3072x1024, 4096^3 and 1040x1008x1040. Bound: fp32 summation order.
fos4096 (opt-in) 4/6 at 4096^2 vs the pairwise reference (and the unpatched one, for the record)
lora    (opt-in) test_lora_svd's fused-route check, per output (y, dX, dW_res), also the unfused path per route
ns      optim.newton_schulz(quantized=True) on 1024x4096 step by step: each intermediate on the GPU vs the CPU
        reference computed from the same X, then the full GPU and CPU runs (largest singular value).
speed   per-call times of the wgrad quantizers with fresh seeds (recompiles show as outliers), NVFP4Linear fwd+bwd,
        and a quantize tile sweep (GB/s vs a bf16 copy).
"""

import argparse
import os
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

DRY = "--dry" in sys.argv  # CPU dry run of this script itself: Triton's interpreter, tiny shapes
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"
DEV = "cpu" if DRY else "cuda"
SHAPES_Q = [(32, 64), (48, 32)] if DRY else [(1024, 1024), (1024, 3072), (1040, 1008)]
SHAPES_G = [(32, 48, 64), (48, 32, 80)] if DRY else [(1024, 1024, 1024), (1040, 1008, 1040), (1024, 3072, 1024),
                                                      (4096, 4096, 4096)]


def _sync():
    if not DRY:
        torch.cuda.synchronize()


def _seed(args):
    return zlib.crc32(repr(args).encode()) % 2**31
BLOCKS = [(1, 16), (16, 1), (16, 16)]


def _init_worker(threads=1):
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------------------------------------
# quant

def _input(shape, seed, kind, dtype):
    g = torch.Generator().manual_seed(seed)
    if kind == "grid8":  # multiples of 1/8 in [-8, 8]: every 16-term Hadamard rotation is exact in fp32
        x = torch.randint(-64, 65, shape, generator=g).float() / 8
    else:                # heavy-tailed, an all-zero block and a block with subnormal/zero E4M3 scales
        x = torch.randn(shape, generator=g) * torch.exp(1.5 * torch.randn(shape, generator=g))
        x[..., :16, :16] = 0.0
        x[..., 16:32, 16:32] *= 1e-7
    return x.to(dtype)


def _compare(k, r):
    """(global scale equal, #scales differing, #code bytes differing, rel L2 of dequantized)"""
    gs = torch.equal(k.global_scale.cpu().float(), r.global_scale.float())
    ds = (k.scales.view(torch.uint8).cpu() != r.scales.view(torch.uint8)).sum().item()
    dc = (k.codes.cpu() != r.codes).sum().item()
    kd, rd = k.dequantize().cpu().double(), r.dequantize().double()
    rel = ((kd - rd).norm() / rd.norm().clamp(min=1e-30)).item()
    return gs, ds, dc, rel


def quant_case(args):
    import nvfp4
    from kernels import nvfp4_quant as kq
    shape, layout, dtype, block, rounding, fos, had, kind = args
    M, N = shape
    seed = _seed(args)
    xs = _input((N, M) if layout == "T" else (M, N), seed, kind, dtype)
    x = xs.t() if layout == "T" else xs                                     # (M, N) logical, maybe a view
    xg = xs.to(DEV).t() if layout == "T" else xs.to(DEV)
    H = nvfp4.random_hadamard(torch.Generator().manual_seed(seed)) if had else None
    noise = torch.rand((M, N), generator=torch.Generator().manual_seed(seed + 1)) if rounding == "sr" else None
    try:
        k = kq.quantize(xg, block, rounding, fos, seed=0, hadamard=None if H is None else H.to(DEV),
                        noise=None if noise is None else noise.to(DEV))
        _sync()
    except Exception as e:
        return f"FAIL quant {shape} {layout} {dtype} {block} {rounding} 4/6={fos} had={had} {kind}: {type(e).__name__}: {e}"[:300]
    xr = x.contiguous()
    if had:
        xr = nvfp4.hadamard_transform(xr.float(), H, dim=-1 if block == (1, 16) else -2)
    r = nvfp4._quantize_reference(xr, block, rounding, fos, torch.Generator().manual_seed(seed + 1))
    gs, ds, dc, rel = _compare(k, r)
    exact = not had or kind == "grid8"
    # generic values through the Hadamard: x.H rounds in the summation order (tl.dot vs torch), so the global
    # amax and a few codes may differ by an ulp; the dequantized tensors must still agree closely
    gs_close = abs(k.global_scale.item() - r.global_scale.item()) <= 1e-6 * abs(r.global_scale.item())
    ok = (gs and ds == 0 and dc == 0) if exact else (gs_close and ds <= 1e-3 * r.scales.numel()
                                                     and dc <= 1e-3 * r.codes.numel() and rel < 1e-2)
    extra = ""
    if fos and not ok and hasattr(nvfp4, "_quantize_reference_original"):
        r0 = nvfp4._quantize_reference_original(xr, block, rounding, fos, torch.Generator().manual_seed(seed + 1))
        extra = f" (vs unpatched ref: {_compare(k, r0)[1]} scales)"
    name = f"{M}x{N} {layout} {str(dtype)[6:]:8s} {str(block):8s} {rounding} 4/6={int(fos)} had={int(had)} {kind}"
    return (f"{'PASS' if ok else 'FAIL'} quant {name}: gs_equal={int(gs)} scales_diff={ds}/{r.scales.numel()} "
            f"codes_diff={dc}/{r.codes.numel()} rel_err={rel:.2e}{extra}")


def fos_full_case(args):
    """4/6 at 4096^2 (the size where the old torch-sum reference disagreed on ~1e-5 of the blocks): the kernel vs
    the pairwise reference, and, for the record, vs the unpatched reference."""
    import nvfp4
    from kernels import nvfp4_quant as kq
    block, dtype = args
    S = 64 if DRY else 4096
    x = _input((S, S), 0, "heavy", dtype)
    k = kq.quantize(x.to(DEV), block, "rtn", True)
    r = nvfp4._quantize_reference(x, block, "rtn", True, None)
    gs, ds, dc, rel = _compare(k, r)
    extra = ""
    if hasattr(nvfp4, "_quantize_reference_original"):
        extra = f"; unpatched reference: {_compare(k, nvfp4._quantize_reference_original(x, block, 'rtn', True, None))[1]} scales differ"
    ok = gs and ds == 0 and dc == 0
    return (f"{'PASS' if ok else 'FAIL'} quant {S}x{S} {str(dtype)[6:]} {block} rtn 4/6=1: scales_diff={ds} "
            f"codes_diff={dc}{extra}")


def dequant_case(args):
    import nvfp4
    from kernels import nvfp4_quant as kq
    shape, block = args
    x = _input(shape, 3, "heavy", torch.float32)
    r = nvfp4._quantize_reference(x, block, "rtn", False, None)
    rg = nvfp4.NVFP4Tensor(r.codes.to(DEV), r.scales.to(DEV), r.global_scale.to(DEV), r.shape, r.block)
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        if not torch.equal(kq.dequantize(rg, dtype).cpu(), r.dequantize(dtype)):
            bad.append(str(dtype))
    if not torch.equal(kq.grid_values_bf16(rg).float().cpu(), r.grid_values()):
        bad.append("grid_values_bf16")
    return f"{'FAIL' if bad else 'PASS'} dequant {shape} {block}: {'mismatch ' + ','.join(bad) if bad else 'bit-exact'}"


# ----------------------------------------------------------------------------------------------------------
# gemm

GEMM_KINDS = {  # name: (a stored block, trans_a, b stored block, trans_b)
    "NN16": ((1, 16), False, (16, 16), False),   # forward: Q1x16(X) Q16x16(W)^T
    "NN1": ((1, 16), False, (1, 16), False),     # Newton-Schulz: both 1x16
    "NT": ((1, 16), False, (16, 16), True),      # dX = Q(dY) Q16x16(W), W stored (out, in)
    "TT": ((16, 1), True, (16, 1), True),        # dW: both stored (T, .), 16x1 along T
    "TN": ((16, 1), True, (1, 16), False),
}


def gemm_case(args):
    import nvfp4
    from kernels import nvfp4_gemm as kg
    from kernels import nvfp4_quant as kq
    (M, N, K), kind, out_dtype = args
    ba, ta, bb, tb = GEMM_KINDS[kind]
    g = torch.Generator(device=DEV).manual_seed(M + 7 * N + 13 * K)
    xa = torch.randn((K, M) if ta else (M, K), device=DEV, generator=g)
    xb = torch.randn((K, N) if tb else (N, K), device=DEV, generator=g) * 3
    a, b = kq.quantize(xa, ba), kq.quantize(xb, bb)
    A, B = a.grid_values().double(), b.grid_values().double()
    A, B = (A.t() if ta else A), (B.t() if tb else B)
    gs = (a.global_scale * b.global_scale).double()
    ref = (A @ B.t()) * gs
    mag = (A.abs() @ B.abs().t()) * gs
    eps_out = {torch.float32: 2**-23, torch.bfloat16: 2**-7, torch.float16: 2**-10}[out_dtype]
    bound = mag * (K * 2**-22 + eps_out) + 1e-30
    cfgs = [dict(c.kwargs, num_warps=c.num_warps) for c in kg._CONFIGS]
    if DRY:  # the interpreter: one small config
        cfgs = [dict(BM=32, BN=32, BK=64, GROUP_M=4, NUM_STAGES=1, num_warps=4)]
    routes = {f"cfg{i}": (lambda i=i: kg._gemm_triton(a, b, ta, tb, out_dtype, config=cfgs[i])) for i in range(len(cfgs))}
    routes["autotuned"] = lambda: kg.nvfp4_gemm(a, b, out_dtype, ta, tb, route="triton")
    routes["cublas"] = lambda: kg.nvfp4_gemm(a, b, out_dtype, ta, tb, route="cublas")
    routes["matmul"] = lambda: nvfp4.nvfp4_matmul(a, b, out_dtype, trans_a=ta, trans_b=tb)
    lines = []
    for name, fn in routes.items():
        try:
            out = fn()
            _sync()
        except Exception as e:
            lines.append(f"FAIL gemm {M}x{N}x{K} {kind} {str(out_dtype)[6:]} {name}: {type(e).__name__}: {e}"[:300])
            continue
        err = (out.double() - ref).abs()
        ratio = (err / bound).max().item()
        rel = ((out.double() - ref).norm() / ref.norm()).item()
        ok = out.dtype == out_dtype and tuple(out.shape) == (M, N) and ratio <= 1.0
        picked = f" ({kg.pick_route(a, b, ta, tb, out_dtype)})" if name == "matmul" else ""
        lines.append(f"{'PASS' if ok else 'FAIL'} gemm {M}x{N}x{K} {kind:4s} {str(out_dtype)[6:]:8s} {name}{picked}: "
                     f"max_err/bound={ratio:.3f} rel_err={rel:.2e}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# speed

SWEEP_TILES = [(16, 256, 4), (32, 256, 4), (32, 256, 8), (64, 256, 8), (16, 512, 8), (32, 512, 8), (64, 128, 4),
               (16, 128, 2), (16, 256, 2), (8, 256, 2), (16, 128, 4), (32, 128, 4), (64, 64, 4)]
SWEEP_CASES = [("RTN 1x16", (1, 16), "rtn", False, False), ("RTN 1x16 4/6", (1, 16), "rtn", True, False),
               ("RTN 16x16", (16, 16), "rtn", False, False), ("SR+RHT 1x16", (1, 16), "sr", False, True),
               ("SR+RHT 16x1 4/6", (16, 1), "sr", True, True)]
SWEEP_SHAPE = (16384, 4096)
# rows kernel (1x16): (blocks per chunk, warps, chunks per program)
SWEEP_ROWS = [(128, 4, 1), (256, 8, 1), (512, 8, 1), (256, 8, 2), (256, 8, 4), (128, 4, 4), (256, 8, 8)]


def _sweep_call(x, H, case, amax):
    from kernels import nvfp4_quant as kq
    _, block, rounding, fos, had = case
    return kq.quantize(x, block, rounding, fos, seed=1234567, hadamard=H if had else None, global_amax=amax)


def sweep_compile(args):
    """Worker: compile one (tile, case) so the main process only loads it from Triton's disk cache."""
    from kernels import nvfp4_quant as kq
    tile, ci = args
    kq.TILE_OVERRIDE = tile
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    import nvfp4
    H = nvfp4.random_hadamard(device="cuda")
    try:
        _sweep_call(x, H, SWEEP_CASES[ci], None)
        torch.cuda.synchronize()
        return ""
    except Exception as e:
        return f"FAIL sweep compile {tile} {SWEEP_CASES[ci][0]}: {type(e).__name__}: {e}"[:300]


def speed(log):
    import nvfp4
    from kernels import nvfp4_gemm as kg
    from kernels import nvfp4_quant as kq
    from triton.testing import do_bench
    T, O, I = 16384, 4096, 4096
    dy = torch.randn(T, O, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, I, device="cuda", dtype=torch.bfloat16)
    xq = kq.quantize(x, (1, 16))
    for fos in (False, True):  # the three wgrad calls, fresh seeds each call: per-call wall times
        times = {"quant dY": [], "dequant + quant X": [], "gemm TT": []}
        for i in range(12):
            H = nvfp4.random_hadamard(device="cuda")
            t0 = time.perf_counter()
            dyq = kq.quantize(dy, (16, 1), "sr", fos, seed=nvfp4.sr_seed(), hadamard=H)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            xhq = kq.quantize(kq.dequantize(xq, torch.bfloat16), (16, 1), "sr", fos, seed=nvfp4.sr_seed(), hadamard=H)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            kg.nvfp4_gemm(dyq, xhq, torch.float32, trans_a=True, trans_b=True)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(v * 1e3)
        for k, v in times.items():
            tail = sorted(v[2:])
            log(f"INFO speed wgrad 4/6={int(fos)} {k}: first {v[0]:.1f} ms, then median {tail[len(tail) // 2]:.3f} "
                f"max {tail[-1]:.3f} ms (calls 3-12){'  <- recompiles?' if tail[-1] > 20 * tail[0] + 5 else ''}")
    for fos in (False, True):
        lin = nvfp4.NVFP4Linear(I, O, four_over_six=fos, device="cuda")
        xx = x.clone().requires_grad_()
        for _ in range(3):
            lin(xx).backward(dy)
        ms = do_bench(lambda: lin(xx).backward(dy), warmup=10, rep=50, grad_to_none=[xx, lin.weight])
        log(f"INFO speed NVFP4Linear 4/6={int(fos)} fwd+bwd {T}x{I}x{O}: {ms:.3f} ms")
    # quantize tile sweep
    xs = torch.randn(SWEEP_SHAPE, device="cuda", dtype=torch.bfloat16)
    H = nvfp4.random_hadamard(device="cuda")
    copy_ms = do_bench(lambda: xs.clone(), warmup=10, rep=50)
    gbs = lambda ms: (xs.numel() * 2 + xs.numel() // 2 + xs.numel() // 16) / ms / 1e6
    log(f"INFO speed copy bf16 {SWEEP_SHAPE}: {copy_ms:.4f} ms {2 * xs.numel() * 2 / copy_ms / 1e6:.0f} GB/s")
    copy_gbs = 2 * xs.numel() * 2 / copy_ms / 1e6

    def timed(case, amax, name, setting, value):  # one launch setting of kq (TILE_OVERRIDE / ROWS_LAUNCH) timed
        old = getattr(kq, setting)
        setattr(kq, setting, value)
        try:
            ms = do_bench(lambda: _sweep_call(xs, H, case, amax), warmup=5, rep=25)
            return f"{name}={ms * 1e3:.0f}us/{gbs(ms) / copy_gbs:.2f}x"
        except Exception as e:
            return f"{name}=ERR {type(e).__name__}"
        finally:
            setattr(kq, setting, old)

    for case in SWEEP_CASES:
        amax = xs.abs().amax().float() if not case[4] else None
        row = [timed(case, amax, f"{t[0]}x{t[1]}w{t[2]}", "TILE_OVERRIDE", t) for t in SWEEP_TILES]
        if case[1] == (1, 16):  # the rows kernel (the default for 1x16 blocks of a contiguous x)
            setting = "ROWS_LAUNCH_SR" if case[2] == "sr" or case[3] else "ROWS_LAUNCH"  # SR or 4/6
            row += [timed(case, amax, f"rows{r[0]}w{r[1]}c{r[2]}", setting, r) for r in SWEEP_ROWS]
        log(f"INFO sweep {case[0]:16s} (kernel only, ratio vs copy): " + " ".join(row))


# ----------------------------------------------------------------------------------------------------------
# ns: optim.newton_schulz(quantized=True) step by step, GPU kernels vs the CPU reference from the same X

def ns_section(log, shape=(1024, 4096), steps=5):
    import nvfp4
    import optim
    G = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    a, b, c = optim.root_coefficients(*shape, quantized=True)
    log(f"INFO ns {shape}: coefficients (a, b, c) = ({a:.4f}, {b:.4f}, {c:.4f})")
    X = G.t() if shape[0] > shape[1] else G
    X = X / (X.norm() + 1e-7)
    Xg = X.to(DEV)
    gH = torch.Generator().manual_seed(1)
    rel = lambda u, v: ((u.double().cpu() - v.double().cpu()).norm() / v.double().cpu().norm().clamp(min=1e-30)).item()

    def step(X, H, tag):
        q = lambda t: nvfp4.quantize(t, (1, 16), "rtn", four_over_six=True, hadamard=H.to(t.device))
        qX = q(X)
        A = nvfp4.nvfp4_matmul(qX, qX)
        qA, qA_t = q(A), q(A.t())
        B = b * A + c * nvfp4.nvfp4_matmul(qA, qA_t)
        qB, qX_t = q(B), q(X.t())
        return {"qX": qX.dequantize(), "A": A, "qA_t": qA_t.dequantize(), "B": B, "qX_t": qX_t.dequantize(),
                "X_next": a * X + nvfp4.nvfp4_matmul(qB, qX_t)}

    for i in range(steps):
        H = nvfp4.random_hadamard(gH)
        kg_ = step(Xg, H, "gpu")
        kr = step(Xg.cpu(), H, "cpu")  # the reference, from the very same X
        errs = " ".join(f"{k}={rel(kg_[k], kr[k]):.1e}" for k in kr)
        sv = torch.linalg.svdvals(kg_["X_next"].double())
        bad = any(rel(kg_[k], kr[k]) > 1e-2 for k in kr)
        log(f"{'FAIL' if bad else 'PASS'} ns step {i}: rel err GPU vs CPU ref {errs}; GPU smax={sv.max().item():.3f}")
        Xg = kg_["X_next"]
    if not DRY:  # (the full CPU reference run at 1024x4096 takes minutes; on a 2-core CPU it gave smax 1.08)
        Xd = optim.newton_schulz(G.cuda(), steps=steps, generator=torch.Generator("cuda").manual_seed(1))
        sd = torch.linalg.svdvals(Xd.double())
        log(f"INFO ns full GPU {shape}: smax={sd.max().item():.3f} polar_error={optim.polar_error(Xd, G.cuda()):.3f}")


def lora_section(log):
    """tests/test_lora_svd.py::test_gpu_fused_routes_equal_unfused_at_full_size, per output: y, dX, dW_res."""
    import lora_svd
    torch.manual_seed(0)
    layer = lora_svd.LoRASVDLinear(4096, 4096, 64, device=DEV)
    x = torch.randn(2048, 4096, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(2048, 4096, device=DEV, dtype=torch.bfloat16)
    outs = {}
    for name, fused, route in (("unfused", False, "auto"), ("triton", True, "triton"), ("cublas", True, "cublas"),
                               ("unfused-triton", False, "triton"), ("unfused-cublas", False, "cublas")):
        os.environ["NANOFP4_GEMM_ROUTE"] = route
        layer.fused = fused
        layer.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(1)
        y = layer(x)
        y.backward(dy)
        outs[name] = (y.float(), x.grad.float(), layer.weight_res.grad.clone())
    os.environ.pop("NANOFP4_GEMM_ROUTE")
    for name in outs:
        if name == "unfused":
            continue
        errs = [((u - v).norm() / v.norm()).item() for u, v in zip(outs[name], outs["unfused"])]
        log(f"{'PASS' if max(errs) < 1e-2 else 'FAIL'} lora {name} vs unfused(auto): rel err y={errs[0]:.2e} "
            f"dX={errs[1]:.2e} dW_res={errs[2]:.2e}")


# ----------------------------------------------------------------------------------------------------------

def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sections", default="quant,gemm,ns,speed")
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--log", default=None)
    p.add_argument("--quick", action="store_true", help="fewer quant shapes and GEMM shapes")
    p.add_argument("--dry", action="store_true", help="CPU dry run (interpreter, tiny shapes) of this script")
    args = p.parse_args()
    sections = args.sections.split(",")
    lines = []
    logf = open(args.log, "w") if args.log else None

    def log(line, show=None):
        for ln in line.split("\n"):
            if not ln:
                continue
            lines.append(ln)
            if logf:
                logf.write(ln + "\n")
                logf.flush()
            if show if show is not None else not ln.startswith("PASS"):
                print(ln, flush=True)

    t_start = time.time()
    print(f"{DEV if DRY else torch.cuda.get_device_name()} "
          f"torch {torch.__version__}", flush=True)
    tasks = []
    if "quant" in sections:
        shapes = SHAPES_Q[:1] + SHAPES_Q[-1:] if args.quick else SHAPES_Q
        for shape in shapes:
            for layout in ("C", "T"):
                for dtype in (torch.float32, torch.bfloat16):
                    for block in BLOCKS:
                        for had in ((False, True) if block != (16, 16) else (False,)):
                            for rounding in ("rtn", "sr"):
                                for fos in (False, True):
                                    kinds = ("grid8", "heavy") if had else ("heavy",)
                                    for kind in kinds:
                                        if shape != SHAPES_Q[0] and (kind == "grid8" or rounding == "sr"):
                                            continue
                                        tasks.append((quant_case, (shape, layout, dtype, block, rounding, fos, had, kind)))
        for block in BLOCKS:
            tasks.append((dequant_case, (SHAPES_Q[-1], block)))
    if "fos4096" in sections:
        tasks += [(fos_full_case, (block, dtype)) for block in BLOCKS for dtype in (torch.float32, torch.bfloat16)]
    if "gemm" in sections:
        shapes = SHAPES_G[:2] if args.quick else SHAPES_G
        for shape in shapes:
            for kind in GEMM_KINDS:
                if shape[2] >= 3072 and kind == "TN":
                    continue
                for out_dtype in (torch.float32, torch.bfloat16):
                    if out_dtype == torch.bfloat16 and kind not in ("NN16", "NT"):
                        continue
                    tasks.append((gemm_case, (shape, kind, out_dtype)))
    if "speed" in sections and not DRY:
        tasks += [(sweep_compile, (tile, ci)) for tile in SWEEP_TILES for ci in range(len(SWEEP_CASES))]
    # GEMM tasks first (slowest compiles)
    tasks.sort(key=lambda t: {fos_full_case: -1, gemm_case: 0, sweep_compile: 1}.get(t[0], 2))
    if tasks:
        import multiprocessing as mp
        with mp.get_context("spawn").Pool(args.workers, initializer=_init_worker,
                                                   initargs=(max(1, (os.cpu_count() or 1) // args.workers),)) as pool:
            for out in pool.imap_unordered(_run_task, tasks):
                log(out)
    print(f"[parallel part {time.time() - t_start:.0f} s]", flush=True)
    if "ns" in sections:
        ns_section(lambda ln: log(ln, show=True), (64, 256) if DRY else (1024, 4096))
    if "lora" in sections and not DRY:
        lora_section(lambda ln: log(ln, show=True))
    if "speed" in sections and not DRY:
        speed(lambda ln: log(ln, show=True))
    n_pass = sum(ln.startswith("PASS") for ln in lines)
    fails = [ln for ln in lines if ln.startswith("FAIL")]
    print(f"SUMMARY: {n_pass} PASS, {len(fails)} FAIL, {time.time() - t_start:.0f} s", flush=True)
    sys.exit(1 if fails else 0)


def _run_task(task):
    fn, args = task
    try:
        return fn(args)
    except Exception as e:
        return f"FAIL {fn.__name__} {args}: {type(e).__name__}: {e}"[:300]


if __name__ == "__main__":
    main()
