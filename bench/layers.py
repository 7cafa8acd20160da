"""
The layer rows of the speed table: each public call a training step makes, timed against what a user
would run instead, on the same GPU in the same process.

  attention   attention.attention(policy=...) fwd+bwd vs torch's default
              scaled_dot_product_attention dispatch (no backend forced; the backend it picked is
              read from the profiler and named in the row)
  linear      nvfp4.NVFP4Linear, NVFP4Linear(4/6) and lora_svd.LoRASVDLinear fwd+bwd vs nn.Linear,
              all with fp32 master weights under bf16 autocast, as train.py runs them
  optim       optim.QuantizedAdamW.step vs torch.optim.AdamW(fused=True) on the 1b config's block
              matrices
  quantize    nvfp4.quantize on a bf16 tensor vs a copy of it (a breakdown: the passes an FP4
              linear adds)

Every call is timed back to back, as in training: no cache flush between calls, the launch queue
kept full, so host time that the GPU cannot hide shows up. Rows hold milliseconds per call of ours
and of the baseline and the speed ratio baseline_ms / ours_ms (above 1: ours is faster), and for
ours the host's time to issue a call (host_ms: where it reaches ms, the call is host-bound). Only
the modules' public calls are used.
"""

import contextlib
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import attention
import lora_svd
import nvfp4
import optim

LORA_RANK = 32  # train.py's --lora_rank default


def time_ms(fn, device, calls=20, repeats=5):
    """Milliseconds per call: the median over `repeats` of the mean of `calls` back-to-back calls,
    after three warm-up calls (kernel compilation, autotuning, the optimizer's state allocation). On
    the CPU (the dry run) one call, wall clock: the dry run checks that the code runs, not how
    fast."""
    if device != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def host_ms(fn, device, calls=20):
    """Milliseconds the host takes to issue one call (its Python, checks, allocations and launches;
    the launch queue absorbs them, so no wait on the GPU is in it): the mean over `calls` back-to-
    back calls, timed before the closing synchronize, after three warm-up calls. A call whose
    host_ms reaches its ms is host-bound. 0 on the CPU (the dry run)."""
    if device != "cuda":
        return 0.0
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / calls


def row(section, name, ms, baseline, baseline_ms, **extra):
    return {"section": section, "name": name, "ms": ms, "baseline": baseline,
            "baseline_ms": baseline_ms, "speed_vs_baseline": baseline_ms / ms, **extra}


# --------------------------------------------------------------------------------------------------
# attention (§3.5)

# the aten op each backend of torch's scaled_dot_product_attention dispatch runs, most specific
# first
SDPA_BACKENDS = (
    ("_scaled_dot_product_cudnn_attention", "cuDNN"),
    ("_scaled_dot_product_flash_attention_for_cpu", "CPU flash"),
    ("_scaled_dot_product_flash_attention", "flash"),
    ("_scaled_dot_product_efficient_attention", "memory-efficient"),
    ("_scaled_dot_product_attention_math", "math"),
)


def sdpa_backend(run, device):
    """Which backend torch's default dispatch picked for `run` (one fwd+bwd), from the profiler's op
    names, and the GPU kernels that took the most time (the evidence: cuDNN's are named cudnn_* /
    sm90_*fmha*)."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        run()
        if device == "cuda":
            torch.cuda.synchronize()
    ops = {e.name for e in prof.events()}
    backend = next((label for op, label in SDPA_BACKENDS if any(op in name for name in ops)),
                   "unknown")
    gpu = [e for e in prof.key_averages()
           if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    gpu.sort(key=lambda e: -getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)))
    return backend, [e.key[:120] for e in gpu[:3]]


def attention_rows(device, dry, policies=("bf16", "fp4", "fp4_all")):
    B, H, Hkv, T, D = (1, 2, 1, 64, 64) if dry else (8, 16, 8, 2048, 128)
    dtype = torch.bfloat16
    torch.manual_seed(0)  # bench/attention_tiles.py's inputs
    q = torch.randn(B, H, T, D, device=device, dtype=dtype, requires_grad=True)    # (B, H, T, D)
    k = torch.randn(B, Hkv, T, D, device=device, dtype=dtype, requires_grad=True)  # (B, Hkv, T, D)
    v = torch.randn(B, Hkv, T, D, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn_like(q)

    # autograd.grad: fresh gradients each call, as for a layer's activations in training
    def fwd_bwd(attend):
        return lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), do)

    sdpa = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  enable_gqa=True))
    # the inputs and order of bench/attention_tiles.py (timed before sdpa_backend's profile of the
    # host): the two scripts have read cuDNN's kernels apart (docs/performance.md)
    sdpa_ms, sdpa_kernels_ms = time_ms(sdpa, device), kernel_ms(sdpa, device)
    backend, kernels = sdpa_backend(sdpa, device)
    baseline = f"torch SDPA, default dispatch ({backend})"
    # causal: fwd 2 matmuls over half the (T, T) scores, bwd 2.5x fwd
    flop = 3.5 * 2 * 2 * B * H * T * T * D / 2
    shape = f"B{B} H{H}/{Hkv} T{T} D{D} causal"
    rows = []
    for policy in policies:
        run = fwd_bwd(lambda q, k, v: attention.attention(q, k, v, causal=True, policy=policy))
        ms = time_ms(run, device)
        rows.append(row("attention", f"attention(policy={policy!r}) fwd+bwd, {shape}", ms,
                        baseline, sdpa_ms,
                        tflops=flop / ms / 1e9, baseline_tflops=flop / sdpa_ms / 1e9,
                        sdpa_backend=backend, sdpa_kernels=kernels, host_ms=host_ms(run, device),
                        device_ms=kernel_ms(run, device), baseline_device_ms=sdpa_kernels_ms))
    return rows


# --------------------------------------------------------------------------------------------------
# linear layers (§2 eqs. 1-2, §3.2)

def linear_rows(device, dry):
    tokens, width = (64, 64) if dry else (16384, 4096)
    # train.py's precision: fp32 master weights, bf16 autocast on the GPU; fp32 on the CPU
    # (the dry run)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda"
                else contextlib.nullcontext())
    x = torch.randn(tokens, width, device=device, dtype=dtype, requires_grad=True)  # (tokens, in)
    dy = torch.randn(tokens, width, device=device, dtype=dtype)                     # (tokens, out)
    layers = {
        "nn.Linear": nn.Linear(width, width, bias=False, device=device),
        "NVFP4Linear": nvfp4.NVFP4Linear(width, width, device=device),
        "NVFP4Linear(four_over_six=True)": nvfp4.NVFP4Linear(width, width, four_over_six=True,
                                                             device=device),
        f"LoRASVDLinear(rank={LORA_RANK})": lora_svd.LoRASVDLinear(width, width, LORA_RANK,
                                                                   device=device),
    }

    def fwd_bwd(layer):
        inputs = (x, *layer.parameters())

        def run():
            # each call quantizes X and W, as a layer that reads its input alone in a step's first
            # micro-step does (nvfp4._SharedInput and WeightCache keep them for the layers and
            # micro-steps after): the row compares one call with nn.Linear's, casts included
            torch.autograd.graph.increment_version([x, *layer.parameters()])
            with autocast:
                y = layer(x)
            # LoRA-SVD's L1, L2 get no gradient from autograd (lora_svd.project_gradients)
            return torch.autograd.grad(y, inputs, dy, allow_unused=True)
        return run

    dense_ms = time_ms(fwd_bwd(layers.pop("nn.Linear")), device)
    flop = 3 * 2 * tokens * width * width  # forward, dgrad, wgrad
    shape = f"{tokens} tokens x {width}x{width}"
    baseline = "nn.Linear, bf16 autocast" if device == "cuda" else "nn.Linear, fp32"
    rows = []
    for name, layer in layers.items():
        ms = time_ms(fwd_bwd(layer), device)
        rows.append(row("linear", f"{name} fwd+bwd, {shape}", ms, baseline, dense_ms,
                        tflops=flop / ms / 1e9, baseline_tflops=flop / dense_ms / 1e9,
                        host_ms=host_ms(fwd_bwd(layer), device)))
    return rows


# --------------------------------------------------------------------------------------------------
# the optimizer step (§3.3)

def block_matrix_shapes(n_layer=16, n_embd=2048, kv_dim=1024, ffn=6144):
    """The 1b config's transformer-block matrices: q, k, v, o, gate, up, down per layer
    (train.py's Root/AdamW see these; embeddings and norms are a small share of the step)."""
    per_layer = [(n_embd, n_embd), (kv_dim, n_embd), (kv_dim, n_embd), (n_embd, n_embd),
                 (ffn, n_embd), (ffn, n_embd), (n_embd, ffn)]
    return per_layer * n_layer


def optim_rows(device, dry):
    shapes = block_matrix_shapes(1, 64, 32, 128) if dry else block_matrix_shapes()
    hyper = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def parameters():
        gen = torch.Generator(device=device).manual_seed(0)
        params = [nn.Parameter(torch.randn(s, device=device, generator=gen)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
        return params

    ours = optim.QuantizedAdamW(parameters(), **hyper)  # its default states: §3.3's NVFP4 m and v
    theirs = torch.optim.AdamW(parameters(), **hyper, fused=device == "cuda")
    n = sum(s[0] * s[1] for s in shapes)
    calls = dict(calls=5, repeats=3)
    theirs_ms = time_ms(theirs.step, device, **calls)
    ours_ms = time_ms(ours.step, device, **calls)
    name = f"QuantizedAdamW.step, {len(shapes)} matrices, {n:,} params"
    baseline = f"torch.optim.AdamW({'fused=True' if device == 'cuda' else ''}), fp32 states"
    return [row("optim", name, ours_ms, baseline, theirs_ms)]


# --------------------------------------------------------------------------------------------------
# breakdown: one quantization pass (§2)

def quantize_rows(device, dry):
    n = 64 if dry else 8192
    x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    copy_ms = time_ms(lambda: x.clone(), device)
    H = nvfp4.random_hadamard(device=device)
    # the first two as nvfp4.LINEAR's plain entries; the last two as fullstack quantizes its
    # gradients (SR, 4/6): dY for dX (1x16) and eq. 2's wgrad operands (16x1 after the Hadamard)
    cases = {
        "RTN 1x16 (activations, forward)": dict(block=(1, 16)),
        "RTN 16x16 (weights)": dict(block=(16, 16)),
        "SR 1x16 + 4/6 (fullstack's dY for dX)": dict(block=(1, 16), rounding="sr",
                                                      four_over_six=True),
        "SR + random Hadamard 16x1 + 4/6 (fullstack's wgrad operands, eq. 2)": dict(
            block=(16, 1), rounding="sr", four_over_six=True, hadamard=H),
    }
    return [row("quantize", f"nvfp4.quantize {name}, {n}x{n} bf16",
                time_ms(lambda: nvfp4.quantize(x, **kw), device),
                "x.clone() (a copy: reads and writes 2 bytes per element)", copy_ms,
                device_ms=kernel_ms(lambda: nvfp4.quantize(x, **kw), device),
                host_ms=host_ms(lambda: nvfp4.quantize(x, **kw), device))
            for name, kw in cases.items()]


def kernel_ms(fn, device, calls=10, name=None):
    """The GPU kernels' own time per call (the profiler's device time, summed): below the call's
    time when the host's work per call (checks, allocations, launches) is the longer of the two.
    name: only the kernels whose name starts with it."""
    if device != "cuda":
        return 0.0
    from torch.profiler import ProfilerActivity, profile
    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and (name is None or e.name.startswith(name))]
    return sum(e.device_time for e in kernels) / 1e3 / calls


SECTIONS = {"attention": attention_rows, "linear": linear_rows, "optim": optim_rows,
            "quantize": quantize_rows}
