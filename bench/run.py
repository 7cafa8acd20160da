"""
The whole speed table in one command: every public call a training step makes against what a user
would run instead (bench/layers.py), then train.py end to end at the paper's 1M-token step
(bench/end_to_end.py). Prints the tables and writes the record: results/speed/speed.json (every row,
with the device, versions, date and commit it was measured with, and the NVFP4 GEMM route: "hopper
grid-values" or, on a Blackwell GPU, "blackwell dot_scaled") and results/speed/speed.md (the
tables). A partial run replaces only the rows it measured. On a Blackwell GPU the same command
measures the FP4 tensor-core route (docs/blackwell.md: what it should reach).

    # everything, one GPU (the end-to-end rows take longest)
    python bench/run.py
    # the layer rows: a couple of minutes
    python bench/run.py --only attention,linear,optim,quantize
    python bench/run.py --only train --configs 1b --runs bf16:adamw,fullstack:adamw --compile both
    python bench/run.py --only train --configs toy --runs bf16:adamw,fullstack:adamw \
        --cuda_graphs both
    # CPU smoke run: tiny shapes, the tiny config (tests)
    python bench/run.py --dry_run
"""

import argparse
import datetime
import itertools
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the modules (attention.py, nvfp4.py, ...) live at the repo root

import torch  # noqa: E402

if "--dry_run" in sys.argv and not torch.cuda.is_available():
    # Triton's CPU interpreter; read when kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import end_to_end  # noqa: E402
import layers  # noqa: E402

SECTIONS = (*layers.SECTIONS, "train")


# a run's mode in --runs: (train.py --compile, --cuda_graphs)
MODES = {"eager": (False, False), "graphs": (False, True), "compile": (True, False),
         "compile_graphs": (True, True)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections of {list(SECTIONS)}")
    p.add_argument("--configs", default="toy,1b", help="train.py configs of the end-to-end rows")
    p.add_argument("--runs", default=",".join(f"{r}:{o}" for r, o in end_to_end.RUNS),
                   help="recipe:optimizer[:mode] items of the end-to-end rows; a mode (one of "
                   f"{', '.join(MODES)}) replaces --compile and --cuda_graphs for its item")
    p.add_argument("--compile", default="both", choices=("both", "eager", "compile"),
                   help="end-to-end rows without --compile, with it, or both")
    p.add_argument("--cuda_graphs", default="off", choices=("off", "on", "both"),
                   help="end-to-end rows with train.py --cuda_graphs (default: %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per end-to-end run "
                   f"(the first {end_to_end.WARMUP_STEPS} are not timed)")
    p.add_argument("--run_timeout", type=float, default=600,
                   help="seconds before one train.py run is stopped")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds: start no end-to-end run after this")
    p.add_argument("--out_dir", default=None,
                   help="the record's folder (default results/speed; dry run: runs/bench_dry)")
    p.add_argument("--runs_dir", default="runs/bench",
                   help="train.py output of the end-to-end runs")
    p.add_argument("--data", default=None,
                   help="train.py --data (default: train.py's, the offline corpus)")
    p.add_argument("--dry_run", action="store_true",
                   help="CPU smoke run of every section: tiny shapes, no timing claim")
    args = p.parse_args(argv)

    def fail(msg):
        print(f"bench/run.py: {msg}", file=sys.stderr)
        sys.exit(2)

    args.only = args.only.split(",")
    args.configs = args.configs.split(",")
    args.runs = [tuple(item.split(":")) for item in args.runs.split(",")]
    if bad := [s for s in args.only if s not in SECTIONS]:
        fail(f"--only: unknown section {bad[0]!r}; expected some of {list(SECTIONS)}")
    if bad := [c for c in args.configs if c not in end_to_end.MICRO_BATCH]:
        fail(f"--configs: no micro-batch set for config {bad[0]!r}; "
             f"expected some of {list(end_to_end.MICRO_BATCH)}")
    if bad := [r for r in args.runs if len(r) not in (2, 3) or r[1] not in ("adamw", "root")
               or r[2:] and r[2] not in MODES]:
        fail(f"--runs: {':'.join(bad[0])!r} is not recipe:optimizer[:mode] with optimizer adamw "
             f"or root and mode one of {', '.join(MODES)}")
    if args.steps <= end_to_end.WARMUP_STEPS:
        fail(f"--steps {args.steps}: need more than {end_to_end.WARMUP_STEPS} (the first "
             f"{end_to_end.WARMUP_STEPS} steps are not timed)")
    if args.dry_run and (args.cuda_graphs != "off" or any(MODES[r[2]][1] for r in args.runs
                                                          if len(r) == 3)):
        fail("--dry_run runs on the CPU: --cuda_graphs needs a CUDA GPU")
    if not args.dry_run and not torch.cuda.is_available():
        fail("needs a CUDA GPU (use --dry_run to check the script on a CPU)")
    if args.dry_run:  # the tiny config and two recipes, eager: what a CPU can run in a minute
        args.configs, args.compile, args.steps = ["tiny"], "eager", end_to_end.WARMUP_STEPS + 1
        args.runs = [r for r in args.runs if r[:2] in (("bf16", "adamw"), ("fullstack", "adamw"))]
    args.out_dir = args.out_dir or ("runs/bench_dry" if args.dry_run else "results/speed")
    return args


def gemm_route():
    """The NVFP4 GEMM route this machine's runs take (kernels/nvfp4_gemm.py picks it per GPU):
    Blackwell's FP4 tensor cores through tl.dot_scaled, or the bf16 grid values through cuBLAS."""
    if not torch.cuda.is_available():
        return "cpu reference"
    from kernels.nvfp4_gemm import use_dot_scaled
    return "blackwell dot_scaled" if use_dot_scaled(torch.device("cuda")) else "hopper grid-values"


def measured_with():
    from train import git_commit  # $NANOFP4_COMMIT first: a GPU machine's copy of .git may be stale
    import triton
    return {"date": datetime.date.today().isoformat(),
            # one call's rows share it: the ratios are taken within a call (add_ratios)
            "call": datetime.datetime.now().isoformat(timespec="seconds"),
            "commit": git_commit() or "",
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "gemm_route": gemm_route()}


def when(r):
    """The table's "measured" cell: date, commit and the GEMM route of the row."""
    m = r["measured"]
    return f"{m['date']} {m['commit']}" + (f" {m['gemm_route']}" if "gemm_route" in m else "")


def merge(path, new_rows):
    """The record's rows with those measured now replacing the ones of the same section and name."""
    old = json.load(open(path))["rows"] if os.path.exists(path) else []
    keys = {(r["section"], r["name"]) for r in new_rows}
    return [r for r in old if (r["section"], r["name"]) not in keys] + new_rows


def tables(rows):
    out = ["| section | ours | ms | baseline | ms | speed vs baseline | measured |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["section"] != "train":
            gpu = f" (kernels {r['device_ms']:.3f})" if r.get("device_ms") else ""
            gpu += f" (host {r['host_ms']:.3f})" if r.get("host_ms") else ""
            out.append(f"| {r['section']} | {r['name']} | {r['ms']:.3f}{gpu} | {r['baseline']} "
                       f"| {r['baseline_ms']:.3f} | **{r['speed_vs_baseline']:.2f}x** "
                       f"| {when(r)} |")
    train = [r for r in rows if r["section"] == "train"]
    if train:
        out += ["", "| config | recipe | optimizer | --compile | tokens/s | vs bf16 "
                "| vs bf16 --compile | peak mem | optimizer bytes/param | measured |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in train:
            def ratio(base):  # against the baseline measured in the same call, and its rate
                return (f"{r[f'vs_{base}']:.2f}x of {r[f'{base}_tokens_per_s']:,.0f}"
                        if f"{base}_tokens_per_s" in r else "-")
            numbers = (f"{r['tokens_per_s']:,.0f} | {ratio('bf16')} | "
                       f"{ratio('bf16_compile')} | {r['peak_mem_gib']:.1f} GiB | "
                       f"{r['optimizer_bytes_per_param']:.2f}") if "error" not in r \
                else f"failed: {r['error'].strip().splitlines()[-1][:100]} | | | | "
            out.append(f"| {r['config']} | `{r['recipe']}` | {r['optimizer']} | "
                       f"{'yes' if r['compile'] else ''}"
                       f"{' (graphs)' if r.get('cuda_graphs') else ''} | {numbers} | {when(r)} |")
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse_args(argv)
    start, device, meta = time.time(), "cpu" if args.dry_run else "cuda", measured_with()
    rows = []
    for section in (s for s in layers.SECTIONS if s in args.only):
        for r in layers.SECTIONS[section](device, args.dry_run):
            rows.append({**r, "measured": meta})
            gpu = f" (kernels {r['device_ms']:.3f} ms)" if r.get("device_ms") else ""
            gpu += f" (host {r['host_ms']:.3f} ms)" if r.get("host_ms") else ""
            print(f"{r['section']:9s} {r['name']:72s} {r['ms']:9.3f} ms{gpu}  "
                  f"{r['speed_vs_baseline']:5.2f}x {r['baseline']} ({r['baseline_ms']:.3f} ms)",
                  flush=True)
    if "train" in args.only:
        modes = {"both": (False, True), "eager": (False,), "compile": (True,)}[args.compile]
        graphs = {"both": (False, True), "off": (False,), "on": (True,)}[args.cuda_graphs]
        for config in args.configs:
            for recipe, optimizer, *mode in args.runs:
                for compile, cuda_graphs in ([MODES[mode[0]]] if mode
                                             else itertools.product(modes, graphs)):
                    if args.deadline is not None and time.time() - start > args.deadline:
                        print(f"train     {config} {recipe} {optimizer} compile={compile} "
                              f"cuda_graphs={cuda_graphs}: skipped (deadline)")
                        continue
                    r = end_to_end.run_one(config, recipe, optimizer, compile, args.steps,
                                           args.runs_dir, args.run_timeout, cuda_graphs,
                                           data=args.data,
                                           device=device if args.dry_run else None,
                                           step_tokens=(2 * 2 * 64 if args.dry_run
                                                        else end_to_end.STEP_TOKENS))
                    rows.append({**r, "measured": meta})
                    print(f"train     {r['name']:40s} "
                          + (f"{r['tokens_per_s']:,.0f} tokens/s" if "error" not in r
                             else f"FAILED {r['error']}"), flush=True)
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "speed.json")
    all_rows = merge(json_path, end_to_end.add_ratios(rows))  # ratios within this call
    with open(json_path, "w") as f:
        json.dump({"about": "bench/run.py: ours vs what a user would run instead; "
                            "see README.md here",
                   "rows": all_rows}, f, indent=1)
    table = tables(all_rows)
    with open(os.path.join(args.out_dir, "speed.md"), "w") as f:
        f.write(table)
    print("\n" + table + f"\nwrote {json_path} and speed.md ({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
