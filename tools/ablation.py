"""
The seeded ablation: the paper's Table 3 rows (recipe x optimizer) at a small scale, three seeds
each, one `train.py` run per (recipe, optimizer, seed), then one table, one plot and one verdict per
paper claim.

    python tools/ablation.py --config tiny --max_steps 30 --lr 3e-3 --seeds 0   # a CPU smoke run
    python tools/ablation.py --config toy --max_steps 300 --lr adamw=2e-3,root=4e-3 --gpus 0,1 \
        --jobs_per_gpu 2 --deadline 560                        # GPU: call again to continue
    python tools/ablation.py --rows lora_naive_root --force ...   # rerun one row (all its seeds)
    python tools/ablation.py --aggregate_only                     # table, plot, verdicts only
    python tools/ablation.py --grid split ...     # fullstack/Root's parts one at a time on lora_svd
    python tools/ablation.py --grid width ...     # bf16, nvfp4_46, lora_svd at 3 widths (App. 7)
    python tools/ablation.py --grid scale ...     # the full-stack gap against model size (4 rungs)

The grid (--grid table3): bf16, nvfp4, nvfp4_46, lora_naive, lora_svd, fullstack with adamw and
root, every seed; naive_fp4 (App. 13's collapsing baseline) once per optimizer, with the first seed.
Each run writes into <runs>/<name>/ (name = <row>_<optimizer>_s<seed>, the row being the recipe
here), its log into <runs>/<name>.log (the command on the first line) and the tool's record of it
into <runs>/<name>.json. A run is finished when <runs>/<name>/summary.json exists, or when train.py
stopped it for a non-finite loss (a diverged run is a result, not a failure); finished runs are
skipped, an unfinished one continues from its last checkpoint (every SAVE_EVERY steps) or starts
over. `--rows` picks rows by name: a row (`nvfp4`), a row and optimizer (`nvfp4_root`), a run
(`nvfp4_root_s1`) or a glob (`lora_*`).

--grid split: SPLIT_ROWS, lora_svd plus one part of fullstack at a time (a precision-contract entry,
train.py --numerics), paired by seed with plain lora_svd, and LEAVE_ONE_OUT_ROWS, fullstack with
one part back in high precision, paired with fullstack. --grid width: WIDTH_RECIPES at --widths,
the same tokens per non-embedding parameter (width_flags). --grid scale: SCALE_RECIPES with both
optimizers on SCALE_RUNGS, the same tokens per parameter (scale_flags), one table of the gaps and
their slope per doubling (scale_tables) and results/scale/gap_vs_params.png. --dry_run prints
every command and the estimated GPU time (gpu_seconds).

Every recipe of one optimizer trains at one peak lr (--lr: bf16's best for that optimizer, from a
short sweep at the same config and length), the LoRA factors included (--lora_lr_scale 1, where
train.py's default is the paper's 2x). Why: below the best lr, a LoRA branch trained by AdamW inside
a layer that Root trains adds a low-rank step several times larger in spectral norm than Root's own
step, and wins by that extra step alone; at the best lr a 2x branch lr destabilizes training
instead. Neither is what the paper's Table 3 compares.

Then it aggregates every finished run under <runs> (not only this call's) into
<results>/summary.json (one row per run), <results>/table.md (mean +- std of the final val loss, %
gap to bf16, verdicts) and <results>/loss_curves.png. The claims and the rules that decide them are
in `verdicts` below (and in split_tables, width_tables for the other grids).
"""
import argparse
import fnmatch
import glob
import json
import math
import os
import queue
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = ("bf16", "nvfp4", "nvfp4_46", "lora_naive", "lora_svd", "fullstack")  # every seed
COLLAPSING = "naive_fp4"  # App. 13: collapses; one seed per optimizer shows it
OPTIMIZERS = ("adamw", "root")
# queue order within a seed: slowest recipes first, so parallel workers finish at about one time
SLOWEST_FIRST = ("fullstack", "lora_svd", "naive_fp4", "lora_naive", "nvfp4_46", "nvfp4", "bf16")
TRAIN_FLAGS = ("config", "max_steps", "batch_size", "seq_len", "lr", "warmup", "eval_every",
               "eval_iters", "log_every", "data")  # to train.py when given (else its defaults)
RUN_NAME = re.compile(r"^(?P<recipe>[a-z0-9_]+)_(?P<optimizer>adamw|root)_s(?P<seed>\d+)$")
TAIL = 0.1  # train loss = mean over the last 10% of logged steps (one batch's loss is noisy)
COLLAPSE_NATS = 1.0  # collapsed: non-finite, or this far above its own best / above bf16's val loss
CLOSE_POINTS = 1.0  # "fullstack close to lora_svd": gaps to bf16 differ by at most this (% pts)
RESOLVE_STDS = 3.0  # the issue's criterion: bf16-vs-nvfp4 gap >= 3x bf16's seed-to-seed std
SIGNIFICANT_SES = 2.0  # an ordering is resolved when its mean difference exceeds 2 standard errors
# a row of <results>/summary.json: the numbers, and what made them (the run's command, device,
# train.py's numerics_id and commit: tests/test_records.py checks the id against today's code)
ROW_FIELDS = ("recipe", "optimizer", "seed", "val_loss", "train_loss", "tokens", "params", "steps",
              "status", "tokens_per_param", "epochs", "config", "tokens_per_s", "wall_s", "command",
              "best_train_loss", "hardware", "date", "device", "numerics_id", "commit", "curve")

# --------------------------------------------------------------------------------------------------
# Two more grids (--grid), each row one recipe plus precision-contract overrides (train.py
# --numerics KEY=VALUE, one entry each: the rows are entries of the contracts, not code paths).
BF16_ATTN = {"attn_policy": "bf16"}                  # fullstack's other parts without FP4 attention
MOMENTUM_FP32 = "optim.root.momentum=fp32"
NS_FP32 = "optim.newton_schulz=fp32"
ADAMW_FP32 = "optim.adamw.m=fp32"  # AdamW's moments in fp32 (embeddings, head, norms, LoRA factors)
# split: which part of fullstack costs Root. (row, recipe, optimizer, numerics, flags); the first
# row of each optimizer is the reference the others are paired with, seed by seed. A row with one
# part of fullstack on lora_svd is fullstack with every other part back in fp32 / bf16; the row
# fullstack has them all, and what the parts' costs do not add up to is their interaction. The rows
# named as Table 3's recipes are Table 3's runs (table3_rows: not trained twice).
SPLIT_ROWS = (
    ("lora_svd", "lora_svd", "root", (), {}),
    ("lora_svd_attn_fp4", "lora_svd", "root", (), {"attn_policy": "fp4"}),
    ("lora_svd_momentum_nvfp4", "fullstack", "root", (NS_FP32, ADAMW_FP32), BF16_ATTN),
    ("lora_svd_adamw_nvfp4", "fullstack", "root", (MOMENTUM_FP32, NS_FP32), BF16_ATTN),
    ("lora_svd_ns_nvfp4", "fullstack", "root", (MOMENTUM_FP32, ADAMW_FP32), BF16_ATTN),
    ("fullstack", "fullstack", "root", (), {}),
    ("lora_svd", "lora_svd", "adamw", (), {}),
    ("lora_svd_states_nvfp4", "fullstack", "adamw", (), BF16_ATTN),
)
# The split's reverse: fullstack/Root with one part back in fp32 / bf16, paired by seed with
# fullstack: what each part costs in the presence of the others (SPLIT_ROWS: alone), which is what
# an interaction between the parts shows up in.
LEAVE_ONE_OUT_ROWS = (
    ("fullstack_attn_bf16", "fullstack", "root", (), BF16_ATTN),
    ("fullstack_momentum_fp32", "fullstack", "root", (MOMENTUM_FP32,), {}),
    ("fullstack_adamw_fp32", "fullstack", "root", (ADAMW_FP32,), {}),
    ("fullstack_ns_fp32", "fullstack", "root", (NS_FP32,), {}),
)
SAME_RUN_FLAGS = {"--cuda_graphs": 0, "--resume": 0, "--out_dir": 1}  # (arguments): same numbers
# width: App. 7's claim (direct NVFP4 error grows with the hidden dim) in training. Same depth as
# tiny, head_dim 64, GQA 2:1 where there are 2+ heads, SwiGLU 3x, LoRA rank width/4 (tiny's
# 32/128), the same steps at every width and a batch that grows as width^2: the same tokens per
# non-embedding parameter.
WIDTH_RECIPES = ("lora_svd", "nvfp4_46", "bf16")    # queue order: slowest first
WIDTH_OPTIMIZER = "adamw"
MAX_MICRO_BATCH = 64  # sequences per micro-step at most (memory, ~12 runs a GPU); then grad_accum
# GPU-share ms per micro-step of a tiny run with ~10 runs on one H200 (the 2026-11-30 record: 8192
# tokens / (tokens/s of a run x 10)), for the cost estimate of --dry_run; widths add
# 6 x matmul params x tokens at FLOP_RATE
# scale: the paper's headline (the full-stack gap narrows with scale) at small scale. A ladder from
# tiny up, depth and width grown together as the paper's configs grow (head_dim 64, GQA 2:1, SwiGLU
# 3x, LoRA rank width/4), every rung trained to the same tokens per parameter (embeddings included:
# --tokens_per_param), the batch growing with the width (--base_batch sequences at width 128) and
# the peak lr as 128/width times --lr (our choice: the paper gives no rule, and none is tuned here).
SCALE_RUNGS = ((4, 128), (5, 256), (6, 384), (8, 512))  # (n_layer, n_embd): ~7M, 17M, 30M, 51M
SCALE_RECIPES = ("fullstack", "lora_svd", "bf16")        # queue order: slowest first
SCALE_ROW = re.compile(r"^(?P<recipe>[a-z0-9_]+)_l(?P<layers>\d+)w(?P<width>\d+)$")
STEP_MS = {("bf16", "adamw"): 10, ("nvfp4_46", "adamw"): 11, ("lora_svd", "adamw"): 22,
           ("fullstack", "adamw"): 26, ("bf16", "root"): 18, ("lora_svd", "root"): 15,
           ("fullstack", "root"): 22}
EXTRA_MS = {NS_FP32: -4, MOMENTUM_FP32: -1}
FLOP_RATE = 3e14
SAVE_EVERY = 250  # steps between a run's checkpoints (a killed run resumes from its last one)
GRID_DIRS = {"table3": ("runs/ablation", "results/ablation"),
             "split": ("runs/ablation_split", "results/ablation/split"),
             "width": ("runs/ablation_width", "results/ablation/width"),
             "scale": ("runs/scale", "results/scale")}


def die(msg):
    print(f"ablation.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: die(msg)
    add = p.add_argument
    add("--config", default=None, help="train.py --config (tiny | toy | ...)")
    add("--max_steps", type=int, default=None)
    add("--batch_size", type=int, default=None)
    add("--seq_len", type=int, default=None)
    add("--lr", default=None, help="peak lr (required to run): one value, or one per optimizer, "
        "e.g. adamw=2e-3,root=4e-3 (bf16's best lr for each, from a short sweep)")
    add("--lora_lr_scale", type=float, default=1.0, help="LoRA factors' peak lr = this x --lr "
        "(default 1: no recipe trains with more lr than bf16; the paper's 2 is train.py's default)")
    add("--warmup", type=int, default=None)
    add("--eval_every", type=int, default=None)
    add("--eval_iters", type=int, default=None)
    add("--log_every", type=int, default=None)
    add("--data", default=None, help="train.py --data (default: the offline corpus)")
    add("--train_args", default="", help='more train.py flags for every run, e.g. "--lora_lr 1e-3"')
    add("--seeds", default="0,1,2", help="comma-separated seeds")
    add("--rows", default=None, help="comma-separated row names or globs (default: the whole grid)")
    add("--grid", default="table3", choices=tuple(GRID_DIRS), help="table3: the recipes x "
        "optimizers grid; split: fullstack/Root's parts one at a time on lora_svd; width: bf16, "
        "nvfp4_46, lora_svd at --widths; scale: bf16, lora_svd, fullstack on SCALE_RUNGS "
        "(default: %(default)s)")
    add("--widths", default="64,128,256", help="--grid width: hidden sizes (n_embd)")
    add("--base_batch", type=int, default=None, help="--grid width: sequences per step at the "
        "smallest width, width w gets base_batch x (w / smallest)^2 (default 8); --grid scale: at "
        "width 128, width w gets base_batch x w / 128 (default 32)")
    add("--tokens_per_param", type=float, default=1.7, help="--grid scale: tokens a run / the "
        "rung's parameters (default: %(default)s, Table 3's tiny runs)")
    add("--runs", default=None, help="one directory per run in here (default: runs/ablation, "
        "runs/ablation_split, runs/ablation_width, runs/scale)")
    add("--results", default=None, help="summary.json, table.md, loss_curves.png (default: "
        "results/ablation[/split|/width], results/scale)")
    add("--gpus", default=None, help="GPU ids, e.g. 0,1 (default: every visible GPU; '': the CPU)")
    add("--jobs_per_gpu", type=int, default=None, help="runs side by side on one GPU (default: "
        "8 for the tiny grids, whose runs leave an H200 mostly idle (results/ablation/README.md "
        "measures it); 1 for the scale grid, whose larger rungs need the GPU to themselves)")
    add("--threads", type=int, default=None, help="torch CPU threads per run (OMP_NUM_THREADS; "
        "default: the cores / the runs side by side, so parallel runs never oversubscribe the host)")
    add("--cpu_jobs", type=int, default=1, help="runs side by side without a GPU")
    add("--shard", default=None, help="i/n: run only every n-th job from the i-th (0-based)")
    add("--timeout", type=float, default=None, help="seconds per run (killed runs start over)")
    add("--deadline", type=float, default=None, help="seconds for the whole call: no run starts or "
        "runs past it (30 s are kept for the aggregation)")
    add("--force", action="store_true", help="rerun the selected rows even if finished")
    add("--dry_run", action="store_true", help="print the queue's commands and their GPU time")
    add("--aggregate_only", action="store_true", help="run nothing; aggregate the finished runs")
    add("--merge", action="store_true", help="keep the rows of <results>/summary.json whose runs "
        "are not under --runs (a record made over several machines or calls)")
    return checked(p.parse_args(argv))


def checked(args):
    """The parsed flags, validated and normalized (one line and exit 2 on bad input)."""
    try:
        args.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        die(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 0,1,2")
    if not args.seeds:
        die("--seeds: give at least one seed")
    if args.shard is not None:
        m = re.fullmatch(r"(\d+)/(\d+)", args.shard)
        if not m or not int(m[1]) < int(m[2]):
            die(f"--shard {args.shard!r}: expected i/n with 0 <= i < n, e.g. 0/2")
        args.shard = (int(m[1]), int(m[2]))
    if args.lr is not None:  # -> {optimizer: lr}
        try:
            if "=" in args.lr:
                pairs = (part.split("=") for part in args.lr.split(","))
                args.lr = {o.strip(): float(v) for o, v in pairs}
            else:
                args.lr = dict.fromkeys(OPTIMIZERS, float(args.lr))
        except ValueError:
            die(f"--lr {args.lr!r}: expected a number or optimizer=lr pairs, "
                "e.g. adamw=2e-3,root=4e-3")
        if set(args.lr) != set(OPTIMIZERS):
            die(f"--lr: give one lr, or one for each of {', '.join(OPTIMIZERS)}")
    elif not args.aggregate_only:
        die("--lr: required to run the grid (the setup's peak lr, e.g. --lr adamw=2e-3,root=4e-3)")
    if not args.lora_lr_scale > 0:
        die(f"--lora_lr_scale {args.lora_lr_scale:g}: must be > 0")
    args.jobs_per_gpu = args.jobs_per_gpu or (1 if args.grid == "scale" else 8)
    if min(args.jobs_per_gpu, args.cpu_jobs, args.threads or 1) < 1:
        die("--jobs_per_gpu / --cpu_jobs / --threads: must be >= 1")
    try:
        args.train_args = shlex.split(args.train_args)
    except ValueError as e:
        die(f"--train_args: {e}")
    try:
        args.widths = sorted(int(w) for w in args.widths.split(",") if w.strip())
    except ValueError:
        die(f"--widths {args.widths!r}: expected comma-separated integers, e.g. 64,128,256")
    if not args.widths or any(w < 64 or w % 64 for w in args.widths):
        die(f"--widths {args.widths}: every width must be a multiple of 64 (head_dim 64)")
    args.base_batch = args.base_batch or (32 if args.grid == "scale" else 8)
    if args.base_batch < 1 or not args.tokens_per_param > 0:
        die("--base_batch, --tokens_per_param: must be > 0")
    runs, results = GRID_DIRS[args.grid]
    args.runs = os.path.abspath(args.runs or runs)
    args.results = os.path.abspath(args.results or results)
    return args


def shown(path):
    """A path as the reader of the record wants it: relative to the repository root when inside
    it."""
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel


# --------------------------------------------------------------------------------------------------
# The grid and its runs

def grid(seeds):
    """Every run of the ablation as (recipe, optimizer, seed), in queue order: seed by seed (a
    partial grid still covers every row), slowest recipes first within a seed."""
    jobs = []
    for i, seed in enumerate(seeds):
        for recipe in SLOWEST_FIRST:
            if recipe in RECIPES or (recipe == COLLAPSING and i == 0):
                jobs += [(recipe, optimizer, seed) for optimizer in OPTIMIZERS]
    return jobs


def run_name(recipe, optimizer, seed):
    return f"{recipe}_{optimizer}_s{seed}"


def selected(job, patterns):
    """--rows: a pattern names a recipe, a recipe_optimizer, a whole run name, or is a glob over run
    names."""
    recipe, optimizer, seed = job
    names = (recipe, f"{recipe}_{optimizer}", run_name(*job))
    return any(pat in names or fnmatch.fnmatchcase(names[-1], pat) for pat in patterns)


def finished(runs, name):
    if os.path.isfile(os.path.join(runs, name, "summary.json")):
        return True
    return read_json(os.path.join(runs, f"{name}.json"), {}).get("status") == "diverged"


def read_json(path, default=None):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return default


WIDTH_ROW = re.compile(r"^(?P<recipe>[a-z0-9_]+)_w(?P<width>\d+)$")


def width_shape(width, n_layer=4, vocab=50304):
    """The width grid's model at hidden size `width` (tiny's depth and vocabulary): train.py config
    overrides, and its non-embedding parameter count (block matrices and norms; no LoRA factors)."""
    n_head = width // 64
    n_kv_head = max(1, n_head // 2)
    ffn = 3 * width
    per_layer = width * 64 * (2 * n_head + 2 * n_kv_head) + 3 * width * ffn + 2 * width
    shape = dict(n_embd=width, n_head=n_head, n_kv_head=n_kv_head, ffn_hidden=ffn)
    return shape, n_layer * per_layer + width, vocab * width


def width_flags(args, recipe, width):
    """train.py flags of one width: the model's shape, the batch (base_batch x (width / smallest)^2
    sequences, split into micro-steps of <= MAX_MICRO_BATCH), LoRA rank width / 4."""
    shape, _, _ = width_shape(width)
    batch = args.base_batch * (width // args.widths[0]) ** 2
    accum = math.ceil(batch / MAX_MICRO_BATCH)
    if batch % accum:
        die(f"--base_batch {args.base_batch}: width {width}'s {batch} sequences do not split into "
            f"micro-steps of <= {MAX_MICRO_BATCH}")
    flags = {**shape, "batch_size": batch // accum, "grad_accum": accum}
    if recipe.startswith("lora"):
        flags["lora_rank"] = width // 4
    return flags


def scale_flags(args, recipe, layers, width):
    """train.py flags of one rung: the model's shape, the batch (base_batch x width / 128 sequences
    of --seq_len 256, micro-steps of <= MAX_MICRO_BATCH), the steps that reach --tokens_per_param,
    warmup 50 and eval every sixth of the steps (unless given), the lr (--lr x 128 / width, the
    LoRA factors' likewise), LoRA rank width / 4. The smallest rung trains Table 3's tiny run;
    its val loss averages --config's eval_iters batches (toy: 20, Table 3's: 8): compare gaps,
    not losses, across the two."""
    shape, non_embedding, embedding = width_shape(width, layers)
    batch = max(1, args.base_batch * width // 128)
    accum = math.ceil(batch / MAX_MICRO_BATCH)
    seq = args.seq_len or 256
    batch = accum * math.ceil(batch / accum)  # whole micro-steps
    steps = math.ceil(args.tokens_per_param * (non_embedding + embedding) / (batch * seq))
    flags = {"n_layer": layers, **shape, "batch_size": batch // accum, "grad_accum": accum,
             "seq_len": seq, "max_steps": steps, "warmup": args.warmup or 50,
             "eval_every": args.eval_every or max(1, steps // 6),
             "lr": {o: float(f"{lr * 128 / width:.4g}") for o, lr in args.lr.items()}}
    if recipe.startswith("lora") or recipe == "fullstack":
        flags["lora_rank"] = width // 4
    return flags


def row_spec(args, row, optimizer):
    """(recipe, numerics entries, flags that replace the grid's) of one row of args.grid."""
    if args.grid == "split":
        for name, recipe, opt, numerics, flags in SPLIT_ROWS + LEAVE_ONE_OUT_ROWS:
            if (name, opt) == (row, optimizer):
                return recipe, numerics, dict(flags)
        die(f"row {row}_{optimizer}: not in the split grid")
    if args.grid == "width":
        m = WIDTH_ROW.match(row)
        if not m:
            die(f"row {row}: width rows look like bf16_w128")
        return m["recipe"], (), width_flags(args, m["recipe"], int(m["width"]))
    if args.grid == "scale":
        m = SCALE_ROW.match(row)
        if not m:
            die(f"row {row}: scale rows look like bf16_l4w128")
        return m["recipe"], (), scale_flags(args, m["recipe"], int(m["layers"]), int(m["width"]))
    return row, (), {}


def jobs_of(args):
    """Every run of args.grid as (row, optimizer, seed), seed by seed (a partial grid covers every
    row), slowest rows first within a seed."""
    if args.grid == "table3":
        return grid(args.seeds)
    if args.grid == "split":
        order = sorted(SPLIT_ROWS + LEAVE_ONE_OUT_ROWS, key=lambda r: -row_ms(r[1], r[2], r[3]))
        return [(row, opt, seed) for seed in args.seeds for row, _, opt, _, _ in order]
    if args.grid == "scale":
        return [(f"{recipe}_l{n}w{w}", opt, seed) for seed in args.seeds
                for n, w in reversed(SCALE_RUNGS) for recipe in SCALE_RECIPES for opt in OPTIMIZERS]
    return [(f"{recipe}_w{w}", WIDTH_OPTIMIZER, seed) for seed in args.seeds
            for w in reversed(args.widths) for recipe in WIDTH_RECIPES]


def row_ms(recipe, optimizer, numerics=()):
    return STEP_MS.get((recipe, optimizer), 20) + sum(EXTRA_MS.get(e, 0) for e in numerics)


def gpu_seconds(args, job):
    """Estimated GPU-share seconds of one run on one H200 with ~10 runs side by side: micro-steps x
    STEP_MS plus 6 x matmul parameters x tokens at FLOP_RATE (what a tiny run's STEP_MS leaves
    out)."""
    recipe, numerics, flags = row_spec(args, *job[:2])
    steps = flags.get("max_steps", args.max_steps or 1000)
    seq = args.seq_len or 256
    width = flags.get("n_embd", 128)
    batch, accum = flags.get("batch_size", args.batch_size or 32), flags.get("grad_accum", 1)
    _, non_embedding, embedding = width_shape(width, flags.get("n_layer", 4))
    matmul = non_embedding + embedding  # the tied lm_head multiplies activations too
    tokens = steps * accum * batch * seq
    return steps * accum * row_ms(recipe, job[1], numerics) / 1000 + 6 * matmul * tokens / FLOP_RATE


def train_command(args, row, optimizer, seed):
    recipe, numerics, flags = row_spec(args, row, optimizer)
    lr = flags.get("lr", args.lr)  # {optimizer: peak lr}
    out_dir = shown(os.path.join(args.runs, run_name(row, optimizer, seed)))
    # a checkpoint every SAVE_EVERY steps: a run the deadline kills continues in the next call
    # (train.py's resume is exact: tests/test_train.py::test_resume_is_exact)
    cmd = [sys.executable, "train.py", "--recipe", recipe, "--optimizer", optimizer, "--seed",
           str(seed), "--out_dir", out_dir, "--no_progress", "--save_every", str(SAVE_EVERY)]
    for flag in TRAIN_FLAGS:
        value = flags.pop(flag) if flag in flags else getattr(args, flag)
        if value is not None:
            cmd += [f"--{flag}", str(value[optimizer] if flag == "lr" else value)]
    for flag, value in flags.items():
        cmd += [f"--{flag}", str(value)]
    for entry in numerics:
        cmd += ["--numerics", entry]
    if recipe.startswith("lora") or recipe == "fullstack":  # the recipes with a LoRA branch
        cmd += ["--lora_lr", f"{args.lora_lr_scale * lr[optimizer]:g}"]
    if not args.force and os.path.isfile(os.path.join(ROOT, out_dir, "ckpt.pt")):
        cmd.append("--resume")  # killed by an earlier call's deadline: continue from its checkpoint
    return cmd + args.train_args


def device_slots(args):
    """[(label, environment overrides)], one per parallel worker."""
    gpus = args.gpus
    if gpus is None:
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=30).stdout
            gpus = ",".join(str(i) for i, line in enumerate(out.splitlines())
                            if line.startswith("GPU"))
        except (OSError, subprocess.TimeoutExpired):
            gpus = ""
    ids = [g.strip() for g in gpus.split(",") if g.strip()]
    if not ids:  # runs side by side share the cores (2 runs x 2 threads on 2 cores: many x slower)
        per_job = max(1, (os.cpu_count() or 1) // args.cpu_jobs)
        threads = str(args.threads) if args.threads else os.environ.get("OMP_NUM_THREADS",
                                                                         str(per_job))
        return [("cpu", {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": threads})] * args.cpu_jobs
    slots = len(ids) * args.jobs_per_gpu
    threads = str(args.threads or max(1, (os.cpu_count() or 1) // slots))
    return [(f"gpu {g}", {"CUDA_VISIBLE_DEVICES": g, "OMP_NUM_THREADS": threads})
            for g in ids for _ in range(args.jobs_per_gpu)]


def hardware(env):
    gpu = env.get("CUDA_VISIBLE_DEVICES", "")
    if gpu:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader",
                                  "-i", gpu],
                                 capture_output=True, text=True, timeout=30).stdout.strip()
            return out or f"GPU {gpu}"
        except (OSError, subprocess.TimeoutExpired):
            return f"GPU {gpu}"
    return f"CPU ({os.cpu_count()} cores)"


class Broken(Exception):
    """train.py rejected the flags (exit 2), or several runs in a row failed: the rest would too."""


def run_one(args, job, label, env, stop_at):
    """One train.py run into a fresh <runs>/<name>/; returns its status (ok, diverged, timeout,
    failed)."""
    name = run_name(*job)
    out_dir, log_path, record_path = (os.path.join(args.runs, name),
                                      os.path.join(args.runs, f"{name}.log"),
                                      os.path.join(args.runs, f"{name}.json"))
    cmd = train_command(args, *job)
    if "--resume" not in cmd:
        shutil.rmtree(out_dir, ignore_errors=True)  # unfinished without a checkpoint, or --force
    limit = args.timeout
    if stop_at is not None:
        limit = min(limit or math.inf, stop_at - time.time())
    print(f"[{label}] {time.strftime('%H:%M:%S')} start {name}", flush=True)
    start, status = time.time(), None
    with open(log_path, "a" if "--resume" in cmd else "w") as log:
        log.write(shlex.join(cmd[1:]) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                                stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=None if limit in (None, math.inf) else max(1.0, limit))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            status = "timeout"
    wall = time.time() - start
    with open(log_path) as f:
        tail = f.read()[-2000:]
    if status is None:
        if rc == 0 and os.path.isfile(os.path.join(out_dir, "summary.json")):
            status = "ok"
        elif "non-finite loss" in tail:
            status = "diverged"  # train.py stops before a non-finite update: a collapse, a result
        else:
            status = "failed"
    with open(record_path, "w") as f:
        json.dump({"name": name, "status": status, "exit_code": rc, "wall_s": round(wall, 1),
                   "hardware": hardware(env), "command": shlex.join(cmd[1:]),
                   "date": time.strftime("%Y-%m-%d")}, f, indent=1)
    last = tail.strip().splitlines()[-1] if tail.strip() else ""
    print(f"[{label}] {time.strftime('%H:%M:%S')} {status} {name} ({wall:.0f} s): {last}",
          flush=True)
    if status == "failed" and rc == 2:
        raise Broken(f"{name}: train.py rejected its flags: {last}")
    return status, last


def run_grid(args, jobs):
    """Run the jobs on parallel workers (one per device slot) until done, failed flags, or the
    deadline."""
    start = time.time()
    stop_at = None if args.deadline is None else start + args.deadline - 30
    todo = queue.Queue()
    for job in jobs:
        todo.put(job)
    errors, failures = [], []  # failures: the failed runs since the last success
    walls = []  # seconds of the runs this call finished: what the next one will likely take

    def worker(label, env):
        while not errors:
            try:
                job = todo.get_nowait()
            except queue.Empty:
                return
            # under a minute says nothing; nor does a run the call's finished runs say cannot finish
            # (it would slow the runs beside it and, on a fresh machine, lose its checkpoints)
            need = max(60, statistics.median(walls) if walls else 0)
            if stop_at is not None and stop_at - time.time() < need:
                print(f"[{label}] deadline: not starting {run_name(*job)}", flush=True)
                continue
            begun = time.time()
            try:
                status, last = run_one(args, job, label, env, stop_at)
            except Broken as e:
                errors.append(str(e))
                return
            if status == "ok":
                walls.append(time.time() - begun)
            if status == "failed":
                failures.append(f"{run_name(*job)}: {last}")
                if len(failures) >= 3:
                    errors.append(f"3 runs in a row failed (see {shown(args.runs)}/<name>.log); "
                                  f"last: {failures[-1]}")
            elif status in ("ok", "diverged"):
                failures.clear()

    threads = [threading.Thread(target=worker, args=slot) for slot in device_slots(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(f"ablation: {len(jobs)} runs queued, {time.time() - start:.0f} s", flush=True)
    if errors:
        die(errors[0])


# --------------------------------------------------------------------------------------------------
# Aggregation: rows, statistics, verdicts, table, plot

def read_metrics(path):
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except OSError:
        return []


def corpus_train_tokens(data_dir):
    """Tokens in <data>/train.bin, from the shard header (data.py's format: int64 [magic, version,
    n_tokens])."""
    path = os.path.join(ROOT, data_dir, "train.bin")
    try:
        with open(path, "rb") as f:
            header = f.read(24)
        return int.from_bytes(header[16:24], "little")
    except OSError:
        return None


def window_means(values):
    """Means of every window of TAIL of the logged losses, at least 5 of them (the last one is the
    run's train loss; a single batch's loss is too noisy to call a collapse on)."""
    values = [v for v in values if v is not None]
    k = min(len(values), max(5, math.ceil(TAIL * len(values))))
    return [sum(values[i:i + k]) / k for i in range(len(values) - k + 1)]


def collect_rows(runs, train_tokens):
    """One row per finished run under `runs` (sorted by recipe, optimizer, seed)."""
    rows = []
    for path in sorted(glob.glob(os.path.join(runs, "*", ""))):
        name = os.path.basename(os.path.dirname(path))
        m = RUN_NAME.match(name)
        if not m or not finished(runs, name):
            continue
        metrics = read_metrics(os.path.join(path, "metrics.jsonl"))
        summary = read_json(os.path.join(path, "summary.json"), {})
        record = read_json(os.path.join(runs, f"{name}.json"), {})
        header = metrics[0].get("settings", {}) if metrics else {}  # a diverged run has only this
        train = [r["loss"] for r in metrics if "loss" in r]
        vals = [r["val_loss"] for r in metrics if "val_loss" in r]
        steps = summary.get("steps", max((r["step"] for r in metrics), default=0))
        tokens = summary.get("tokens", max((r.get("tokens", 0) for r in metrics), default=0))
        diverged = not summary
        windows = window_means(train)
        val_loss = None if diverged else summary.get("final_val_loss", vals[-1] if vals else None)
        params = summary.get("params")
        rows.append({
            "recipe": m["recipe"], "optimizer": m["optimizer"], "seed": int(m["seed"]),
            "val_loss": val_loss, "train_loss": None if diverged or not windows else windows[-1],
            "tokens": tokens, "params": params, "steps": steps,
            "config": summary.get("config"), "status": "diverged" if diverged else "ok",
            "best_train_loss": min(windows, default=None),  # windowed like train_loss
            "tokens_per_param": tokens / params if params else None,
            "epochs": summary.get("epochs", tokens / train_tokens if train_tokens else None),
            "tokens_per_s": summary.get("tokens_per_s"),
            "wall_s": record.get("wall_s"), "hardware": record.get("hardware"),
            "command": record.get("command"), "date": record.get("date"),
            "device": header.get("device"), "numerics_id": header.get("numerics_id"),
            "commit": header.get("commit"),
            # the logged losses travel with the row: a record made over several GPU calls is
            # aggregated from rows whose run folders stayed on another machine
            "curve": {"train": [[r["step"], r["loss"]] for r in metrics if "loss" in r],
                      "val": [[r["step"], r["val_loss"]] for r in metrics if "val_loss" in r]},
        })
    return sorted(rows, key=row_order)


def row_order(row):
    """A record's row order: recipes as SLOWEST_FIRST lists them (fastest first), then optimizer,
    seed."""
    rank = SLOWEST_FIRST[::-1].index(row["recipe"]) if row["recipe"] in SLOWEST_FIRST else 99
    return rank, row["recipe"], row["optimizer"], row["seed"]


def with_recorded(rows, path):
    """rows plus the rows of the record at `path` (an earlier call's summary.json) whose runs are
    not among them: each run is recorded once, from its own folder when this machine has it."""
    names = {run_name(r["recipe"], r["optimizer"], r["seed"]) for r in rows}
    kept = [{**r, "status": "diverged" if r["status"] == "diverged" else "ok"}  # re-judged below
            for r in read_json(path, [])
            if run_name(r["recipe"], r["optimizer"], r["seed"]) not in names]
    rows = [{"curve": None, **r} for r in rows + kept]
    return sorted(rows, key=row_order)


def finite(x):
    return x is not None and math.isfinite(x)


def stats(values):
    """(mean, sample std, n) of the finite values; std is None below 2 values."""
    values = [v for v in values if finite(v)]
    if not values:
        return None, None, 0
    std = statistics.stdev(values) if len(values) > 1 else None
    return statistics.fmean(values), std, len(values)


def mark_collapsed(rows):
    """A run that finished collapsed if its val loss is non-finite, its final train loss rose
    COLLAPSE_NATS above its own best (both over TAIL-long windows), or its final val loss is
    COLLAPSE_NATS above the mean of bf16's with the same optimizer. (A run train.py stopped on a
    non-finite loss keeps its status "diverged".)"""
    for row in rows:
        if row["status"] == "diverged":
            continue
        base, _, _ = stats([r["val_loss"] for r in rows
                            if r["recipe"] == "bf16" and r["optimizer"] == row["optimizer"]])
        val, train = row["val_loss"], row["train_loss"]
        if ((val is not None and not math.isfinite(val))
                or (finite(train) and train > row["best_train_loss"] + COLLAPSE_NATS)
                or (finite(val) and base is not None and val > base + COLLAPSE_NATS)):
            row["status"] = "collapsed"
    return rows


def val_by_seed(rows, recipe, optimizer):
    """{seed: final val loss} of the row's runs with a finite one (a collapsed run's counts: it is
    the result)."""
    return {r["seed"]: r["val_loss"] for r in rows
            if r["recipe"] == recipe and r["optimizer"] == optimizer
            and finite(r["val_loss"])}


def gaps(rows, recipe, optimizer):
    """% gap to bf16 per seed, paired by seed (same seed = same init and batches in every
    recipe)."""
    base, own = val_by_seed(rows, "bf16", optimizer), val_by_seed(rows, recipe, optimizer)
    return {s: 100 * (own[s] - base[s]) / base[s] for s in sorted(own) if s in base}


def difference(a, b):
    """(mean, standard error, n) of a[s] - b[s] over the seeds both have; SE is None below 2
    seeds."""
    d = [a[s] - b[s] for s in a if s in b]
    mean, std, n = stats(d)
    return mean, (std / math.sqrt(n) if std is not None else None), n


def ordering(a, b):
    """Is a > b? confirmed / not confirmed (the reverse, resolved) / not resolvable: the paired mean
    difference against SIGNIFICANT_SES standard errors."""
    mean, se, n = difference(a, b)
    if mean is None or se is None:
        return "not resolvable at this scale", mean, se, n
    if mean > SIGNIFICANT_SES * se:
        return "confirmed", mean, se, n
    if mean < -SIGNIFICANT_SES * se:
        return "not confirmed", mean, se, n
    return "not resolvable at this scale", mean, se, n


def fmt(x, digits=3, sign=False, g=False):
    """A number for the table: fixed digits (g: significant digits), 'n/a' when missing."""
    if x is None:
        return "n/a"
    return f"{x:.{digits}g}" if g else f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def verdicts(rows):
    """[(claim, optimizer, verdict, numbers)] for the paper's claims, per optimizer, from the
    rows."""
    out = []
    for opt in OPTIMIZERS:
        base = val_by_seed(rows, "bf16", opt)
        b_mean, b_std, b_n = stats(base.values())
        nv = val_by_seed(rows, "nvfp4", opt)
        n_mean, _, _ = stats(nv.values())
        # the issue's resolvability criterion: |bf16 - nvfp4| >= 3x bf16's seed std
        if b_mean is None or n_mean is None or b_std is None:
            verdict = "not resolvable at this scale"
            numbers = f"bf16 n={b_n}, nvfp4 n={len(nv)}: need >= 2 bf16 seeds"
        else:
            gap = n_mean - b_mean
            verdict = "confirmed" if abs(gap) >= RESOLVE_STDS * b_std else "not confirmed"
            numbers = (f"nvfp4 - bf16 = {gap:+.4f} nat, bf16 seed std {b_std:.4f} "
                       f"(ratio {abs(gap) / b_std if b_std else math.inf:.1f}, "
                       f"need >= {RESOLVE_STDS:g})")
        out.append(("gap resolvable: nvfp4 − bf16 ≥ 3x bf16 seed std", opt, verdict, numbers))

        # nvfp4 gap > nvfp4_46 gap > lora_svd gap (Table 3's linear-only ordering), paired by seed
        g = {r: gaps(rows, r, opt) for r in ("nvfp4", "nvfp4_46", "lora_svd", "fullstack")}
        links = [ordering(g["nvfp4"], g["nvfp4_46"]), ordering(g["nvfp4_46"], g["lora_svd"])]
        verdict = ("confirmed" if all(v == "confirmed" for v, *_ in links) else
                   "not confirmed" if any(v == "not confirmed" for v, *_ in links) else
                   "not resolvable at this scale")
        pairs = (("nvfp4", "nvfp4_46"), ("nvfp4_46", "lora_svd"))
        numbers = "; ".join(f"{a} - {b} gap = {fmt(m, 2, True)} +- {fmt(se, 2)} pts (n={n})"
                            for (a, b), (_, m, se, n) in zip(pairs, links))
        out.append(("nvfp4 gap > nvfp4_46 gap > lora_svd gap", opt, verdict, numbers))

        # fullstack close to lora_svd: the gap difference within CLOSE_POINTS, measured that
        # precisely
        mean, se, n = difference(g["fullstack"], g["lora_svd"])
        if mean is None or se is None:
            verdict = "not resolvable at this scale"
        elif abs(mean) + SIGNIFICANT_SES * se <= CLOSE_POINTS:
            verdict = "confirmed"
        elif abs(mean) - SIGNIFICANT_SES * se > CLOSE_POINTS:
            verdict = "not confirmed"
        else:
            verdict = "not resolvable at this scale"
        numbers = (f"fullstack - lora_svd gap = {fmt(mean, 2, True)} +- {fmt(se, 2)} pts (n={n}), "
                   f"close = within {CLOSE_POINTS:g} pt")
        out.append((f"fullstack close to lora_svd", opt, verdict, numbers))

        # naive_fp4 collapses (App. 13)
        naive = [r for r in rows if r["recipe"] == COLLAPSING and r["optimizer"] == opt]
        if not naive:
            verdict, numbers = "not resolvable at this scale", "no naive_fp4 run"
        else:
            collapsed = [r for r in naive if r["status"] in ("collapsed", "diverged")]
            verdict = "confirmed" if len(collapsed) == len(naive) else "not confirmed"
            numbers = ", ".join(f"s{r['seed']}: {r['status']}, val {fmt(r['val_loss'])}, "
                                f"best train {fmt(r['best_train_loss'])}" for r in naive)
        out.append(("naive_fp4 collapses", opt, verdict, numbers))
    return out


def grid_time(rows, seeds=3):
    """(startup, per step) seconds of the whole grid on one worker, summed over its runs, from the
    measured runs: a run takes startup + steps x seconds per step (train.py's tokens/s leaves out
    its first steps and the evals; the startup, the rest of the run's wall time, holds imports,
    kernel compilation and evals). None if a row of the grid has no measured run."""
    startup, per_step = 0.0, 0.0
    for recipe, optimizer, _ in grid(range(seeds)):
        timed = [r for r in rows if r["recipe"] == recipe and r["optimizer"] == optimizer
                 and r["status"] != "diverged" and finite(r["tokens_per_s"]) and r["wall_s"]]
        if not timed:
            return None
        step = statistics.fmean(r["tokens"] / r["steps"] / r["tokens_per_s"] for r in timed)
        startup += statistics.fmean(max(0.0, r["wall_s"] - r["steps"] * step) for r in timed)
        per_step += step
    return startup, per_step


def table(rows):
    """Markdown: one line per (recipe, optimizer)."""
    lines = ["| recipe | optimizer | seeds | val loss (mean ± std) | gap to bf16 | "
             "per-seed gap ± std | train loss | status |", "|---|---|---|---|---|---|---|---|"]
    for opt in OPTIMIZERS:
        b_mean, _, _ = stats(val_by_seed(rows, "bf16", opt).values())
        for recipe in RECIPES + (COLLAPSING,):
            mine = [r for r in rows if r["recipe"] == recipe and r["optimizer"] == opt]
            if not mine:
                continue
            mean, std, n = stats(val_by_seed(rows, recipe, opt).values())
            g_mean, g_std, _ = stats(gaps(rows, recipe, opt).values())
            t_mean, _, _ = stats(r["train_loss"] for r in mine)
            gap = None if mean is None or b_mean is None else 100 * (mean - b_mean) / b_mean
            status = ", ".join(sorted({r["status"] for r in mine}))
            base = recipe == "bf16"
            per_seed = "–" if base else f"{fmt(g_mean, 2, True)} ± {fmt(g_std, 2)}%"
            lines.append(f"| `{recipe}` | {opt} | {len(mine)} | {fmt(mean, 4)} ± {fmt(std, 4)} | "
                         f"{'–' if base else fmt(gap, 2, True) + '%'} | {per_seed} | "
                         f"{fmt(t_mean, 4)} | {status} |")
    return "\n".join(lines)


def plot(rows, path, panels=None):
    """Train loss against tokens, mean over seeds with a ±1 std band, val loss dots; one panel per
    entry of panels [(title, [(row, optimizer), ...])], by default one per optimizer with every
    recipe."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    if panels is None:
        panels = [(opt, [(r, opt) for r in RECIPES + (COLLAPSING,)]) for opt in OPTIMIZERS]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 5), sharey=True,
                             squeeze=False)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    top, bottom = -math.inf, math.inf
    for ax, (title, members) in zip(axes[0], panels):
        for i, (recipe, opt) in enumerate(members):
            mine = [r for r in rows if r["recipe"] == recipe and r["optimizer"] == opt]
            curves = [(dict(map(tuple, r["curve"]["train"])), dict(map(tuple, r["curve"]["val"])))
                      for r in mine if r.get("curve")]
            if not curves:
                continue
            color = palette[i % len(palette)]
            steps = sorted(set.intersection(*(set(c[0]) for c in curves)))
            # moving mean over <= 5 logged steps: one batch's loss hides the bands
            k = max(1, min(5, len(steps) // 6))
            mean, std = [], []
            for j in range(len(steps)):
                window = steps[max(0, j - k + 1): j + 1]
                per_seed = [statistics.fmean(c[0][s] for s in window) for c in curves]
                mean.append(statistics.fmean(per_seed))
                std.append(statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0)
            tokens_per_step = mine[0]["tokens"] / max(1, mine[0]["steps"])
            x = [s * tokens_per_step / 1e6 for s in steps]
            broken = sum(r["status"] != "ok" for r in mine)
            label = f"{recipe} (n={len(curves)}{f', {broken} collapsed' if broken else ''})"
            ax.plot(x, mean, color=color, lw=1.2, label=label)
            ax.fill_between(x, [m - s for m, s in zip(mean, std)],
                            [m + s for m, s in zip(mean, std)],
                            color=color, alpha=0.2, lw=0)
            val_steps = sorted(set.intersection(*(set(c[1]) for c in curves)))
            val_mean = [statistics.fmean(c[1][s] for c in curves) for s in val_steps]
            ax.plot([s * tokens_per_step / 1e6 for s in val_steps], val_mean, "o", color=color,
                    ms=3)
            finite_mean = [m for m in mean + val_mean if math.isfinite(m)]
            if recipe != COLLAPSING and finite_mean:
                bottom = min(bottom, min(finite_mean))
                top = max(top, mean[min(len(mean) - 1, len(mean) // 5)])  # from 20% of the run on
        ax.set_title(f"{title}: train loss (lines, ±1 std over seeds), val loss (dots)",
                     fontsize=9)
        ax.set_xlabel("tokens (M)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("loss")
    if math.isfinite(top) and math.isfinite(bottom) and top > bottom:
        # collapsed runs leave the top of the frame
        axes[0][0].set_ylim(bottom - 0.05 * (top - bottom), top)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def provenance(rows):
    """The sentence naming the code that made the rows."""
    commits = ", ".join(sorted({r["commit"] or "unknown" for r in rows}))
    return f"Commit(s): {commits}; summary.json gives each run's numerics_id."


def aggregate(args):
    runs, results = args.runs, args.results
    train_tokens = corpus_train_tokens(args.data or "data_cache/default")
    rows = collect_rows(runs, train_tokens)
    if args.merge:
        rows = with_recorded(rows, os.path.join(results, "summary.json"))
    rows = mark_collapsed(rows)
    if not rows:
        print(f"ablation: no finished runs in {shown(args.runs)}; nothing to aggregate", flush=True)
        return None
    setups = {(r["config"], r["steps"], r["tokens"]) for r in rows if r["status"] != "diverged"}
    if len(setups) > 1:
        die(f"--runs {shown(args.runs)}: finished runs mix setups (config, steps, tokens) "
            f"{sorted(setups, key=str)}; use one --runs directory per setup")
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "summary.json"), "w") as f:
        json.dump([{k: r[k] for k in ROW_FIELDS} for r in rows], f, indent=1)
    ok = [r for r in rows if r["status"] != "diverged"]  # the runs with a summary.json
    first = ok[0] if ok else {"config": rows[0]["config"], "steps": "n/a", "tokens": 0, "params": 0,
                              "tokens_per_param": None, "epochs": None}
    hardware = ", ".join(sorted({r["hardware"] for r in rows if r["hardware"]})) or "unknown"
    dates = sorted({r["date"] for r in rows if r["date"]})
    gpu_s = sum(r["wall_s"] or 0 for r in rows)
    lines = [
        "# Seeded ablation (paper Table 3 rows, App. 13 collapse)", "",
        f"Written by `python tools/ablation.py` from {len(rows)} runs in `{shown(args.runs)}/`. "
        f"Config `{first['config']}`, {first['steps']} steps, {first['tokens']:,} tokens a run, "
        f"{fmt(first['params'] / 1e6, 2)}M parameters: "
        f"{fmt(first['tokens_per_param'], 3, g=True)} tokens per parameter, "
        f"{fmt(first['epochs'], 3, g=True)} epochs of the "
        f"{fmt(train_tokens and train_tokens / 1e6, 2)}M-token train split. "
        f"Hardware: {hardware}. Dates: {', '.join(dates) or 'unknown'}. Run time, summed over "
        f"runs: {gpu_s / 60:.1f} min. {provenance(rows)}", "",
        f"Val loss: the last evaluation of each run. Train loss: mean over the last {TAIL:.0%} of "
        "logged steps (at least 5). "
        "Gap: 100·(mean − mean bf16)/mean bf16 with the same optimizer; per-seed gap: the same "
        "per seed (a seed fixes the init and the batches in every recipe), mean ± std over seeds. "
        f"Status `diverged`: train.py stopped on a non-finite loss; `collapsed`: the loss rose "
        f"{COLLAPSE_NATS:g} nat above its best or above bf16's.",
        "", table(rows), "", "![loss curves](loss_curves.png)", "", "## Verdicts", "",
        f"Orderings compare per-seed gaps paired by seed: resolved when the mean difference "
        f"exceeds {SIGNIFICANT_SES:g} standard errors. \"Close\": the gap difference plus "
        f"{SIGNIFICANT_SES:g} SE within {CLOSE_POINTS:g} point.", "",
        "| claim | optimizer | verdict | numbers |", "|---|---|---|---|"]
    lines += [f"| {claim} | {opt} | **{verdict}** | {numbers} |"
              for claim, opt, verdict, numbers in verdicts(rows)]
    commands = sorted({r["command"] for r in rows if r["command"]})
    timing = grid_time(rows)
    if timing:
        lines += ["", f"Time: the full grid ({len(grid(range(3)))} runs) takes about "
                  f"{timing[0]:.0f} s + {timing[1]:.2f} s x steps on one worker at this config "
                  f"and batch (here {(timing[0] + timing[1] * first['steps']) / 60:.1f} min), "
                  "divided by the parallel workers."]
    lines += ["", "Commands (one per run):", "", "```"] + commands + ["```", ""]
    with open(os.path.join(results, "table.md"), "w") as f:
        f.write("\n".join(lines))
    plot(rows, os.path.join(results, "loss_curves.png"))
    print(f"ablation: {len(rows)} runs -> {shown(args.results)}/summary.json, table.md, "
          "loss_curves.png", flush=True)
    return rows


def paired(a, b):
    """{seed: 100 (a - b) / b} over the seeds both have (val losses)."""
    return {s: 100 * (a[s] - b[s]) / b[s] for s in a if s in b}


def verdict_of_difference(d, what):
    """'what' (a paired % difference > 0 by seed) against SIGNIFICANT_SES standard errors."""
    mean, std, n = stats(d.values())
    if mean is None or std is None:
        return "not resolvable at this scale", mean, None, n
    se = std / math.sqrt(n)
    if mean > SIGNIFICANT_SES * se:
        return what, mean, se, n
    if mean < -SIGNIFICANT_SES * se:
        return f"not {what} (the reverse)", mean, se, n
    return "within noise", mean, se, n


def split_costs(rows):
    """{row: {seed: % over lora_svd/Root}} of each Root row of the split (paired by seed), and
    "interaction": fullstack's cost minus the sum of its parts', over the seeds that have them all."""
    base = val_by_seed(rows, "lora_svd", "root")
    costs = {row: paired(val_by_seed(rows, row, "root"), base)
             for row, _, opt, _, _ in SPLIT_ROWS[1:] if opt == "root"}
    parts = [d for row, d in costs.items() if row != "fullstack"]
    seeds = set(costs["fullstack"]).intersection(*parts)
    costs["interaction"] = {s: costs["fullstack"][s] - sum(p[s] for p in parts) for s in seeds}
    return costs


def split_tables(rows):
    """The split grid: every row against its optimizer's reference row (lora_svd), paired by
    seed, and item 3's claim (fullstack/Root with the fixed momentum within 2 SE of lora_svd)."""
    lines = ["| row | optimizer | numerics | seeds | val loss (mean ± std) | "
             "vs lora_svd (paired) | seeds worse | verdict |", "|---|---|---|---|---|---|---|---|"]
    refs = {}
    for row, recipe, opt, numerics, flags in SPLIT_ROWS:
        refs.setdefault(opt, row)
        own, base = val_by_seed(rows, row, opt), val_by_seed(rows, refs[opt], opt)
        if not own:
            continue
        mean, std, n = stats(own.values())
        d = paired(own, base)
        if row == refs[opt]:
            cells = ("–", "–", "reference")
        else:
            verdict, m, se, k = verdict_of_difference(d, "costs")
            worse = sum(v > 0 for v in d.values())
            cells = (f"{fmt(m, 2, True)} ± {fmt(se, 2)}% (n={k})", f"{worse}/{k}", verdict)
        entries = ", ".join([f"`{e}`" for e in numerics]
                            + [f"`--{k} {v}`" for k, v in flags.items()]) or recipe
        lines.append(f"| `{row}` | {opt} | {entries} | {n} | {fmt(mean, 4)} ± {fmt(std, 4)} | "
                     + " | ".join(cells) + " |")
    costs = split_costs(rows)
    lines += ["", "| claim | verdict | numbers |", "|---|---|---|"]
    for claim, d in ((f"`fullstack`/Root within {SIGNIFICANT_SES:g} SE of `lora_svd`/Root",
                      costs["fullstack"]),
                     ("interaction: `fullstack` - `lora_svd` minus the parts' costs, within "
                      f"{SIGNIFICANT_SES:g} SE of 0", costs["interaction"])):
        mean, std, n = stats(d.values())
        se = None if std is None else std / math.sqrt(n)
        if se is None:
            verdict = "not resolvable at this scale"
        else:
            verdict = "confirmed" if abs(mean) <= SIGNIFICANT_SES * se else "not confirmed"
        lines.append(f"| {claim} (paired by seed) | **{verdict}** | {fmt(mean, 2, True)} ± "
                     f"{fmt(se, 2)}% (n={n}) |")
    return lines + leave_one_out_table(rows)


def leave_one_out_table(rows):
    """LEAVE_ONE_OUT_ROWS against fullstack/Root, paired by seed: each part's cost with the others
    present, 100 (fullstack - row) / row ([] before any of them has run)."""
    full = val_by_seed(rows, "fullstack", "root")
    lines = []
    for row, recipe, opt, numerics, flags in LEAVE_ONE_OUT_ROWS:
        own = val_by_seed(rows, row, opt)
        if not own:
            continue
        verdict, m, se, n = verdict_of_difference(paired(full, own), "costs")
        entries = ", ".join([f"`{e}`" for e in numerics]
                            + [f"`--{k} {v}`" for k, v in flags.items()])
        lines.append(f"| `{row}` | {entries} | {n} | {fmt(m, 2, True)} ± {fmt(se, 2)}% | "
                     f"{verdict} |")
    if not lines:
        return []
    return ["", "Leave one out: `fullstack`/Root with one part back in high precision; the part's "
            "cost with the others present is 100 (fullstack - row) / row, paired by seed.", "",
            "| row | numerics | seeds | cost of the part | verdict |", "|---|---|---|---|---|"
            ] + lines


def same_run(a, b):
    """Do two train.py commands (argument lists) train the same numbers? Equal but for the flags
    that change no bit (SAME_RUN_FLAGS: --cuda_graphs is the eager run, tests/test_graphs.py)."""
    def kept(cmd):
        out, skip = [], 0
        for x in cmd:
            if skip:
                skip -= 1
            elif x in SAME_RUN_FLAGS:
                skip = SAME_RUN_FLAGS[x]
            else:
                out.append(x)
        return out
    return kept(a) == kept(b)


def table3_rows(args, rows):
    """The split rows that are Table 3's runs (results/ablation/summary.json: lora_svd and
    fullstack as they are, the same command but for SAME_RUN_FLAGS), where `rows` lacks them."""
    try:
        with open(os.path.join(ROOT, "results", "ablation", "summary.json")) as f:
            record = json.load(f)
    except OSError:
        return []
    have = {(r["recipe"], r["optimizer"], r["seed"]) for r in rows}
    names = {(row, opt) for row, recipe, opt, numerics, flags in SPLIT_ROWS
             if row == recipe and not numerics and not flags}
    return [r for r in record if (r["recipe"], r["optimizer"]) in names
            and (r["recipe"], r["optimizer"], r["seed"]) not in have and r["seed"] in args.seeds
            and same_run(shlex.split(r["command"]),
                         train_command(args, r["recipe"], r["optimizer"], r["seed"])[1:])]


def slope(xs, ys):
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def width_gaps(rows, widths):
    """({seed: {width: (nvfp4_46 gap, lora_svd gap)}} for seeds with every width, table lines):
    the gaps to bf16 at the same width, paired by seed."""
    lines = ["| width | non-embedding params | tokens a run | tokens / non-emb param | "
             "bf16 val loss | nvfp4_46 gap | lora_svd gap | LoRA-SVD's share of the gap |",
             "|---|---|---|---|---|---|---|---|"]
    per_seed = {}
    for w in widths:
        base = val_by_seed(rows, f"bf16_w{w}", WIDTH_OPTIMIZER)
        g46 = paired(val_by_seed(rows, f"nvfp4_46_w{w}", WIDTH_OPTIMIZER), base)
        glora = paired(val_by_seed(rows, f"lora_svd_w{w}", WIDTH_OPTIMIZER), base)
        for s in g46:
            if s in glora:
                per_seed.setdefault(s, {})[w] = (g46[s], glora[s])
        mine = [r for r in rows if r["recipe"] == f"bf16_w{w}"]
        tokens = mine[0]["tokens"] if mine else None
        _, non_embedding, _ = width_shape(w)
        (b, bs, _), (m46, s46, _), (ml, sl, _) = (stats(base.values()), stats(g46.values()),
                                                  stats(glora.values()))
        share = None if not m46 or ml is None else 100 * (m46 - ml) / m46
        lines.append(f"| {w} | {non_embedding / 1e6:.2f}M | "
                     f"{fmt(tokens and tokens / 1e6, 3, g=True)}M | "
                     f"{fmt(tokens and tokens / non_embedding, 3, g=True)} | "
                     f"{fmt(b, 4)} ± {fmt(bs, 4)} | {fmt(m46, 2, True)} ± {fmt(s46, 2)}% | "
                     f"{fmt(ml, 2, True)} ± {fmt(sl, 2)}% | {fmt(share, 0)}% |")
    return {s: d for s, d in per_seed.items() if len(d) == len(widths)}, lines


def width_tables(rows, widths):
    """The width grid: per width the gaps to bf16 and LoRA-SVD's share of nvfp4_46's gap;
    verdicts on the per-seed slopes against log2(width)."""
    per_seed, lines = width_gaps(rows, widths)
    logs = [math.log2(w) for w in widths]
    lines += ["", "Slopes per doubling of the width, per seed (mean ± SE over seeds):", "",
              "| claim | verdict | numbers |", "|---|---|---|"]
    claims = (("the nvfp4_46 gap grows with width", lambda g46, gl: g46),
              ("LoRA-SVD's reduction of it (nvfp4_46 gap − lora_svd gap) grows with width",
               lambda g46, gl: g46 - gl))
    for claim, value in claims:
        slopes = {s: slope(logs, [value(*d[w]) for w in widths]) for s, d in per_seed.items()}
        verdict, mean, se, n = verdict_of_difference(slopes, "confirmed")
        verdict = {"confirmed": "confirmed", "within noise": "not resolvable at this scale"}.get(
            verdict, "not confirmed" if "reverse" in verdict else verdict)
        lines.append(f"| {claim} | **{verdict}** | {fmt(mean, 2, True)} ± {fmt(se, 2)} points "
                     f"per doubling (n={n}) |")
    return lines


def scale_params(layers, width):
    _, non_embedding, embedding = width_shape(width, layers)
    return non_embedding + embedding


def scale_gaps(rows):
    """{(recipe, optimizer): {params: {seed: % gap to bf16 at that rung}}}, paired by seed."""
    out = {}
    for n, w in SCALE_RUNGS:
        for opt in OPTIMIZERS:
            base = val_by_seed(rows, f"bf16_l{n}w{w}", opt)
            for recipe in SCALE_RECIPES[:-1]:
                gap = paired(val_by_seed(rows, f"{recipe}_l{n}w{w}", opt), base)
                if gap:
                    out.setdefault((recipe, opt), {})[scale_params(n, w)] = gap
    return out


def scale_tables(rows, target=1.03e9):
    """The scale grid: each FP4 recipe's gap to bf16 per rung (mean ± SE over seeds), its slope per
    doubling of the parameters (per seed, over the seeds with every rung), whether it narrows, and
    the line carried to `target` parameters (the 1b config), marked as an extrapolation."""
    lines = ["| recipe | optimizer | " + " | ".join(
        f"{scale_params(n, w) / 1e6:.1f}M ({n}x{w})" for n, w in SCALE_RUNGS) + " |",
        "|---|---|" + "---|" * len(SCALE_RUNGS)]
    # the offline corpus is ~8M tokens: a fixed tokens-per-parameter ratio repeats it more often
    # at each rung, which the comparison shares across recipes but a reader must see
    epochs = [next((r["epochs"] for r in rows if r["recipe"] == f"bf16_l{n}w{w}"), None)
              for n, w in SCALE_RUNGS]
    lines.append("| epochs of the corpus | | " + " | ".join(fmt(e, 2) for e in epochs) + " |")
    claims = []
    for (recipe, opt), by_params in sorted(scale_gaps(rows).items()):
        cells = []
        for n, w in SCALE_RUNGS:
            mean, std, k = stats(by_params.get(scale_params(n, w), {}).values())
            se = None if std is None else std / math.sqrt(k)
            cells.append(f"{fmt(mean, 2, True)} ± {fmt(se, 2)}% (n={k})" if mean is not None
                         else "–")
        lines.append(f"| `{recipe}` | {opt} | " + " | ".join(cells) + " |")
        sizes = sorted(by_params)
        seeds = set.intersection(*(set(by_params[p]) for p in sizes))
        if len(sizes) < 2:
            continue
        logs = [math.log2(p) for p in sizes]
        slopes = {s: -slope(logs, [by_params[p][s] for p in sizes]) for s in seeds}
        verdict, m, se, k = verdict_of_difference(slopes, "narrows")
        last = stats(by_params[sizes[-1]].values())[0]
        doublings = math.log2(target / sizes[-1])
        at_target = None if m is None else last - m * doublings
        change = None if m is None else -m  # the gap's change per doubling
        claims.append(f"| `{recipe}` − `bf16`, {opt} | **{verdict}** | {fmt(change, 2, True)} ± "
                      f"{fmt(se, 2)} points per doubling (n={k}); "
                      f"extrapolated to {target / 1e9:.2g}B parameters: {fmt(at_target, 2, True)}% "
                      f"({doublings:.1f} doublings past the data: an extrapolation) |")
    if not claims:  # a slope needs two rungs with the same seeds
        return lines + ["", "One rung so far: no slope against parameters yet."]
    return lines + ["", "| gap | does it narrow with parameters? | slope; the 1b extrapolation |",
                    "|---|---|---|"] + claims


def plot_scale(rows, path):
    """The gap to bf16 (mean ± SE over seeds) against parameters, one line per recipe and
    optimizer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for (recipe, opt), by_params in sorted(scale_gaps(rows).items()):
        sizes = sorted(by_params)
        means = [stats(by_params[p].values()) for p in sizes]
        err = [0 if sd is None else sd / math.sqrt(k) for _, sd, k in means]
        ax.errorbar(sizes, [m for m, _, _ in means], yerr=err, marker="o", capsize=3,
                    label=f"{recipe} / {opt}")
    ax.set_xscale("log")
    ladder = [scale_params(n, w) for n, w in SCALE_RUNGS]  # the whole ladder, rungs not yet run too
    ax.set_xlim(min(ladder) / 1.3, max(ladder) * 1.3)
    ax.axhline(0, color="gray", lw=0.5)
    ax.set_xlabel("parameters")
    ax.set_ylabel("val loss gap to bf16 (%)")
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def aggregate_grid(args):
    """table.md, summary.json and loss_curves.png of the split, width or scale grid."""
    train_tokens = corpus_train_tokens(args.data or "data_cache/default")
    rows = mark_collapsed(collect_rows(args.runs, train_tokens))
    if args.grid == "split":
        rows = sorted(rows + table3_rows(args, rows),
                      key=lambda r: (r["recipe"], r["optimizer"], r["seed"]))
    if not rows:
        print(f"ablation: no finished runs in {shown(args.runs)}; nothing to aggregate", flush=True)
        return None
    os.makedirs(args.results, exist_ok=True)
    with open(os.path.join(args.results, "summary.json"), "w") as f:
        json.dump([{("row" if k == "recipe" else k): r[k] for k in ROW_FIELDS} for r in rows], f,
                  indent=1)
    hardware = ", ".join(sorted({r["hardware"] for r in rows if r["hardware"]})) or "unknown"
    dates = ", ".join(sorted({r["date"] for r in rows if r["date"]})) or "unknown"
    run_min = sum(r["wall_s"] or 0 for r in rows) / 60
    if args.grid == "split":
        title, body = "Split of fullstack/Root: its parts one at a time on lora_svd", \
            split_tables(rows)
        panels = [(opt, [(row, o) for row, _, o, _, _ in SPLIT_ROWS + LEAVE_ONE_OUT_ROWS
                         if o == opt]) for opt in OPTIMIZERS]
    elif args.grid == "scale":
        title, body = "The full-stack gap against model size", scale_tables(rows) + [
            "", "![gap against parameters](gap_vs_params.png)"]
        panels = [(f"{n}x{w}, {opt}", [(f"{r}_l{n}w{w}", opt) for r in SCALE_RECIPES])
                  for n, w in SCALE_RUNGS for opt in OPTIMIZERS]
        plot_scale(rows, os.path.join(args.results, "gap_vs_params.png"))
    else:
        title, body = "Width scaling (App. 7's claim in training)", width_tables(rows, args.widths)
        panels = [(f"width {w}, {WIDTH_OPTIMIZER}",
                   [(f"{r}_w{w}", WIDTH_OPTIMIZER) for r in WIDTH_RECIPES]) for w in args.widths]
    lines = [f"# {title}", "",
             f"Written by `python tools/ablation.py --grid {args.grid}` from {len(rows)} runs in "
             f"`{shown(args.runs)}/`. Hardware: {hardware}. Dates: {dates}. Run time, summed over "
             f"runs: {run_min:.1f} min. {provenance(rows)} Differences are paired by seed (a seed "
             "fixes the init and the batches); a difference is resolved when its mean exceeds "
             f"{SIGNIFICANT_SES:g} standard errors.", ""]
    lines += body + ["", "![loss curves](loss_curves.png)", "", "Commands (one per run):", "",
                     "```"]
    lines += sorted({r["command"] for r in rows if r["command"]}) + ["```", ""]
    with open(os.path.join(args.results, "table.md"), "w") as f:
        f.write("\n".join(lines))
    plot(rows, os.path.join(args.results, "loss_curves.png"), panels)
    print(f"ablation: {len(rows)} runs -> {shown(args.results)}/summary.json, table.md, "
          "loss_curves.png", flush=True)
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.grid == "width" and args.batch_size is not None:
        die("--batch_size: the width grid sets each width's batch (--base_batch at the smallest "
            "width)")
    if not args.aggregate_only:
        jobs = jobs_of(args)
        if args.rows:
            patterns = [p.strip() for p in args.rows.split(",") if p.strip()]
            jobs = [j for j in jobs if selected(j, patterns)]
            if not jobs:
                die(f"--rows {args.rows!r}: matches no run of the grid "
                    "(names look like nvfp4_root_s1)")
        if args.shard:
            jobs = jobs[args.shard[0]::args.shard[1]]
        runs = args.runs
        reused = set()  # the split's runs that Table 3 has made (table3_rows)
        if args.grid == "split" and not args.force:
            reused = {(r["recipe"], r["optimizer"], r["seed"]) for r in table3_rows(args, [])}
        todo = [j for j in jobs if args.force or not (finished(runs, run_name(*j)) or j in reused)]
        print(f"ablation: {len(jobs)} runs selected, {len(jobs) - len(todo)} finished earlier "
              "(skipped)" + (f", {len(reused & set(jobs))} of them in Table 3's record"
                             if reused & set(jobs) else ""), flush=True)
        if args.dry_run:
            for job in todo:
                print(shlex.join(train_command(args, *job)[1:]))
            cost = sum(gpu_seconds(args, job) for job in todo)
            print(f"ablation: estimated {cost / 60:.1f} min of one H200 for these {len(todo)} runs "
                  "side by side (GPU share from the 2026-11-30 record's timings; +-50%), plus ~1 min "
                  "of start-up")
            return
        os.makedirs(runs, exist_ok=True)
        if todo:
            run_grid(args, todo)
    if args.grid == "table3":
        aggregate(args)
    else:
        aggregate_grid(args)


if __name__ == "__main__":
    main()
