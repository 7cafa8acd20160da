"""
The dS-quantizing backward passes' tiles, timed: how kernels/flash_attention.DKDV_CONFIG_QUANT_DS
and DQ_CONFIG_QUANT_DS are chosen (docs/attention.md). attention.attention(policy) fwd+bwd at the
speed table's shape (bench/layers.py), once per candidate (BLOCK_M, BLOCK_N, num_warps,
num_stages) of one pass, against torch's default SDPA dispatch; each candidate's gradient (dK, or
dQ for --pass dq) against the committed tiles' (they differ by summation order only: the dS draws
are per element).

    python bench/attention_tiles.py                                 # dK/dV candidates, fp4
    python bench/attention_tiles.py --pass dq                       # dQ candidates
    python bench/attention_tiles.py --tiles 32x64x4x3,16x128x8x2 --policy fp4_all
    python bench/attention_tiles.py --pass dq --tiles 64x32x4x2r168 # a register cap (maxnreg)
    python bench/attention_tiles.py --dry_run                       # CPU smoke run, no timing

The dK/dV candidates: the committed tiles, those that compile for sm_90 without a spill under
Triton 3.6 and 3.9 (tests/compile_for_target.py 90 --sass; the committed 32x64 on 4 warps spills),
and 32x128 on 8 warps, whose unmasked loop (compile_for_target's `loop`) costs the committed
tiles' instructions a dS element with less spill. The dQ candidates: the committed 64x32 and the
neighbours whose loop stays near its length per element (32x64 on 4 warps, 64x64 on 8 take about
twice: left out); 128x64 on 8 warps and 64x64 on 4 fit one block an SM; 32x32 on 4 warps,
smaller, fits more (docs/performance.md has the counts).

A tile may end in rR: Triton's register cap (maxnreg) R, to fit more blocks an SM where registers
are what limits them (the passes are latency-bound: docs/performance.md).

    python bench/attention_tiles.py --schedule 1,33554432           # the launch order's groups

--schedule times the committed tiles under values of flash_attention.SCHEDULE_L2_BYTES (1: one kv
head a group, close to a head-major order) and checks that dQ, dK and dV keep every bit.
"""

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

if "--dry_run" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("NANOFP4_ROUTE", "kernels")

import attention  # noqa: E402
from kernels import flash_attention  # noqa: E402
from layers import kernel_ms, time_ms  # noqa: E402

CANDIDATES = {"dkdv": "32x64x4x3,32x128x8x2,16x128x8x2,64x32x8x2,16x64x8x2,32x32x8x2",
              "dq": "64x32x4x2r168,64x32x4x4,64x32x4x3,128x32x8x3,128x64x8x2,64x64x4x3"}
CONFIG = {"dkdv": "DKDV_CONFIG_QUANT_DS", "dq": "DQ_CONFIG_QUANT_DS"}  # flash_attention's names
GRADIENT = {"dkdv": 1, "dq": 0}  # the gradient each pass writes: dK, dQ
KERNEL = {"dkdv": "_attn_bwd_dkdv", "dq": "_attn_bwd_dq"}  # the pass's kernel, by its name


def tile(spec):
    """'64x32x4x2' or '64x32x4x2r168' -> the launch config: tiles, warps, stages[, maxnreg]."""
    shape, r, cap = spec.partition("r")
    bm, bn, warps, stages = (int(v) for v in shape.split("x"))
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return dict(cfg, maxnreg=int(cap)) if r else cfg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--pass", dest="pass_", default="dkdv", choices=sorted(CONFIG),
                   help="which backward pass's tiles")
    p.add_argument("--tiles", default=None, help="comma-separated "
                   "BLOCK_MxBLOCK_Nxnum_warpsxnum_stages[rMAXNREG] of that pass (default: its "
                   "candidates)")
    p.add_argument("--policy", default="fp4", choices=[p for p in attention.POLICIES
                                                       if p != "bf16"])
    p.add_argument("--dry_run", action="store_true", help="tiny shapes on the CPU's interpreter "
                   "(which runs its own tiles): checks the script, no timing claim")
    p.add_argument("--schedule", default=None, help="comma-separated byte counts for "
                   "flash_attention.SCHEDULE_L2_BYTES, timed with the committed tiles (instead of "
                   "tiles)")
    args = p.parse_args(argv)
    args.tiles = args.tiles or CANDIDATES[args.pass_]
    try:
        tiles = [tile(t) for t in args.tiles.split(",")]
    except (ValueError, AssertionError):
        print(f"attention_tiles.py: --tiles {args.tiles!r} is not "
              "BLOCK_MxBLOCK_Nxwarpsxstages[rMAXNREG],...", file=sys.stderr)
        sys.exit(2)
    l2_bytes = args.schedule.split(",") if args.schedule else []
    if not all(b.isdigit() and int(b) > 0 for b in l2_bytes):
        print(f"attention_tiles.py: --schedule {args.schedule!r} is not positive byte counts "
              "BYTES,...", file=sys.stderr)
        sys.exit(2)
    l2_bytes = [int(b) for b in l2_bytes]
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("attention_tiles.py: needs a CUDA GPU (--dry_run for the CPU)", file=sys.stderr)
        sys.exit(2)
    B, H, Hkv, T, D = (1, 2, 1, 64, 64) if args.dry_run else (8, 16, 8, 2048, 128)
    torch.manual_seed(0)
    q = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, device=device, dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn_like(q)

    def fwd_bwd(attend):
        return lambda: torch.autograd.grad(attend(q, k, v), (q, k, v), do)

    sdpa = fwd_bwd(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                  enable_gqa=True))
    sdpa_ms, sdpa_kernels = time_ms(sdpa, device), kernel_ms(sdpa, device)
    run = fwd_bwd(lambda q, k, v: attention.attention(q, k, v, causal=True, policy=args.policy))
    if l2_bytes:
        return schedules(run, l2_bytes, device, sdpa_kernels, (B, H, Hkv, T, D), args.policy)
    name, g = CONFIG[args.pass_], GRADIENT[args.pass_]
    committed = dict(getattr(flash_attention, name))
    torch.manual_seed(1)  # the same dS SR seeds (drawn by the device's RNG) for each candidate
    want = run()[g].float()
    grad = ("dK", "dQ")[args.pass_ == "dq"]
    print(f"attention(policy={args.policy!r}) fwd+bwd, B{B} H{H}/{Hkv} T{T} D{D} causal; "
          f"SDPA default dispatch {sdpa_ms:.3f} ms, its kernels {sdpa_kernels:.3f} ms")
    # ms: a call's wall time, which the host's launches can set (the FP4 call's host time is
    # near its GPU time); kernels: the GPU's own time, the one to choose tiles by
    print(f"| {args.pass_} tiles (M, N, warps, stages[, register cap]) | ms | kernels ms "
          f"| {KERNEL[args.pass_]} ms "
          f"| kernels vs SDPA's | max |{grad} - committed's| / max |{grad}| |")
    print("|---|---|---|---|---|---|")
    try:
        for cfg in tiles:
            setattr(flash_attention, name, cfg)
            torch.manual_seed(1)
            got = run()[g].float()
            diff = ((got - want).abs().max() / want.abs().max()).item()
            ms, kms = time_ms(run, device), kernel_ms(run, device)
            pass_ms = kernel_ms(run, device, name=KERNEL[args.pass_])
            cap = f", {cfg['maxnreg']} regs" if "maxnreg" in cfg else ""
            print(f"| {cfg['BLOCK_M']} x {cfg['BLOCK_N']}, {cfg['num_warps']}, {cfg['num_stages']}"
                  f"{cap} | {ms:.3f} | {kms:.3f} | {pass_ms:.3f} | "
                  f"{sdpa_kernels / kms if kms else 0:.2f}x | {diff:.1e} |", flush=True)
    finally:
        setattr(flash_attention, name, committed)

def schedules(run, l2_bytes, device, sdpa_kernels, shape, policy):
    """The three passes' kernel times under each SCHEDULE_L2_BYTES; the gradients must not move."""
    B, H, Hkv, T, D = shape
    committed = flash_attention.SCHEDULE_L2_BYTES
    torch.manual_seed(1)
    want = run()
    print(f"attention(policy={policy!r}) fwd+bwd, B{B} H{H}/{Hkv} T{T} D{D} causal, committed "
          f"tiles; SDPA's kernels {sdpa_kernels:.3f} ms")
    print("| SCHEDULE_L2_BYTES | kv heads a group | kernels ms | _attn_fwd | _attn_bwd_dkdv "
          "| _attn_bwd_dq | kernels vs SDPA's | dQ, dK, dV bit for bit |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for b in l2_bytes:
            flash_attention.SCHEDULE_L2_BYTES = b
            torch.manual_seed(1)
            same = all(torch.equal(x, y) for x, y in zip(run(), want))
            kms = kernel_ms(run, device)
            passes = [kernel_ms(run, device, name=n)
                      for n in ("_attn_fwd", "_attn_bwd_dkdv", "_attn_bwd_dq")]
            group = flash_attention._kv_head_group(T, D, H // Hkv, 2)
            print(f"| {b} | {group} | {kms:.3f} | " + " | ".join(f"{t:.3f}" for t in passes)
                  + f" | {sdpa_kernels / kms if kms else 0:.2f}x | {same} |", flush=True)
    finally:
        flash_attention.SCHEDULE_L2_BYTES = committed


if __name__ == "__main__":
    main()
