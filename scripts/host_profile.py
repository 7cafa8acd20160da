"""
Where the host's time goes when it enqueues one NVFP4Linear fwd+bwd (16384 tokens, 4096 x 4096, bf16), the
benchmark of issue 3: bench_nvfp4.py measured 2.9 ms of host time per call against 3.1 ms of GPU time, so the
Python side bounds the step. The GPU spins in torch.cuda._sleep meanwhile, so every launch below only queues
and cProfile sees pure host cost.

    python scripts/host_profile.py [--steps 20] [--top 35]     (CUDA GPU)
"""

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch

import nvfp4


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--width", type=int, default=4096)
    args = p.parse_args()
    T, D = args.tokens, args.width
    layer = nvfp4.NVFP4Linear(D, D, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)

    def step():
        x.grad = layer.weight.grad = None
        layer(x).backward(dy)

    for _ in range(3):  # compile every kernel first
        step()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU spin: the launches below only queue
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    host_ms = (time.perf_counter() - t0) / args.steps * 1e3
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    prof.disable()
    torch.cuda.synchronize()
    print(f"host time per NVFP4Linear fwd+bwd ({T} x {D} x {D}): {host_ms:.3f} ms (without cProfile)")
    stats = pstats.Stats(prof)
    for key in ("tottime", "cumulative"):
        print(f"\n--- top {args.top} by {key} (totals over {args.steps} steps) ---")
        stats.sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
