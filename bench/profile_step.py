"""
Where one micro-step's GPU time goes: torch.profiler over the forward and backward of one
micro-batch through the public model API (model.GPT under bf16 autocast, as train.py runs it), per
recipe, its CUDA kernels grouped by name. The once-per-step work (optimizer, LoRA-SVD projection,
the FP4 layers' weight quantization: nvfp4.WeightCache) is not in it: bench/run.py's end-to-end rows
have that.

    python bench/profile_step.py --config 1b --recipes bf16,fullstack     # 8 x 2048 tokens
    python bench/profile_step.py --config 1b --recipes bf16,fullstack --cuda_graphs
    python bench/profile_step.py --dry_run                                 # CPU smoke run

Prints, per recipe, the micro-step's wall time, the share of it the GPU is busy, and the kernels
with the most time (ms per micro-step); then each kernel's extra time over the first recipe.
--by_function: one more eager micro-step under Python's tracer, its kernel time by the function of
this repository each kernel was launched from (a backward op of autograd's own: the forward
function that made its node), so "everything else" has a place in the code. Writes the numbers as
JSON (--out).
"""

import argparse
import collections
import gc
import json
import os
import re
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

if "--dry_run" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from model import GPT, RECIPES, config_from_name  # noqa: E402
from train import GraphedMicroStep, graph_grads  # noqa: E402


def micro_step(model, x, y, device, graphs=False):
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        _, loss = model(x, y)
    loss.backward()
    model.zero_grad(set_to_none=not graphs)  # graphs: the gradients stay put (train.graph_grads)


def kernel_key(name):
    """A kernel's name as the tables key it: torch's elementwise kernels share ~80 characters of
    template prefix before their functor (what they compute: a copy, an add, a cast), so the
    namespaces go and 160 characters stay."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "at_cuda_detail::", "at::",
                  "c10::", "::operator()() const"):
        name = name.replace(noise, "")
    return name[:160]


# a Python frame as the profiler's tracer names it: "model.py(177): forward" (file, def line, name)
FRAME = re.compile(r"^(.+\.py)\((\d+)\): (.+)$")
BACKWARD_NODE = "autograd::engine::evaluate_function: "


def _site(event, forward_sites):
    """The innermost function of this repository that event ran in ("model.py:177
    Attention.forward"), or for an op of one of autograd's own backward nodes "backward of " the
    forward site that made the node (autograd runs it with no Python above it); "(elsewhere)" if
    neither. The Python frames are the op's parents where the profiler records them as events
    (torch 2.13); else (torch 2.11 with CUDA) the op's recorded stack names them."""
    op = event
    while event is not None:
        if _repo_frame(event.name):  # a Python frame (no torch op is named so)
            return _qualname(*FRAME.match(event.name).groups())
        if event.name.startswith(BACKWARD_NODE):
            return "backward of " + forward_sites.get(event.sequence_nr, "(elsewhere)")
        event = event.cpu_parent
    frame = next((f for f in op.stack if _repo_frame(f)), None)  # innermost first
    return _qualname(*FRAME.match(frame).groups()) if frame else "(elsewhere)"


def _repo_frame(name):
    """True for a Python frame's name in a file of this repository, outside bench/."""
    m = FRAME.match(name)
    return bool(m) and os.path.isfile(os.path.join(ROOT, m.group(1))) and "bench/" not in m.group(1)


def _qualname(path, line, name):
    """"model.py:177 Attention.forward": a method named with its class (the nearest top-level
    class statement above its def)."""
    lines = open(os.path.join(ROOT, path)).read().splitlines()[:int(line)]
    if lines and lines[-1].startswith((" ", "\t")):
        for text in reversed(lines):
            if text.startswith("class "):
                name = re.split(r"[(:]", text[6:])[0] + "." + name
                break
    return f"{path}:{line} {name}"


def time_by_function(events, on_gpu):
    """{"site | op | kernel": ms} over a profile's events (torch.profiler with with_stack=True):
    each CUDA kernel's time under the op it was launched in (on_gpu), else each aten op's own CPU
    time, keyed by _site. Every kernel (op) is counted once: the keys' times add up to the
    profile's."""
    ops = sorted((e for e in events if not FRAME.match(e.name)), key=lambda e: e.time_range.start)
    # a forward op records the sequence number autograd's next node will take: the last op to
    # record it is the one that made that node
    forward_sites = {e.sequence_nr: _site(e, {}) for e in ops
                     if e.sequence_nr >= 0 and not _in_backward(e)}
    times = collections.Counter()
    for e in ops:
        if on_gpu:
            for k in e.kernels:
                times[f"{_site(e, forward_sites)} | {e.name} | {kernel_key(k.name)}"] += \
                    k.duration / 1e3
        elif e.name.startswith("aten::"):
            times[f"{_site(e, forward_sites)} | {e.name}"] += e.self_cpu_time_total / 1e3
    return times


def _in_backward(event):
    while event is not None:
        if event.name.startswith(BACKWARD_NODE):
            return True
        event = event.cpu_parent
    return False


def stack_profile(activities):
    """torch.profiler recording the ops' Python stacks: with_stack, and the verbose experimental
    config, without which torch 2.11 records no stack in a CUDA profile (seen on the H200)."""
    return profile(activities=activities, with_stack=True,
                   experimental_config=torch.profiler._ExperimentalConfig(verbose=True))


def profile_by_function(config, recipe, batch, seq_len, device):
    """time_by_function of one eager micro-step (fresh model, seed 0, after one warm-up), ms."""
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT(config_from_name(config, recipe=RECIPES[recipe]))
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq_len), device=device)
    y = torch.roll(x, -1, dims=1)
    micro_step(model, x, y, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with stack_profile(activities) as prof:
        micro_step(model, x, y, device)
        if device == "cuda":
            torch.cuda.synchronize()
    times = time_by_function(prof.events(), device == "cuda")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return dict(times.most_common())


def profile_recipe(config, recipe, batch, seq_len, iters, device, graphs=False):
    """{wall_ms, busy, kernels: {name: ms}} per micro-step of one recipe (fresh model, seed 0);
    graphs: replayed as CUDA graphs (train.py --cuda_graphs)."""
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.reset_accumulated_memory_stats()
    with torch.device(device):
        model = GPT(config_from_name(config, recipe=RECIPES[recipe]))
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq_len), device=device)
    y = torch.roll(x, -1, dims=1)
    if graphs:
        graph_grads(model)
        model = GraphedMicroStep(model, lambda: torch.autocast(device, dtype=torch.bfloat16),
                                 x.shape, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(2):  # warm-up: Triton's autotuning and compilation, cuBLAS's heuristics
        micro_step(model, x, y, device, graphs)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        micro_step(model, x, y, device, graphs)
    sync()
    wall_ms = (time.perf_counter() - t0) * 1e3 / iters
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            micro_step(model, x, y, device, graphs)
        sync()
    host = {e.key[:80]: e.self_cpu_time_total / 1e3 / iters  # the host's own time per op, ms
            for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]}
    kernels = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[kernel_key(e.name)] += e.device_time / 1e3 / iters  # us -> ms per micro-step
    busy = sum(kernels.values()) / wall_ms if kernels else 0.0
    # cudaMalloc/cudaFree through the caching allocator: a retry frees the cache and waits for the
    # GPU
    stats = torch.cuda.memory_stats() if device == "cuda" else {}
    allocator = {k: stats.get(k, 0)
                 for k in ("num_alloc_retries", "num_device_alloc", "num_device_free")}
    # a graphed model and its graphs reference each other: without the collection their memory pool
    # stays held through the next recipe's capture (an 80 GB card runs out)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"wall_ms": wall_ms, "busy": busy, "kernels": dict(kernels.most_common()), "host": host,
            "allocator": allocator}


def report(results, top):
    lines = []
    for recipe, r in results.items():
        if "by_function" in r:
            lines.append(f"{recipe}, by function (ms, one eager micro-step):")
            lines += [f"  {ms:9.2f} ms  {key}" for key, ms in list(r["by_function"].items())[:top]]
        lines.append(f"{recipe}: {r['wall_ms']:.1f} ms per micro-step, GPU busy {r['busy']:.0%}, "
                     f"allocator {r['allocator']}")
        for name, ms in list(r["kernels"].items())[:top]:
            lines.append(f"  {ms:9.2f} ms  {name}")
        lines.append("  host, self time:")
        for name, ms in list(r["host"].items())[:6]:
            lines.append(f"  {ms:9.2f} ms  {name}")
    first, *others = results
    for recipe in others:
        base, ours = results[first]["kernels"], results[recipe]["kernels"]
        extra = {k: ours.get(k, 0.0) - base.get(k, 0.0) for k in {*base, *ours}}
        lines.append(f"{recipe} over {first}: "
                     f"{results[recipe]['wall_ms'] - results[first]['wall_ms']:+.1f} ms wall")
        for name, ms in sorted(extra.items(), key=lambda kv: -abs(kv[1]))[:top]:
            lines.append(f"  {ms:+9.2f} ms  {name}")
    return "\n".join(lines)


def fail(msg):
    print(f"bench/profile_step.py: {msg}", file=sys.stderr)
    sys.exit(2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--config", default="1b")
    p.add_argument("--recipes", default="bf16,fullstack", help="comma-separated; the first is the "
                   "baseline of the difference table")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--iters", type=int, default=2, help="micro-steps timed and profiled")
    p.add_argument("--top", type=int, default=15, help="kernels listed per table")
    p.add_argument("--out", default=None, help="JSON file for the numbers")
    p.add_argument("--cuda_graphs", action="store_true",
                   help="replay each micro-step as CUDA graphs (train.py --cuda_graphs)")
    p.add_argument("--by_function", action="store_true",
                   help="also: one eager micro-step's kernel time by the repository's function that "
                   "launched it (CPU: the ops' own CPU time)")
    p.add_argument("--dry_run", action="store_true", help="tiny config on the CPU: no timing claim")
    args = p.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.cuda_graphs and device != "cuda":
        fail("--cuda_graphs needs a CUDA GPU")
    if args.dry_run:
        args.config, args.batch_size, args.seq_len, args.iters = "tiny", 1, 64, 1
    elif device != "cuda":
        fail("needs a CUDA GPU (use --dry_run to check it on a CPU)")
    recipes = args.recipes.split(",")
    if bad := [r for r in recipes if r not in RECIPES]:
        fail(f"--recipes: unknown recipe {bad[0]!r}; expected some of {', '.join(RECIPES)}")
    results = {r: profile_recipe(args.config, r, args.batch_size, args.seq_len, args.iters, device,
                                 args.cuda_graphs) for r in recipes}
    if args.by_function:
        for r in recipes:
            results[r]["by_function"] = profile_by_function(args.config, r, args.batch_size,
                                                            args.seq_len, device)
    print(report(results, args.top))
    if args.out:
        from kernels.nvfp4_gemm import use_dot_scaled  # the NVFP4 GEMM route these kernels took
        route = "blackwell dot_scaled" if use_dot_scaled(torch.device(device)) else "grid values"
        meta = {"config": args.config, "batch_size": args.batch_size, "seq_len": args.seq_len,
                "cuda_graphs": args.cuda_graphs,
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "torch": torch.__version__, "gemm_route": route}
        with open(args.out, "w") as f:
            json.dump({**meta, "recipes": results}, f, indent=1)


if __name__ == "__main__":
    main()
