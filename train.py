"""
Pretrain a GPT with one of the paper's precision recipes (§4, Table 3 rows).

    python train.py                                    # default corpus; tiny on CPU / toy on GPU; recipe fullstack
    python train.py --config toy --recipe bf16 --compile
    torchrun --nproc_per_node=2 train.py --config toy  # DDP; add --fsdp for FSDP2 (fully_shard per block)

A recipe is a row of DESIGN.md's table: which linear layers, which attention, how the optimizer stores its states.
model.py reads the first two (its make_linear / attention_core), optim.build_optimizer the third.
Outputs in --out_dir: metrics.jsonl (one row per logged step, eval rows carry val_loss), loss.png, ckpt.pt
(atomic; --resume continues bit-exactly on CPU), summary.json (tokens/s, MFU, peak memory, optimizer bytes).
"""
import argparse
import contextlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import asdict

import torch

from model import CONFIGS, GPT, compile_model, config_from_name

# recipe -> (linear policy, attention policy, optimizer-state quantization). The paper's Table 3 rows.
RECIPES = {
    "bf16": ("bf16", "bf16", "none"),  # high-precision baseline: BF16 compute, fp32 master weights and states
    "nvfp4": ("nvfp4", "bf16", "none"),  # direct NVFP4 linears (eqs. 1-2 without LoRA)
    "nvfp4_46": ("nvfp4_46", "bf16", "none"),  # + 4/6 scaling: the linear-only state of the art [5]
    "lora_naive": ("lora_naive", "bf16", "none"),  # NVFP4 + a plain BF16 LoRA branch
    "lora_svd": ("lora_svd", "bf16", "none"),  # §3.2 LoRA-SVD, linear layers only
    "fullstack": ("lora_svd", "fp4", "pipeline"),  # §3.2 + §3.5 attention + §3.3/3.4 quantized states and NS
    "naive_fp4": ("nvfp4", "fp4_all", "direct"),  # App. 13's collapsing baseline: everything NVFP4, no care
}

# Per-config defaults for flags left unset. tiny: a CPU run of a few minutes. toy: App. 13 (a few hundred steps).
# 1b/3b: the paper's hyperparameters (DESIGN.md): 1M-token batches (batch_size x grad_accum x seq_len, batch_size
# split across ranks), peak lr 1.5e-4 (LoRA branch 3e-4), 3B warmup tokens, 20B / 64B tokens, cosine decay.
CONFIG_DEFAULTS = {
    "tiny": dict(batch_size=8, grad_accum=1, seq_len=128, max_steps=30, lr=3e-3, warmup=5, eval_every=15,
                 eval_iters=4, save_every=15, log_every=1),
    "toy": dict(batch_size=32, grad_accum=1, seq_len=1024, max_steps=700, lr=1e-3, warmup=50, eval_every=100,
                eval_iters=20, save_every=500, log_every=10),
    "1b": dict(batch_size=32, grad_accum=16, seq_len=2048, max_steps=20_000, lr=1.5e-4, warmup=3000,
               eval_every=500, eval_iters=20, save_every=1000, log_every=10),
    "3b": dict(batch_size=16, grad_accum=32, seq_len=2048, max_steps=64_000, lr=1.5e-4, warmup=3000,
               eval_every=500, eval_iters=20, save_every=1000, log_every=10),
}
H200_BF16_PEAK_FLOPS = 989e12  # dense BF16 tensor-core peak of one H100/H200 SXM (the MFU denominator)


def die(msg, code=2):
    """Bad input: one line on stderr naming the flag and the problem, no traceback."""
    print(f"train.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda msg: die(msg)  # argparse's usage + error -> our single line, exit 2
    p.add_argument("--config", default=None, help=f"one of {list(CONFIGS)} (default: tiny on CPU, toy on GPU)")
    p.add_argument("--recipe", default="fullstack", help=f"one of {list(RECIPES)}")
    p.add_argument("--attn_policy", default=None, help="override the recipe's attention: bf16|fp4|fp4_pv|fp4_dov|fp4_all")
    p.add_argument("--optimizer", default="adamw", help="adamw | root")
    p.add_argument("--max_steps", type=int, default=None)
    p.add_argument("--lr_decay_steps", type=int, default=None, help="cosine length (default: max_steps)")
    p.add_argument("--batch_size", type=int, default=None, help="sequences per micro-step, GLOBAL (split over ranks)")
    p.add_argument("--grad_accum", type=int, default=None, help="micro-steps per optimizer step")
    p.add_argument("--seq_len", type=int, default=None)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate")
    p.add_argument("--lora_lr", type=float, default=None, help="peak lr of the LoRA branch (default 2x --lr, paper)")
    p.add_argument("--min_lr", type=float, default=None, help="cosine floor (default lr/10)")
    p.add_argument("--warmup", type=int, default=None, help="linear warmup steps")
    p.add_argument("--weight_decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="grad-norm clip (0: off)")
    p.add_argument("--lora_rank", type=int, default=32, help="LoRA-SVD / naive-LoRA rank r (not given in the paper)")
    p.add_argument("--lora_beta", type=float, default=1.0, help="LoRA branch scale beta of eq. 1")
    p.add_argument("--realign_every", type=int, default=4000, help="LoRA-SVD randomized-SVD realignment period (0: off)")
    p.add_argument("--eval_every", type=int, default=None)
    p.add_argument("--eval_iters", type=int, default=None, help="val batches per eval")
    p.add_argument("--log_every", type=int, default=None)
    p.add_argument("--save_every", type=int, default=None, help="checkpoint period (0: only at the end, -1: never)")
    p.add_argument("--out_dir", default="out")
    p.add_argument("--data", default="data_cache/default", help="directory with train.bin / val.bin (python data.py)")
    p.add_argument("--resume", action="store_true", help="continue from <out_dir>/ckpt.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 under torchrun (default there: DDP)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--dtype", default=None, help="autocast dtype: bfloat16 (GPU default) | float32 (CPU default)")
    p.add_argument("--no_progress", action="store_true", help="no tqdm bar")
    p.add_argument("--nan_at_step", type=int, default=None, help=argparse.SUPPRESS)  # test aid: poison this step's loss
    return p.parse_args(argv)


def resolve_args(args, world_size):
    """Fill per-config defaults and check every flag; bad input -> die(). Returns the linear/attn/state policies."""
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
    if args.optimizer not in ("adamw", "root"):
        die(f"--optimizer {args.optimizer!r}: unknown optimizer; expected adamw or root")
    linear_policy, attn_policy, state_quant = RECIPES[args.recipe]
    if args.attn_policy is not None:
        if args.attn_policy not in ("bf16", "fp4", "fp4_pv", "fp4_dov", "fp4_all"):
            die(f"--attn_policy {args.attn_policy!r}: expected bf16, fp4, fp4_pv, fp4_dov or fp4_all")
        attn_policy = args.attn_policy
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.dtype not in ("bfloat16", "float32"):
        die(f"--dtype {args.dtype!r}: expected bfloat16 or float32")
    for key, value in CONFIG_DEFAULTS[args.config].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.lora_lr is None:
        args.lora_lr = 2 * args.lr  # the paper: 3e-4 for the branch at peak lr 1.5e-4
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    if args.lr_decay_steps is None:
        args.lr_decay_steps = args.max_steps
    for flag in ("max_steps", "batch_size", "grad_accum", "seq_len", "eval_iters", "log_every", "lr_decay_steps"):
        if getattr(args, flag) < 1:
            die(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if args.save_every < -1:
        die(f"--save_every {args.save_every}: must be >= -1")
    for flag in ("warmup", "eval_every", "realign_every", "lora_rank"):
        if getattr(args, flag) < 0:
            die(f"--{flag} {getattr(args, flag)}: must be >= 0")
    if not args.lr > 0 or not 0 <= args.min_lr <= args.lr or not args.lora_lr > 0:
        die(f"--lr {args.lr} / --min_lr {args.min_lr} / --lora_lr {args.lora_lr}: need lr > 0, 0 <= min_lr <= lr")
    context = CONFIGS[args.config]["block_size"]
    if args.seq_len > context:
        die(f"--seq_len {args.seq_len}: above the context of config {args.config} ({context})")
    if (linear_policy != "bf16" or attn_policy != "bf16") and args.seq_len % 16:
        die(f"--seq_len {args.seq_len}: recipe {args.recipe} quantizes in 16-element blocks; use a multiple of 16")
    if args.batch_size % world_size:
        die(f"--batch_size {args.batch_size}: does not divide across {world_size} ranks")
    if args.fsdp and world_size == 1:
        die("--fsdp: shards over the ranks of a torchrun launch; run it under torchrun --nproc_per_node=N (N > 1)")
    return linear_policy, attn_policy, state_quant


def lr_factor(step, args):
    """Linear warmup to 1, then cosine decay to min_lr/lr at lr_decay_steps (then flat)."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    if step >= args.lr_decay_steps:
        return args.min_lr / args.lr
    progress = (step - args.warmup) / max(1, args.lr_decay_steps - args.warmup)
    floor = args.min_lr / args.lr
    return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model, args, state_quant):
    """Everything goes through optim.build_optimizer (it also runs LoRA-SVD's eq. 3-4 gradient projection)."""
    import optim
    return optim.build_optimizer(model, optimizer=args.optimizer, state_quant=state_quant, lr=args.lr,
                                 lora_lr=args.lora_lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))


def rng_state():
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device only
    nvfp4 = sys.modules.get("nvfp4")  # the quantizers' own generator, if they keep one (SR must resume exactly)
    if nvfp4 is not None and hasattr(nvfp4, "get_rng_state"):
        state["nvfp4"] = nvfp4.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "nvfp4" in state:
        import nvfp4
        nvfp4.set_rng_state(state["nvfp4"])


def atomic_save(obj, path):
    """Write to a temp file, fsync, rename: a crash never leaves a half-written checkpoint at `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)


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
    import data
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
    if uses_lora_svd:  # eqs. 3-4 split dW into dW_res, dL1, dL2 (optim's step() repeats it idempotently);
        import lora_svd  # done here so that the clipped norm is the norm of the gradients actually applied
        lora_svd.project_all(raw_model)
    grad_norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), args.clip if args.clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    return loss_mean, grad_norm


def main(argv=None):
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    linear_policy, attn_policy, state_quant = resolve_args(args, world_size)
    distributed = world_size > 1
    if distributed:
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(local_rank)
        torch.distributed.init_process_group(backend=backend)
    device = f"cuda:{local_rank}" if args.device == "cuda" else "cpu"
    master = rank == 0
    if args.device == "cpu" and linear_policy != "bf16" and "OMP_NUM_THREADS" not in os.environ:
        # the FP4 reference paths are thousands of small ops a step: OpenMP fan-out costs more than it gains, and
        # on a CPU shared with other jobs 2 threads were ~5x slower than 1 (set OMP_NUM_THREADS to override)
        torch.set_num_threads(1)
    ckpt_path = os.path.join(args.out_dir, f"ckpt_rank{rank}.pt" if args.fsdp else "ckpt.pt")
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")

    # data: the default corpus is built on first use (rank 0 builds, the others wait)
    import data
    if master and os.path.normpath(args.data) == os.path.normpath(data.DEFAULT_DIR):
        data.prepare_default(args.data)
    if distributed:
        torch.distributed.barrier()
    try:
        paths = data.shard_paths(args.data)
    except FileNotFoundError as e:
        die(f"--data {args.data}: {e}")
    if args.resume and not os.path.exists(ckpt_path):
        die(f"--resume: no checkpoint at {ckpt_path}")

    # model: same init on every rank (seed), then per-rank streams for SR / Hadamard draws
    torch.manual_seed(args.seed)
    cfg = config_from_name(args.config, linear_policy=linear_policy, attn_policy=attn_policy,
                           lora_rank=args.lora_rank, lora_beta=args.lora_beta)
    try:
        with torch.device(device):
            model = GPT(cfg)
    except (ImportError, NotImplementedError) as e:
        die(f"--recipe {args.recipe}: not implemented yet ({type(e).__name__}: {e})")
    if args.fsdp:  # FSDP2: shard each block, then the root (embeddings, final norm, lm_head); before the optimizer
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    try:
        optimizer = build_optimizer(model, args, state_quant)
    except (ImportError, NotImplementedError) as e:
        die(f"--optimizer {args.optimizer} with --recipe {args.recipe}: not implemented yet ({type(e).__name__}: {e})")
    torch.manual_seed(args.seed + 1000 * rank)
    raw_model = model
    n_params = raw_model.num_params()
    flops_per_token = raw_model.flops_per_token(args.seq_len)
    if master:
        print(f"config {args.config}: {n_params / 1e6:.2f}M params | recipe {args.recipe} (linear {linear_policy}, "
              f"attention {attn_policy}, optimizer states {state_quant}) | optimizer {args.optimizer} | "
              f"{world_size} rank(s) on {args.device}{' FSDP2' if args.fsdp else ' DDP' if distributed else ''}")

    train_loader = data.TokenLoader(paths["train"], args.batch_size // world_size, args.seq_len, rank, world_size,
                                    seed=args.seed)
    step = 0
    if args.resume:
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        for key in ("config", "recipe", "optimizer", "batch_size", "grad_accum", "seq_len", "attn_policy"):
            if ckpt["args"][key] != getattr(args, key):
                die(f"--{key} {getattr(args, key)!r}: the checkpoint {ckpt_path} was trained with {ckpt['args'][key]!r}")
        if ckpt["world_size"] != world_size:
            die(f"--resume: checkpoint has {ckpt['world_size']} ranks, this run has {world_size}")
        raw_model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        train_loader.load_state_dict(ckpt["loader"])
        step = ckpt["step"]
        if step >= args.max_steps:
            die(f"--max_steps {args.max_steps}: the checkpoint {ckpt_path} is already at step {step}; raise --max_steps")
        set_rng_state(ckpt["ranks"][rank]["rng"])  # each rank's own SR / Hadamard streams
        if master:  # drop metrics rows written after the checkpoint (a crash between save and the next save)
            rows = [r for r in read_metrics(metrics_path) if r["step"] <= step]
            with open(metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
            print(f"resumed from {ckpt_path} at step {step}")
        del ckpt
    elif master:
        os.makedirs(args.out_dir, exist_ok=True)
        open(metrics_path, "w").close()

    if distributed and not args.fsdp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank] if args.device == "cuda" else None)
    if args.compile:
        model = compile_model(model)  # the FP4 layers stay eager (model.compile_model)

    amp_dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    autocast = (torch.autocast(device_type=args.device, dtype=amp_dtype) if amp_dtype != torch.float32
                else contextlib.nullcontext())
    tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
    uses_lora_svd = linear_policy == "lora_svd"

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
                         "config": asdict(cfg), "args": vars(args)}, ckpt_path)
        if master:
            plot_metrics(args.out_dir, f"{args.config} / {args.recipe} / {args.optimizer}")

    def log(row):
        if master:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    last_good = step if args.resume else None
    bar = None
    if master and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.max_steps, initial=step, desc="train", dynamic_ncols=True)
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
            import lora_svd  # §3.2: re-split W into top-r branch + residual; resets the matching optimizer state
            lora_svd.realign_model(raw_model, optimizer)
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
            if bar is not None:
                post = {"loss": f"{loss_val:.4f}", "tok/s": f"{tok_s:,.0f}"}
                if "mfu" in row:
                    post["mfu"] = f"{100 * row['mfu']:.1f}%"
                bar.set_postfix(post)
            interval_time, interval_tokens = 0.0, 0  # training time only (no eval / checkpoint time)
        if bar is not None:
            bar.update(1)
        if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
            val_loss = evaluate(model, paths["val"], args, rank, world_size, autocast)
            log({"step": step, "val_loss": val_loss, "tokens": step * tokens_per_step})
            if bar is not None:
                bar.write(f"step {step}: train loss {loss_val:.4f}, val loss {val_loss:.4f}")
        if args.save_every >= 0 and ((args.save_every and step % args.save_every == 0) or step == args.max_steps):
            save(step)
            last_good = step
    if bar is not None:
        bar.close()

    opt_bytes = optimizer_state_bytes(optimizer, args.fsdp, device)
    if master:
        plot_metrics(args.out_dir, f"{args.config} / {args.recipe} / {args.optimizer}")
        tok_s = timed_tokens / train_time if train_time > 0 else float("nan")
        summary = {"config": args.config, "recipe": args.recipe, "optimizer": args.optimizer,
                   "linear_policy": linear_policy, "attn_policy": attn_policy, "state_quant": state_quant,
                   "params": n_params, "steps": step, "tokens": step * tokens_per_step, "world_size": world_size,
                   "fsdp": args.fsdp, "compile": args.compile, "device": args.device, "dtype": args.dtype,
                   "final_loss": loss_val, "final_val_loss": val_loss, "tokens_per_s": tok_s,
                   "mfu": flops_per_token * tok_s / (H200_BF16_PEAK_FLOPS * world_size) if args.device == "cuda" else None,
                   "flops_per_token": flops_per_token, "peak_mem_bytes": peak_memory_bytes(args.device),
                   "peak_mem_kind": "torch.cuda.max_memory_allocated (rank 0)" if args.device == "cuda" else "max RSS",
                   "optimizer_state_bytes": opt_bytes, "optimizer_bytes_per_param": opt_bytes / n_params}
        with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
        print(f"done: {step} steps, loss {loss_val:.4f}, val {val_loss if val_loss is None else round(val_loss, 4)}, {tok_s:,.0f} tokens/s, peak mem "
              f"{summary['peak_mem_bytes'] / 2**30:.2f} GiB, optimizer state {summary['optimizer_bytes_per_param']:.2f} "
              f"bytes/param -> {args.out_dir}/")
    if distributed:  # the other ranks wait for rank 0's plot and summary, then all leave together
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
