"""
Where a training step's time goes, for one recipe on one GPU: torch.profiler over a few steps after warm-up.
Prints the step time, the GPU-busy fraction (sum of kernel times / wall time: far below 1 means the step is
host-bound, i.e. Python and launch overhead), kernel launches per step, and the top GPU kernels and CPU ops.

    python tools/profile_step.py --recipe fullstack --optimizer adamw          # toy, 16 x 512 tokens a step
    python tools/profile_step.py --recipe bf16 --config toy --trace /tmp/t.json  # + a Chrome trace

It builds the model, optimizer and data and runs the step with train.py's functions, without checkpoints or evals.
"""

import argparse
import contextlib
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import data  # noqa: E402
import train  # noqa: E402
from model import GPT, config_from_name  # noqa: E402
from train import RECIPES  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="toy")
    p.add_argument("--recipe", default="fullstack")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--grad_accum", type=int, default=1, help="micro-batches a step (the 1b config's own is 64)")
    p.add_argument("--warmup_steps", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--trace", default=None, help="write a Chrome trace here")
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test of this script (reference paths)")
    a = p.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA GPU (or --device cpu)")
    cuda = a.device == "cuda"
    args = train.parse_args(["--config", a.config, "--recipe", a.recipe, "--optimizer", a.optimizer, "--device",
                             a.device, "--batch_size", str(a.batch_size), "--seq_len", str(a.seq_len),
                             "--grad_accum", str(a.grad_accum), "--max_steps", "10"])
    train.resolve_args(args, 1)
    linear_policy, attn_policy, state_quant = RECIPES[a.recipe]
    torch.manual_seed(0)
    cfg = config_from_name(a.config, linear_policy=linear_policy, attn_policy=attn_policy)
    with torch.device(a.device):
        model = GPT(cfg)
    optimizer = train.build_optimizer(model, args, state_quant)
    loader = data.TokenLoader(os.path.join(args.data, "train.bin"), a.batch_size, a.seq_len)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def step():  # train.py's step without the schedule, the checks and the logging
        train.compute_gradients(model, model, loader, args, autocast, a.device, False, linear_policy == "lora_svd", 0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(a.warmup_steps):  # compiles, autotuning, CUDA-graph captures
        step()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        sync()
        wall = (time.perf_counter() - t0) / a.steps
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / a.steps
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                        "cudaLaunchKernelExC")) / a.steps
    tokens = a.batch_size * a.seq_len * args.grad_accum  # the config's micro-batches per step
    print(f"{a.config} {a.recipe}/{a.optimizer}, {args.grad_accum} x {a.batch_size} x {a.seq_len} tokens: "
          f"{wall * 1e3:.1f} ms a step, {tokens / wall:,.0f} tokens/s; GPU kernels {gpu_us / 1e3:.1f} ms a step "
          f"({gpu_us / 1e6 / wall:.0%} busy); {launches:.0f} kernel launches a step")
    if cuda:
        print(events.table(sort_by="self_cuda_time_total", row_limit=25, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    if a.trace:
        prof.export_chrome_trace(a.trace)


if __name__ == "__main__":
    main()
