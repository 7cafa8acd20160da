"""
Pretrain a GPT with one of the paper's precision recipes (§4, Table 3 rows).

    python train.py                                    # default corpus; tiny on CPU / toy on GPU; recipe fullstack
    python train.py --config toy --recipe bf16 --compile --out_dir out/toy_bf16
    torchrun --nproc_per_node=2 train.py --config toy  # DDP; add --fsdp for FSDP2 (fully_shard per block)

A recipe (model.RECIPES) names the linear layers, the attention and the optimizer states of one ablation row:
model.py builds the first two (make_linear / attention_core), optim.build_optimizer the third.
Outputs in --out_dir: metrics.jsonl (one row per logged step, eval rows carry val_loss), loss.png, ckpt.pt,
summary.json (final losses, tokens, tokens/s, MFU, peak memory, optimizer bytes). A run never replaces another run's
outputs: --resume continues the run in --out_dir (with the schedule it started with), --overwrite replaces it.
"""
import argparse
import contextlib
import dataclasses
import glob
import json
import math
import os
import resource
import sys
import time

import torch

import attention
import data
import lora_svd
import nvfp4
import optim
from model import CONFIGS, GPT, GPTConfig, RECIPES, compile_model, config_from_name

# Per-config defaults for flags left unset. tiny: a CPU run of a few minutes. toy: App. 13 (a few hundred steps).
# 1b/3b: the paper's hyperparameters: "1M-token batches" (we take 2^20 tokens: batch_size x grad_accum x seq_len,
# batch_size split across ranks), peak lr 1.5e-4 (LoRA branch 3e-4), warmup 3B tokens (2861 steps of 2^20), cosine
# decay, and token budgets of 20B (1b) / 64B (3b): max_tokens, so the number of steps follows the batch.
PAPER_BATCH_TOKENS = 2**20
CONFIG_DEFAULTS = {
    "tiny": dict(batch_size=8, grad_accum=1, seq_len=128, max_steps=30, lr=3e-3, warmup=5, eval_every=15,
                 eval_iters=4, save_every=15, log_every=1),
    "toy": dict(batch_size=32, grad_accum=1, seq_len=1024, max_steps=700, lr=1e-3, warmup=50, eval_every=100,
                eval_iters=20, save_every=500, log_every=10),
    "1b": dict(batch_size=32, grad_accum=16, seq_len=2048, max_tokens=20e9, lr=1.5e-4,
               warmup=round(3e9 / PAPER_BATCH_TOKENS), eval_every=500, eval_iters=20, save_every=1000, log_every=10),
    "3b": dict(batch_size=16, grad_accum=32, seq_len=2048, max_tokens=64e9, lr=1.5e-4,
               warmup=round(3e9 / PAPER_BATCH_TOKENS), eval_every=500, eval_iters=20, save_every=1000, log_every=10),
}
SCHEDULE_FLAGS = ("lr", "min_lr", "lora_lr", "warmup", "lr_decay_steps")  # what a resumed run keeps unless passed
RESUME_MUST_MATCH = ("config", "recipe", "attn_policy", "sr_rounding", "optimizer", "batch_size", "grad_accum",
                     "seq_len", "lora_rank", "seed")
RUN_FILES = ("ckpt.pt", "ckpt_rank*.pt", "metrics.jsonl", "summary.json", "loss.png")  # what --overwrite replaces
H200_BF16_PEAK_FLOPS = 989e12  # dense BF16 tensor-core peak of one H100/H200 SXM (the MFU denominator)


def die(msg, code=2):
    """Bad input: one line on stderr naming the flag and the problem, no traceback."""
    print(f"train.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def config_table():
    """--help's table of what each config sets."""
    row = "  {:<7} {:<10} {:<20} {:<23} {:>11}  {:<8} {:<7} {:<11} {:<4} {}".format
    lines = ["per-config defaults (a flag you pass wins; model = layers x hidden, `python model.py` prints more):",
             row("config", "model", "steps", "batch x accum x seq_len", "tokens/step", "lr", "warmup", "eval/iters",
                 "log", "save")]
    for name, d in CONFIG_DEFAULTS.items():
        tokens_per_step = d["batch_size"] * d["grad_accum"] * d["seq_len"]
        steps = d.get("max_steps") or math.ceil(d["max_tokens"] / tokens_per_step)
        length = f"{steps:,}" + ("" if "max_steps" in d else f" ({d['max_tokens'] / 1e9:g}B tokens)")
        lines.append(row(name, f"{CONFIGS[name]['n_layer']} x {CONFIGS[name]['n_embd']}", length,
                         f"{d['batch_size']} x {d['grad_accum']} x {d['seq_len']}", f"{tokens_per_step:,}",
                         f"{d['lr']:.1e}", d["warmup"], f"{d['eval_every']}/{d['eval_iters']}", d["log_every"],
                         d["save_every"]))
    lines.append("  min_lr defaults to lr/10, lora_lr to 2 x lr (the paper: 3e-4 at 1.5e-4), lr_decay_steps to the "
                 "run's steps.\n  1b/3b: the paper's token budgets, its warmup (3B tokens) and its 1M-token batches "
                 "(2^20 tokens).")
    return "\n".join(lines)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, epilog=config_table(), formatter_class=lambda prog:
                                argparse.RawDescriptionHelpFormatter(prog, max_help_position=34, width=118))
    p.error = lambda msg: die(msg)  # argparse's usage + error -> our single line, exit 2
    per_config = "(default: per --config, table below)"
    p.add_argument("--config", default=None, help=f"model size: {', '.join(CONFIGS)} (default: tiny on CPU, toy on "
                   "GPU)")
    p.add_argument("--recipe", default="fullstack", help=f"precision: {', '.join(RECIPES)} (default: %(default)s)")
    p.add_argument("--attn_policy", default=None, help="replace the recipe's attention by one of "
                   f"{', '.join(attention.POLICIES)} (default: the recipe's)")
    p.add_argument("--sr_rounding", default=None, help="the linear layers' gradient SR: sr (Transformer Engine's) or "
                   "sr_up (block scales rounded up: unbiased) (default: the recipe's, sr)")
    p.add_argument("--optimizer", default="adamw", help=f"{' | '.join(optim.OPTIMIZERS)} (default: %(default)s)")
    p.add_argument("--max_steps", type=int, default=None, help=f"optimizer steps {per_config}")
    p.add_argument("--max_tokens", type=float, default=None, help="token budget instead of --max_steps, e.g. 20e9: "
                   "steps = ceil(max_tokens / tokens per step)")
    p.add_argument("--batch_size", type=int, default=None, help=f"sequences per micro-step, GLOBAL (split over "
                   f"ranks) {per_config}")
    p.add_argument("--grad_accum", type=int, default=None, help=f"micro-steps per optimizer step {per_config}")
    p.add_argument("--seq_len", type=int, default=None, help=f"tokens per sequence {per_config}")
    p.add_argument("--lr", type=float, default=None, help=f"peak learning rate {per_config}")
    p.add_argument("--lora_lr", type=float, default=None, help="peak lr of the LoRA branch (default: 2 x --lr)")
    p.add_argument("--min_lr", type=float, default=None, help="floor of the cosine (default: --lr / 10)")
    p.add_argument("--warmup", type=int, default=None, help=f"linear warmup steps {per_config}")
    p.add_argument("--lr_decay_steps", type=int, default=None, help="length of warmup + cosine, then min_lr "
                   "(default: the run's steps; a resumed run keeps its own)")
    p.add_argument("--weight_decay", type=float, default=0.1, help="(default: %(default)s)")
    p.add_argument("--clip", type=float, default=1.0, help="grad-norm clip, 0: off (default: %(default)s)")
    p.add_argument("--lora_rank", type=int, default=32, help="LoRA-SVD / naive-LoRA rank r, not given in the paper "
                   "(default: %(default)s)")
    p.add_argument("--lora_beta", type=float, default=1.0, help="LoRA branch scale beta of eq. 1 "
                   "(default: %(default)s)")
    p.add_argument("--realign_every", type=int, default=4000, help="LoRA-SVD randomized-SVD realignment period, "
                   "0: off (default: %(default)s)")
    p.add_argument("--eval_every", type=int, default=None, help=f"steps between val evals, 0: none {per_config}")
    p.add_argument("--eval_iters", type=int, default=None, help=f"val batches per eval {per_config}")
    p.add_argument("--log_every", type=int, default=None, help=f"steps between logged steps {per_config}")
    p.add_argument("--save_every", type=int, default=None, help=f"checkpoint period, 0: only at the end, -1: never "
                   f"{per_config}")
    p.add_argument("--out_dir", default="out", help="where the run's files go (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out_dir")
    p.add_argument("--resume", action="store_true", help="continue the run in --out_dir from its ckpt.pt")
    p.add_argument("--data", default=data.DEFAULT_DIR, help="directory with train.bin / val.bin from data.py "
                   "(default: %(default)s, built on first use)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (the FP4 layers stay eager)")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 under torchrun (default there: DDP)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="autocast dtype: bfloat16 | float32 (default: bfloat16 on GPU, "
                   "float32 on CPU)")
    p.add_argument("--no_progress", action="store_true", help="plain log lines instead of a progress bar (always so "
                   "when stderr is not a terminal)")
    p.add_argument("--nan_at_step", type=int, default=None, help=argparse.SUPPRESS)  # test aid: poison this step's loss
    return p.parse_args(argv)


def resolve_args(args, world_size):
    """Fill per-config defaults and check every flag but the schedule's (check_schedule); bad input -> die().
    Returns the Recipe."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device not in ("cpu", "cuda"):
        die(f"--device {args.device!r}: expected cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        die("--device cuda: no CUDA GPU is available")
    if args.config is None:
        args.config = "toy" if args.device == "cuda" else "tiny"
    if args.config not in CONFIGS:
        die(f"--config {args.config!r}: unknown config; expected one of {list(CONFIGS)}")
    if args.recipe not in RECIPES:
        die(f"--recipe {args.recipe!r}: unknown recipe; expected one of {list(RECIPES)}")
    if args.optimizer not in optim.OPTIMIZERS:
        die(f"--optimizer {args.optimizer!r}: unknown optimizer; expected one of {', '.join(optim.OPTIMIZERS)}")
    recipe = RECIPES[args.recipe]
    if args.attn_policy is not None:
        if args.attn_policy not in attention.POLICIES:
            die(f"--attn_policy {args.attn_policy!r}: expected one of {', '.join(attention.POLICIES)}")
        recipe = dataclasses.replace(recipe, attention=args.attn_policy)
    if args.sr_rounding is not None:
        if args.sr_rounding not in nvfp4.SR_MODES:
            die(f"--sr_rounding {args.sr_rounding!r}: expected one of {', '.join(nvfp4.SR_MODES)}")
        recipe = dataclasses.replace(recipe, sr_rounding=args.sr_rounding)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.dtype not in ("bfloat16", "float32"):
        die(f"--dtype {args.dtype!r}: expected bfloat16 or float32")
    if args.resume and args.overwrite:
        die("--resume and --overwrite: --resume continues the run in --out_dir, --overwrite replaces it; pick one")
    if args.max_steps is not None and args.max_tokens is not None:
        die("--max_steps and --max_tokens: give one (--max_tokens sets the steps from the tokens per step)")
    defaults = dict(CONFIG_DEFAULTS[args.config])
    if args.max_steps is not None or args.max_tokens is not None:  # the run's length is the user's
        defaults.pop("max_steps", None), defaults.pop("max_tokens", None)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for flag in ("batch_size", "grad_accum", "seq_len", "eval_iters", "log_every"):
        if getattr(args, flag) < 1:
            die(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if args.max_tokens is not None:
        if not args.max_tokens >= 1:
            die(f"--max_tokens {args.max_tokens:g}: must be >= 1")
        args.max_steps = math.ceil(args.max_tokens / (args.batch_size * args.grad_accum * args.seq_len))
    if args.max_steps < 1:
        die(f"--max_steps {args.max_steps}: must be >= 1")
    if args.save_every < -1:
        die(f"--save_every {args.save_every}: must be >= -1")
    for flag in ("eval_every", "realign_every", "lora_rank"):
        if getattr(args, flag) < 0:
            die(f"--{flag} {getattr(args, flag)}: must be >= 0")
    context = CONFIGS[args.config]["block_size"]
    if args.seq_len > context:
        die(f"--seq_len {args.seq_len}: above the context of config {args.config} ({context})")
    if (recipe.linear != "bf16" or recipe.attention != "bf16") and args.seq_len % 16:
        die(f"--seq_len {args.seq_len}: recipe {args.recipe} quantizes in 16-element blocks; use a multiple of 16")
    if args.batch_size % world_size:
        die(f"--batch_size {args.batch_size}: does not divide across {world_size} ranks")
    if args.fsdp and world_size == 1:
        die("--fsdp: shards over the ranks of a torchrun launch; run it under torchrun --nproc_per_node=N (N > 1)")
    return recipe


def fill_schedule(args):
    """The schedule's derived defaults (after a resume has put back the checkpoint's), then its checks."""
    if args.lora_lr is None:
        args.lora_lr = 2 * args.lr  # the paper: 3e-4 for the branch at peak lr 1.5e-4
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.lr_decay_steps is None:
        args.lr_decay_steps = args.max_steps
    if args.lr_decay_steps < 1:
        die(f"--lr_decay_steps {args.lr_decay_steps}: must be >= 1")
    if args.warmup < 0:
        die(f"--warmup {args.warmup}: must be >= 0")
    if not args.lr > 0 or not 0 <= args.min_lr <= args.lr or not args.lora_lr > 0:
        die(f"--lr {args.lr:g} / --min_lr {args.min_lr:g} / --lora_lr {args.lora_lr:g}: need lr > 0, lora_lr > 0 "
            "and 0 <= min_lr <= lr")


def lr_factor(step, args):
    """Linear warmup to 1, then cosine decay to min_lr/lr at lr_decay_steps (then flat)."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    if step >= args.lr_decay_steps:
        return args.min_lr / args.lr
    progress = (step - args.warmup) / max(1, args.lr_decay_steps - args.warmup)
    floor = args.min_lr / args.lr
    return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model, args, recipe):
    """optim.build_optimizer stores the states the recipe names; for LoRA-SVD it also runs eqs. 3-4's projection."""
    return optim.build_optimizer(model, optimizer=args.optimizer, states=recipe.optim_states, lr=args.lr,
                                 lora_lr=args.lora_lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                 gradient_projection=lora_svd.project_all if recipe.linear == "lora_svd" else None)


def rng_state():
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device only
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def atomic_save(obj, path):
    """Write path.tmp, fsync, rename over path: until the rename the previous checkpoint stays whole, so a run
    killed while saving leaves the last complete one (and a stale path.tmp, which the next save replaces)."""
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file."""


def load_checkpoint(path, device="cpu"):
    """A train.py checkpoint as a dict, or CheckpointError saying what is wrong with the file."""
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint")
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes), not a checkpoint")
    try:
        ckpt = torch.load(path, map_location=device, weights_only=False)
    except Exception as e:  # torch.load raises many types on a damaged file (RuntimeError, UnpicklingError, EOF...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: truncated or not a checkpoint ({size:,} bytes; torch.load: {reason})") from None
    missing = {"model", "optimizer", "step", "config", "args"} - set(ckpt if isinstance(ckpt, dict) else ())
    if missing:
        raise CheckpointError(f"{path}: not a train.py checkpoint (no {', '.join(sorted(missing))})")
    try:
        GPTConfig(**ckpt["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: its model config does not fit this model.py ({e})") from None
    return ckpt


def optimizer_state_bytes(optimizer, fsdp, device):
    """Bytes of optimizer state over the whole model. Without FSDP every rank holds all of it; with FSDP2 each rank
    holds its shard (DTensor states: their local part; optim.py's packed NVFP4 states are local tensors already)."""
    if not fsdp and hasattr(optimizer, "state_nbytes"):
        return int(optimizer.state_nbytes())
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    total = sum(local(v).nbytes for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v))
    if fsdp and torch.distributed.is_initialized():  # every rank must call this
        total = torch.tensor(float(total), device=device)
        torch.distributed.all_reduce(total)
    return int(total)


def read_metrics(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(out_dir, title):
    """loss.png: train loss per logged step, val loss at evals."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        ax.plot(*zip(*train), label="train", lw=1)
    if val:
        ax.plot(*zip(*val), "o-", label="val", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=120)
    plt.close(fig)


@torch.no_grad()
def evaluate(model, val_path, args, rank, world_size, autocast):
    """Mean val loss over eval_iters fixed batches (a fresh loader: every eval sees the same data). The RNG is
    forked so evaluation never shifts the training streams (SR, Hadamard signs): resume stays exact."""
    loader = data.TokenLoader(val_path, args.batch_size // world_size, args.seq_len, rank, world_size, seed=1234)
    model.eval()
    devices = [torch.cuda.current_device()] if args.device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        losses = torch.zeros(args.eval_iters, device=args.device)
        for i in range(args.eval_iters):
            x, y = loader.next_batch()
            with autocast:
                _, loss = model(x.to(args.device), y.to(args.device))
            losses[i] = loss.float()
    model.train()
    val_loss = losses.mean()
    if world_size > 1:
        torch.distributed.all_reduce(val_loss, op=torch.distributed.ReduceOp.AVG)
    return val_loss.item()


def peak_memory_bytes(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def compute_gradients(model, raw_model, loader, args, autocast, device, distributed, uses_lora_svd, step):
    """One optimizer step's gradients: args.grad_accum micro-batches (gradient sync on the last only), the LoRA-SVD
    projection of eqs. 3-4, clipping. Returns (mean loss, grad norm) as 0-d tensors (no host sync here)."""
    loss_sum = torch.zeros((), device=device)
    for micro in range(args.grad_accum):
        x, y = loader.next_batch()
        if torch.device(device).type == "cuda":  # pinned: the copies are truly asynchronous (from pageable memory
            x, y = x.pin_memory(), y.pin_memory()  # a host-to-device copy synchronizes the stream)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        last = micro == args.grad_accum - 1
        if args.fsdp:
            model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext()
        else:
            sync = model.no_sync() if distributed and not last else contextlib.nullcontext()
        with sync:
            with autocast:
                _, loss = model(x, y)
            if args.nan_at_step is not None and step + 1 == args.nan_at_step:
                loss = loss * float("nan")
            (loss / args.grad_accum).backward()
        loss_sum += loss.detach()
    loss_mean = loss_sum / args.grad_accum
    if distributed:
        torch.distributed.all_reduce(loss_mean, op=torch.distributed.ReduceOp.AVG)
    if uses_lora_svd:  # eqs. 3-4 split dW into dW_res, dL1, dL2 here, so that the clipped norm is the norm of the
        lora_svd.project_all(raw_model)  # gradients actually applied (the optimizer's own call then does nothing)
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.clip if args.clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    return loss_mean, grad_norm


def set_cpu_threads(recipe, device):
    """One thread for FP4 recipes on CPU unless OMP_NUM_THREADS says otherwise: their reference paths are thousands
    of small ops a step, where OpenMP fan-out costs more than it gains (on a CPU shared with other jobs, 2 threads
    were ~5x slower than 1 in training and ~8x in sampling)."""
    fp4 = recipe.linear != "bf16" or recipe.attention != "bf16"
    if device == "cpu" and fp4 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def existing_run_files(out_dir):
    return sorted(os.path.basename(p) for pattern in RUN_FILES for p in glob.glob(os.path.join(out_dir, pattern)))


def resume_schedule(args, saved, explicit):
    """A resumed run keeps the checkpoint's schedule (lr, warmup, cosine length...) unless a flag says otherwise:
    a larger --max_steps alone must not stretch the cosine under a run that is half way down it. Returns a line
    saying what differs from the checkpoint."""
    changed = []
    for flag in SCHEDULE_FLAGS:
        if flag not in explicit:
            setattr(args, flag, saved[flag])
        elif getattr(args, flag) != saved[flag]:
            changed.append(f"--{flag} {saved[flag]:g} -> {getattr(args, flag):g}")
    note = "schedule " + ("changed: " + ", ".join(changed) if changed else "as in the checkpoint")
    end = max(args.lr_decay_steps, args.warmup)  # lr_factor: warmup first, then the cosine, then min_lr
    if args.max_steps > end:
        note += (f"; the cosine ends at step {end}, steps {end + 1}-{args.max_steps} run at min_lr {args.min_lr:g} "
                 "(--lr_decay_steps stretches it)")
    return note


def main(argv=None):
    args = parse_args(argv)
    explicit = {flag for flag in SCHEDULE_FLAGS if getattr(args, flag) is not None}  # passed on the command line
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    recipe = resolve_args(args, world_size)
    distributed = world_size > 1
    device = f"cuda:{local_rank}" if args.device == "cuda" else "cpu"
    master = rank == 0
    ckpt_path = os.path.join(args.out_dir, f"ckpt_rank{rank}.pt" if args.fsdp else "ckpt.pt")
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")

    # the run in --out_dir: continue it (--resume), replace it (--overwrite), or refuse to touch it
    ckpt, resume_note = None, None
    if args.resume:
        if not os.path.exists(ckpt_path):
            die(f"--resume: no checkpoint at {ckpt_path}")
        try:
            ckpt = load_checkpoint(ckpt_path, device)
        except CheckpointError as e:
            die(f"--resume: {e}")
        for key in RESUME_MUST_MATCH:
            if ckpt["args"].get(key) != getattr(args, key):
                die(f"--{key} {getattr(args, key)!r}: the checkpoint {ckpt_path} was trained with "
                    f"{ckpt['args'].get(key)!r}")
        if ckpt["world_size"] != world_size:
            die(f"--resume: checkpoint has {ckpt['world_size']} ranks, this run has {world_size}")
        if ckpt["step"] >= args.max_steps:
            die(f"--max_steps {args.max_steps}: the checkpoint {ckpt_path} is already at step {ckpt['step']}; "
                "raise --max_steps")
        resume_note = resume_schedule(args, ckpt["args"], explicit)
    else:
        existing = existing_run_files(args.out_dir)
        if existing and not args.overwrite:
            die(f"--out_dir {args.out_dir} already holds a run ({', '.join(existing)}): --resume continues it, "
                "--overwrite replaces it, or pick another --out_dir")
    fill_schedule(args)

    if distributed:
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group(backend=backend)
    set_cpu_threads(recipe, args.device)

    # data: the default corpus is built on first use (rank 0 builds, the others wait)
    try:
        if master and os.path.normpath(args.data) == os.path.normpath(data.DEFAULT_DIR):
            data.prepare_default(args.data)
        if distributed:
            torch.distributed.barrier()
        paths = data.shard_paths(args.data)
        train_loader = data.TokenLoader(paths["train"], args.batch_size // world_size, args.seq_len, rank,
                                        world_size, seed=args.seed)
        val_tokens = len(data.TokenLoader(paths["val"], 1, args.seq_len).tokens)  # evaluate()'s windows fit
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # e.g. a corpus package or the tokenizer missing
        die(f"--data {args.data}: {e}")

    # model: same init on every rank (seed), then per-rank streams for SR / Hadamard draws
    torch.manual_seed(args.seed)
    cfg = config_from_name(args.config, recipe=recipe, lora_rank=args.lora_rank, lora_beta=args.lora_beta)
    with torch.device(device):
        model = GPT(cfg)
    if args.fsdp:  # FSDP2: shard each block, then the root (embeddings, final norm, lm_head); before the optimizer
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optimizer = build_optimizer(model, args, recipe)
    torch.manual_seed(args.seed + 1000 * rank)
    raw_model = model
    n_params = raw_model.num_params()
    flops_per_token = raw_model.flops_per_token(args.seq_len)
    tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
    epochs = args.max_steps * tokens_per_step / len(train_loader.tokens)
    if master:
        print(f"config {args.config}: {n_params / 1e6:.2f}M params | recipe {args.recipe}: {recipe.describe()} | "
              f"optimizer {args.optimizer} | {world_size} rank(s) on {args.device}"
              f"{' FSDP2' if args.fsdp else ' DDP' if distributed else ''}")
        print(f"data {args.data}: {len(train_loader.tokens):,} train / {val_tokens:,} val tokens | {args.max_steps:,} "
              f"steps x {tokens_per_step:,} tokens = {args.max_steps * tokens_per_step:,} ({epochs:.3g} epochs) | "
              f"lr {args.lr:g} (warmup {args.warmup}, cosine to {args.min_lr:g} at step {args.lr_decay_steps}) "
              f"| -> {args.out_dir}/")

    step = 0
    if ckpt is not None:
        base_lrs = [group["base_lr"] for group in optimizer.param_groups]  # this run's schedule, not the saved one
        try:
            raw_model.load_state_dict(ckpt["model"])
            optimizer.load_state_dict(ckpt["optimizer"])
            train_loader.load_state_dict(ckpt["loader"])
        except (RuntimeError, ValueError, KeyError) as e:
            die(f"--resume: {ckpt_path} does not fit this run ({str(e).strip().splitlines()[0]})")
        for group, base_lr in zip(optimizer.param_groups, base_lrs):
            group["base_lr"] = base_lr
        step = ckpt["step"]
        set_rng_state(ckpt["ranks"][rank]["rng"])  # each rank's own SR / Hadamard streams
        if master:  # drop metrics rows written after the checkpoint (a crash between save and the next save)
            rows = [r for r in read_metrics(metrics_path) if r["step"] <= step]
            with open(metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            print(f"resumed from {ckpt_path} at step {step}; {resume_note}")
        ckpt = None
    elif master:  # a fresh run (with --overwrite, the previous run's files go first)
        os.makedirs(args.out_dir, exist_ok=True)
        for name in existing_run_files(args.out_dir):
            os.remove(os.path.join(args.out_dir, name))
        open(metrics_path, "w").close()

    if distributed and not args.fsdp:
        device_ids = [local_rank] if args.device == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    if args.compile:
        model = compile_model(model)  # the FP4 layers stay eager (model.compile_model)

    amp_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    autocast = (torch.autocast(device_type=args.device, dtype=amp_dtype) if amp_dtype != torch.float32
                else contextlib.nullcontext())
    uses_lora_svd = recipe.linear == "lora_svd"
    title = f"{args.config} / {args.recipe} / {args.optimizer}"

    def save(step):
        states = {"rng": rng_state(), "loader": train_loader.state_dict()}
        all_states = [None] * world_size
        if distributed:
            torch.distributed.all_gather_object(all_states, states)
        else:
            all_states = [states]
        if master or args.fsdp:
            atomic_save({"model": raw_model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                         "loader": states["loader"], "ranks": all_states, "world_size": world_size,
                         "config": dataclasses.asdict(cfg), "args": vars(args)}, ckpt_path)
        if master:
            plot_metrics(args.out_dir, title)

    def log(row):
        if master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    bar = None
    if master and not args.no_progress and sys.stderr.isatty():  # a log file gets plain lines, not a bar's redraws
        from tqdm import tqdm
        bar = tqdm(total=args.max_steps, initial=step, desc="train", dynamic_ncols=True)

    def say(line):  # a line of the log, above the progress bar if there is one
        if master:
            bar.write(line) if bar is not None else print(line, flush=True)

    last_good = step if args.resume else None
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    train_time, timed_tokens = 0.0, 0  # for the summary: excludes eval, checkpoints and the first (warmup) steps
    start_step = step
    skip_steps = min(args.max_steps - step - 1, max(1, (args.max_steps - step) // 10))
    interval_time, interval_tokens = 0.0, 0  # training time only (no eval / checkpoint time)
    loss_val, val_loss = float("nan"), None
    while step < args.max_steps:
        t0 = time.perf_counter()
        lr_scale = lr_factor(step, args)
        for group in optimizer.param_groups:
            group["lr"] = group["base_lr"] * lr_scale
        loss_mean, grad_norm = compute_gradients(model, raw_model, train_loader, args, autocast, device, distributed,
                                                 uses_lora_svd, step)
        loss_val, grad_norm_val = loss_mean.item(), grad_norm.item()
        if not (math.isfinite(loss_val) and math.isfinite(grad_norm_val)):
            if bar is not None:
                bar.close()
            kept = f"the last good checkpoint is {ckpt_path} (step {last_good})" if last_good is not None \
                else "no checkpoint was written yet"
            print(f"train.py: non-finite loss {loss_val} / grad norm {grad_norm_val} at step {step + 1}: stopped "
                  f"before the update; {kept}", file=sys.stderr, flush=True)
            if distributed:
                torch.distributed.destroy_process_group()
            sys.exit(1)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if uses_lora_svd and args.realign_every and step % args.realign_every == 0:
            lora_svd.realign_model(raw_model, optimizer)  # §3.2: re-split W into top-r branch + residual
        if args.device == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step - start_step > skip_steps:
            train_time, timed_tokens = train_time + dt, timed_tokens + tokens_per_step
        interval_time, interval_tokens = interval_time + dt, interval_tokens + tokens_per_step

        if step % args.log_every == 0 or step == args.max_steps:
            tok_s = interval_tokens / interval_time
            row = {"step": step, "loss": loss_val, "lr": args.lr * lr_scale, "grad_norm": grad_norm_val,
                   "tokens": step * tokens_per_step, "tokens_per_s": tok_s}
            if args.device == "cuda":
                row["mfu"] = flops_per_token * tok_s / (H200_BF16_PEAK_FLOPS * world_size)
            log(row)
            mfu = f" | mfu {100 * row['mfu']:.1f}%" if "mfu" in row else ""
            if bar is not None:
                bar.set_postfix_str(f"loss {loss_val:.4f} | {tok_s:,.0f} tok/s{mfu}")
            else:
                say(f"step {step}/{args.max_steps} | loss {loss_val:.4f} | lr {row['lr']:.2e} | {tok_s:,.0f} tok/s"
                    f"{mfu}")
            interval_time, interval_tokens = 0.0, 0
        if bar is not None:
            bar.update(1)
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            val_loss = evaluate(model, paths["val"], args, rank, world_size, autocast)
            log({"step": step, "val_loss": val_loss, "tokens": step * tokens_per_step})
            say(f"step {step}: train loss {loss_val:.4f}, val loss {val_loss:.4f}")
        if args.save_every >= 0 and ((args.save_every and step % args.save_every == 0) or step == args.max_steps):
            save(step)
            last_good = step
    if bar is not None:
        bar.close()

    opt_bytes = optimizer_state_bytes(optimizer, args.fsdp, device)
    if master:
        plot_metrics(args.out_dir, title)
        tok_s = timed_tokens / train_time if train_time > 0 else float("nan")
        mfu = flops_per_token * tok_s / (H200_BF16_PEAK_FLOPS * world_size) if args.device == "cuda" else None
        summary = {"config": args.config, "recipe": args.recipe, "precision": dataclasses.asdict(recipe),
                   "optimizer": args.optimizer, "seed": args.seed, "params": n_params, "steps": step,
                   "tokens": step * tokens_per_step, "epochs": epochs, "final_loss": loss_val,
                   "final_val_loss": val_loss, "world_size": world_size, "fsdp": args.fsdp, "compile": args.compile,
                   "device": args.device, "dtype": args.dtype, "tokens_per_s": tok_s,
                   "mfu": mfu,
                   "flops_per_token": flops_per_token, "peak_mem_bytes": peak_memory_bytes(args.device),
                   "peak_mem_kind": "torch.cuda.max_memory_allocated (rank 0)" if args.device == "cuda" else "max RSS",
                   "optimizer_state_bytes": opt_bytes, "optimizer_bytes_per_param": opt_bytes / n_params}
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        val = "none" if val_loss is None else f"{val_loss:.4f}"
        print(f"done: {step} steps, loss {loss_val:.4f}, val {val}, {tok_s:,.0f} tokens/s, peak mem "
              f"{summary['peak_mem_bytes'] / 2**30:.2f} GiB, optimizer state "
              f"{summary['optimizer_bytes_per_param']:.2f} "
              f"bytes/param -> {args.out_dir}/ (metrics.jsonl, loss.png, summary.json"
              f"{', ckpt.pt' if args.save_every >= 0 else ''})")
    if distributed:  # the other ranks wait for rank 0's plot and summary, then all leave together
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # Ctrl-C: no traceback; the last checkpoint is whole (atomic_save)
        print("train.py: interrupted; --resume continues from the last checkpoint in --out_dir", file=sys.stderr)
        sys.exit(130)
