"""
Launch sweep of kernels/nvfp4_quant's cols kernel (16x1 blocks of a row-major x: eq. 2's wgrad operands) on the
GPU: (num_warps, register cap) against time, for the three launches NVFP4Linear's backward makes per call (dY's
amax pair, Q16x1(H^T dY) -> bf16 values, and the same from the packed Q1x16(X)). Prints microseconds; pick
COLS_WARPS / COLS_MAXNREG from it.

    python scripts/sweep_cols.py [--tokens 16384 --features 4096]
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from triton.testing import do_bench

import nvfp4
from kernels import nvfp4_quant as kq

p = argparse.ArgumentParser()
p.add_argument("--tokens", type=int, default=16384)
p.add_argument("--features", type=int, default=4096)
args = p.parse_args()
g = torch.Generator(device="cuda").manual_seed(0)
dy = torch.randn(args.tokens, args.features, device="cuda", generator=g).to(torch.bfloat16)
xq = kq.quantize(torch.randn(args.tokens, args.features, device="cuda", generator=g).to(torch.bfloat16))
H = nvfp4.random_hadamard(device="cuda")
amax = kq.global_amax_pair(dy, H)[1]
cases = {
    "amax pair dY": lambda: kq.global_amax_pair(dy, H),
    "Q16x1(H^T dY) -> values": lambda: kq.quantize_dequant(dy, (16, 1), "sr", seed=1, hadamard=H, global_amax=amax),
    "Q16x1(H^T X-hat) packed -> values (+amax)": lambda: kq.quantize_dequant(xq, (16, 1), "sr", seed=1, hadamard=H),
}
print(f"{'warps':>5} {'maxnreg':>7}  " + "  ".join(f"{c:>42}" for c in cases))
for warps, maxnreg in [(4, None), (4, 168), (4, 128), (2, None), (2, 168), (8, None), (8, 168), (8, 128)]:
    kq.COLS_WARPS, kq.COLS_MAXNREG = warps, maxnreg
    times = [do_bench(f, warmup=25, rep=100) * 1e3 for f in cases.values()]
    print(f"{warps:5d} {str(maxnreg):>7}  " + "  ".join(f"{t:39.1f} us" for t in times), flush=True)
