"""
Pretrain a GPT with one of the paper's precision recipes (§4, Table 3 rows).

    python train.py                # the default corpus; tiny on CPU, toy on GPU; recipe fullstack
    python train.py --config toy --recipe bf16 --compile --out_dir out/toy_bf16
    torchrun --nproc_per_node=2 train.py --config toy     # DDP; add --fsdp for FSDP2

A recipe (model.RECIPES) names the linear layers, the attention and the optimizer states of one
ablation row: model.py builds the first two (make_linear / attention_core), optim.build_optimizer
the third. Outputs in --out_dir: metrics.jsonl (a header row with every resolved setting, then one
row per logged step; eval rows carry val_loss), loss.png, ckpt.pt, summary.json (the settings, final
losses, tokens/s, MFU, peak memory, optimizer bytes). A run never replaces another run's outputs:
--resume continues the run in --out_dir from its checkpoint (or restarts it when it was stopped
before its first checkpoint), --overwrite replaces it.
"""
import argparse
import contextlib
import dataclasses
import fractions
import functools
import glob
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time

import torch


def route_flag(argv):
    """--route (default NANOFP4_ROUTE, else auto) into NANOFP4_ROUTE, the variable nvfp4.route reads
    whenever a layer runs. Set before kernels/ is imported: there, with the kernels route and no
    CUDA GPU, kernels/__init__.py switches Triton's interpreter on before any kernel is decorated."""
    early = argparse.ArgumentParser(add_help=False)
    early.add_argument("--route", default=os.environ.get("NANOFP4_ROUTE", "auto"))
    route = early.parse_known_args(argv)[0].route
    os.environ["NANOFP4_ROUTE"] = route
    return route


if __name__ == "__main__":
    route_flag(sys.argv[1:])

import attention  # noqa: E402 (after --route, above)
import data  # noqa: E402
import lora_svd  # noqa: E402
import nvfp4  # noqa: E402
import optim  # noqa: E402
from model import CONFIGS, GPT, GPTConfig, RECIPES, compile_model, config_from_name  # noqa: E402

# Per-config defaults for flags left unset. tiny: a CPU run of a few minutes. toy: App. 13 (a few
# hundred steps). 1b/3b: the paper's hyperparameters: "1M-token batches" (we take 2^20 tokens:
# batch_size x grad_accum x seq_len, batch_size split across ranks), peak lr 1.5e-4 (LoRA branch
# 3e-4), warmup 3B tokens (2861 steps of 2^20), cosine decay, and token budgets of 20B (1b) / 64B
# (3b): max_tokens, so the number of steps follows the batch.
PAPER_BATCH_TOKENS = 2**20
PAPER_WARMUP = round(3e9 / PAPER_BATCH_TOKENS)
CONFIG_DEFAULTS = {
    "tiny": dict(batch_size=8, grad_accum=1, seq_len=128, max_steps=30, lr=3e-3, warmup=5,
                 eval_every=15, eval_iters=4, save_every=15, log_every=1),
    "toy": dict(batch_size=32, grad_accum=1, seq_len=1024, max_steps=700, lr=1e-3, warmup=50,
                eval_every=100, eval_iters=20, save_every=500, log_every=10),
    "1b": dict(batch_size=32, grad_accum=16, seq_len=2048, max_tokens=20e9, lr=1.5e-4,
               warmup=PAPER_WARMUP, eval_every=500, eval_iters=20, save_every=1000, log_every=10),
    "3b": dict(batch_size=16, grad_accum=32, seq_len=2048, max_tokens=64e9, lr=1.5e-4,
               warmup=PAPER_WARMUP, eval_every=500, eval_iters=20, save_every=1000, log_every=10),
}
SCHEDULE_FLAGS = ("lr", "min_lr", "lora_lr", "warmup", "lr_decay_steps")  # a resume keeps these
SHAPE_FLAGS = ("n_layer", "n_embd", "n_head", "n_kv_head", "ffn_hidden")  # GPTConfig overrides
# the flags that change a number of the run; with the recipe, the contracts and the schemes'
# versions they make its numerics_id (numerics below). A resume keeps all but its length and schedule.
NUMERIC_FLAGS = ("config", *SHAPE_FLAGS, "recipe", "attn_policy", "optimizer", "batch_size",
                 "grad_accum", "seq_len", "max_steps", *SCHEDULE_FLAGS, "weight_decay", "clip",
                 "lora_rank", "lora_beta", "realign_every", "seed", "eval_iters", "data", "dtype",
                 "compile", "fsdp")
RESUME_MUST_MATCH = tuple(f for f in NUMERIC_FLAGS if f not in ("max_steps", *SCHEDULE_FLAGS))
RUN_FILES = ("ckpt.pt", "ckpt_rank*.pt", "metrics.jsonl", "summary.json", "loss.png")  # a run's
LORA_LINEARS = ("lora_naive", "lora_svd")  # the Recipe.linear kinds with a rank-r branch
# MFU's denominator: dense BF16 tensor-core peaks (without sparsity) from NVIDIA's datasheets, by
# device name, the first match: H100 / H200 SXM 989 TFLOP/s, the NVL parts 835, H100 PCIe 756,
# A100 / A800 312, L40S 362, B200 2250. A GPU not listed gets no MFU (None), not another's peak.
BF16_PEAK_FLOPS = (("H100 NVL", 835e12), ("H200 NVL", 835e12), ("H100 PCIe", 756e12),
                   ("H100", 989e12), ("H200", 989e12), ("A100", 312e12), ("A800", 312e12),
                   ("L40S", 362e12), ("B200", 2250e12))
PROGRESS_EVERY = 30.0  # seconds: a step that runs longer says how far it is (StepProgress)


def die(msg, code=2):
    """Bad input: one line on stderr naming the flag and the problem, no traceback."""
    print(f"train.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def config_table():
    """--help's table of what each config sets."""
    row = "  {:<7} {:<10} {:<20} {:<23} {:>11}  {:<8} {:<7} {:<11} {:<4} {}".format
    lines = ["per-config defaults (a flag you pass wins; model = layers x hidden, "
             "`python model.py` prints more):",
             row("config", "model", "steps", "batch x accum x seq_len", "tokens/step", "lr",
                 "warmup", "eval/iters", "log", "save")]
    for name, d in CONFIG_DEFAULTS.items():
        tokens_per_step = d["batch_size"] * d["grad_accum"] * d["seq_len"]
        steps = d.get("max_steps") or math.ceil(d["max_tokens"] / tokens_per_step)
        length = f"{steps:,}"
        if "max_steps" not in d:
            length += f" ({d['max_tokens'] / 1e9:g}B tokens)"
        model = f"{CONFIGS[name]['n_layer']} x {CONFIGS[name]['n_embd']}"
        batch = f"{d['batch_size']} x {d['grad_accum']} x {d['seq_len']}"
        lines.append(row(name, model, length, batch, f"{tokens_per_step:,}", f"{d['lr']:.1e}",
                         d["warmup"], f"{d['eval_every']}/{d['eval_iters']}", d["log_every"],
                         d["save_every"]))
    lines.append("  min_lr defaults to lr/10, lora_lr to 2 x lr (the paper: 3e-4 at 1.5e-4), "
                 "lr_decay_steps to the run's steps.\n  1b/3b: the paper's token budgets, its "
                 "warmup (3B tokens) and its 1M-token batches (2^20 tokens).")
    return "\n".join(lines)


def finite(text):
    """argparse type of the float flags: a finite number (an inf or nan lr, beta, clip... reached
    the loop and failed there as a traceback at step 1 or 2)."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def parse_args(argv=None):
    return parser().parse_args(argv)


def given_flags(argv=None):
    """The flags the command line gives (their dests), whatever their values: a resume takes the
    others from its checkpoint (take_saved_flags)."""
    p = parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS  # a flag not given leaves no attribute
    return set(vars(p.parse_args(argv)))


def parser():
    p = argparse.ArgumentParser(description=__doc__, epilog=config_table(),
                                formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(
                                    prog, max_help_position=34, width=118))
    p.error = lambda msg: die(msg)  # argparse's usage + error -> our single line, exit 2
    per_config = "(default: per --config, table below)"
    add = p.add_argument
    add("--config", default=None,
        help=f"model size: {', '.join(CONFIGS)} (default: tiny on CPU, toy on GPU)")
    for dim, what in (("n_layer", "blocks"), ("n_embd", "hidden size"), ("n_head", "query heads"),
                      ("n_kv_head", "key/value heads (GQA)"), ("ffn_hidden", "SwiGLU width")):
        add(f"--{dim}", type=int, default=None, help=f"model shape: {what} (default: --config's)")
    add("--recipe", default="fullstack",
        help=f"precision: {', '.join(RECIPES)} (default: %(default)s)")
    add("--attn_policy", default=None, help="replace the recipe's attention by one of "
        f"{', '.join(attention.POLICIES)} (default: the recipe's)")
    add("--optimizer", default="adamw",
        help=f"{' | '.join(optim.OPTIMIZERS)} (default: %(default)s)")
    add("--max_steps", type=int, default=None, help=f"optimizer steps {per_config}")
    add("--max_tokens", type=finite, default=None, help="token budget instead of --max_steps, e.g. "
        "20e9: steps = ceil(max_tokens / tokens per step)")
    add("--batch_size", type=int, default=None,
        help=f"sequences per micro-step, GLOBAL (split over ranks) {per_config}")
    add("--grad_accum", type=int, default=None, help=f"micro-steps per optimizer step {per_config}")
    add("--seq_len", type=int, default=None, help=f"tokens per sequence {per_config}")
    add("--lr", type=finite, default=None, help=f"peak learning rate {per_config}")
    add("--lora_lr", type=finite, default=None,
        help="peak lr of the LoRA branch (default: 2 x --lr)")
    add("--min_lr", type=finite, default=None, help="floor of the cosine (default: --lr / 10)")
    add("--warmup", type=int, default=None, help=f"linear warmup steps {per_config}")
    add("--lr_decay_steps", type=int, default=None, help="length of warmup + cosine, then min_lr "
        "(default: the run's steps; a resumed run keeps its own)")
    add("--weight_decay", type=finite, default=0.1, help="(default: %(default)s)")
    add("--clip", type=finite, default=1.0, help="grad-norm clip, 0: off (default: %(default)s)")
    add("--lora_rank", type=int, default=32, help="LoRA-SVD / naive-LoRA rank r, not given in the "
        "paper; 1 .. the smallest layer dim (default: %(default)s)")
    add("--lora_beta", type=finite, default=1.0,
        help="LoRA branch scale beta of eq. 1 (default: %(default)s)")
    add("--realign_every", type=int, default=4000,
        help="LoRA-SVD randomized-SVD realignment period, 0: off (default: %(default)s)")
    add("--eval_every", type=int, default=None,
        help=f"steps between val evals, 0: none {per_config}")
    add("--eval_iters", type=int, default=None, help=f"val batches per eval {per_config}")
    add("--log_every", type=int, default=None, help=f"steps between logged steps {per_config}")
    add("--save_every", type=int, default=None, help="checkpoint period, 0: only at the end, "
        f"-1: no checkpoint at all (benchmarks; such a run cannot be resumed) {per_config}")
    add("--out_dir", default="out", help="where the run's files go (default: %(default)s)")
    add("--overwrite", action="store_true", help="replace the run already in --out_dir")
    add("--resume", action="store_true", help="continue the run in --out_dir from its checkpoint "
        "(restart it if it was stopped before its first one)")
    add("--data", default=data.DEFAULT_DIR, help="directory with train.bin / val.bin from data.py "
        "(default: %(default)s, built on first use)")
    add("--seed", type=int, default=0, help="(default: %(default)s)")
    add("--numerics", action="append", default=[], metavar="KEY=VALUE",
        help="change one precision-contract entry (repeatable): linear.<entry>.<field> "
        "(nvfp4.LINEAR, e.g. linear.wgrad.dy.rounding=rtn), optim.<entry>[.<field>] "
        "(optim.CONTRACT, e.g. optim.root.momentum=fp32), lora.branch=bf16|fp32")
    add("--compile", action="store_true",
        help="torch.compile the model (the FP4 layers stay eager)")
    add("--cuda_graphs", action="store_true", help="replay each micro-step's forward + backward "
        "as a CUDA graph (make_graphed_callables; with --compile: mode reduce-overhead)")
    add("--fsdp", action="store_true", help="FSDP2 under torchrun (default there: DDP)")
    add("--device", default=None, help="cpu | cuda (default: cuda if available)")
    add("--route", default=None, help=f"{' | '.join(nvfp4.ROUTES)}: the FP4 ops on the Triton "
        "kernels or the PyTorch reference; auto: the kernels on a GPU that has them (default: "
        "NANOFP4_ROUTE, else auto)")
    add("--dtype", default=None,
        help="autocast dtype: bfloat16 | float32 (default: bfloat16 on GPU, float32 on CPU)")
    add("--no_progress", action="store_true", help="plain log lines instead of a progress bar "
        "(always so when stderr is not a terminal)")
    return p


def resolve_args(args, world_size):
    """Fill per-config defaults and check every flag but the schedule's (fill_schedule) and the
    data's (check_fits); bad input -> die(). Returns the Recipe."""
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device not in ("cpu", "cuda"):
        die(f"--device {args.device!r}: expected cpu or cuda")
    if args.device == "cuda" and not torch.cuda.is_available():
        die("--device cuda: no CUDA GPU is available")
    if args.config is None:
        args.config = "toy" if args.device == "cuda" else "tiny"
    args.route = route_flag(["--route", args.route] if args.route else [])  # nvfp4.route reads it
    if args.route not in nvfp4.ROUTES:
        die(f"--route {args.route!r}: expected one of {', '.join(nvfp4.ROUTES)} (default: "
            "NANOFP4_ROUTE, else auto)")
    if (args.route == "kernels" and args.device == "cpu"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        die("--route kernels on a CPU runs the kernels in Triton's interpreter: set "
            "TRITON_INTERPRET=1 too (kernels/ sets it itself only where no CUDA GPU is present)")
    check_out_dir(args.out_dir)
    if os.path.isfile(args.data):
        die(f"--data {args.data}: a file; --data takes a folder of token shards: `python data.py "
            f"--input {args.data} --out_dir DIR` makes one from it, then --data DIR")
    for flag, known in (("config", CONFIGS), ("recipe", RECIPES), ("optimizer", optim.OPTIMIZERS)):
        if getattr(args, flag) not in known:
            die(f"--{flag} {getattr(args, flag)!r}: unknown {flag}; expected one of "
                f"{', '.join(known)}")
    recipe = RECIPES[args.recipe]
    if args.attn_policy is not None:
        if args.attn_policy not in attention.POLICIES:
            die(f"--attn_policy {args.attn_policy!r}: expected one of "
                f"{', '.join(attention.POLICIES)}")
        recipe = dataclasses.replace(recipe, attention=args.attn_policy)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.dtype not in ("bfloat16", "float32"):
        die(f"--dtype {args.dtype!r}: expected bfloat16 or float32")
    if args.cuda_graphs and (args.device != "cuda" or world_size > 1):
        die("--cuda_graphs: one CUDA GPU only (no CPU, no DDP / FSDP2 under torchrun)")
    if args.resume and args.overwrite:
        die("--resume and --overwrite: --resume continues the run in --out_dir, --overwrite "
            "replaces it; pick one")
    if args.max_steps is not None and args.max_tokens is not None:
        die("--max_steps and --max_tokens: give one (--max_tokens sets the steps from the tokens "
            "per step)")
    defaults = dict(CONFIG_DEFAULTS[args.config])
    if args.max_steps is not None or args.max_tokens is not None:  # the run's length is the user's
        defaults.pop("max_steps", None), defaults.pop("max_tokens", None)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    check_sizes(args, recipe, world_size)
    for spec in args.numerics:
        unread_numerics(spec, recipe, args)
        set_numerics(spec)
    return recipe


QUANT_FIELDS = [f.name for f in dataclasses.fields(nvfp4.Quant)]
NUMBER_ENTRIES = {"adamw.v.tile": (lambda t: t >= 16 and t & (t - 1) == 0, "a power of two >= 16"),
                  "adamw.v.floor": (lambda f: 0 <= f <= 1, "in [0, 1] (of the tile mean)"),
                  "root.momentum.levels": (lambda n: n in (1, 2), "1 or 2")}


def check_out_dir(out_dir):
    """--out_dir: a folder, or one that can be made (its nearest existing parent a writable one)."""
    path = os.path.abspath(out_dir)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        die(f"--out_dir {out_dir}: {path} is a file, not a directory")
    try:  # a folder made there and removed: os.access says yes to root where mkdir fails (/proc)
        os.rmdir(tempfile.mkdtemp(dir=path))
    except OSError as e:
        die(f"--out_dir {out_dir}: cannot make a folder in {path} ({e.strerror})")


def unread_numerics(spec, recipe, args):
    """A --numerics entry this recipe and optimizer never read: refused, not stored in summary.json
    as if it had changed the run."""
    key, states = spec.partition("=")[0], recipe.optim_states
    optim_key, root_key = key.startswith("optim."), key.startswith(("optim.root.",
                                                                    "optim.newton_schulz"))
    direct_reads = ("optim.adamw.m", "optim.adamw.v", "optim.root.momentum")  # as "fp32" only
    unread = [(key.startswith("linear.") and recipe.linear == "bf16", "its linear layers are bf16"),
              (key == "lora.branch" and recipe.linear not in LORA_LINEARS, "it has no LoRA branch"),
              (optim_key and states == "fp32", "its optimizer states are fp32"),
              (root_key and args.optimizer != "root",
               "only --optimizer root has a momentum buffer and Newton-Schulz"),
              (optim_key and states == "direct" and key not in direct_reads
               and not key.startswith("optim.newton_schulz"),
               "its direct states read no contract but whole entries set to fp32")]
    why = next((reason for hit, reason in unread if hit), None)
    if why:
        die(f"--numerics {spec!r}: recipe {args.recipe} with --optimizer {args.optimizer} never "
            f"reads {key} ({why})")


def set_numerics(spec):
    """One --numerics KEY=VALUE: an entry of a module's precision contract (docs/nvfp4_format.md),
    changed before anything is built, as a fork would edit the table."""
    key, sep, value = spec.partition("=")
    module, _, rest = key.partition(".")
    tables = {"linear": nvfp4.LINEAR, "optim": optim.CONTRACT}
    if not sep or (module not in tables and key != "lora.branch"):
        die(f"--numerics {spec!r}: expected KEY=VALUE with KEY linear.<entry>.<field>, "
            "optim.<entry>[.<field>] or lora.branch")
    if key == "lora.branch":
        if value not in lora_svd.BRANCH_DTYPES:
            die(f"--numerics {spec!r}: lora.branch is one of {', '.join(lora_svd.BRANCH_DTYPES)}")
        lora_svd.BRANCH = value
        return
    table = tables[module]
    if rest in table:  # a whole entry: "fp32" (an optimizer state, NS), or a number (tile, floor)
        old = table[rest]
        if not isinstance(old, (int, float)):  # an nvfp4.Quant, or "fp32" already
            whole = "fp32 (full precision) or " if module == "optim" else ""
            if not whole or value != "fp32":
                die(f"--numerics {spec!r}: {key} takes {whole}one field at a time ({key}.<field>, "
                    f"<field> one of {', '.join(QUANT_FIELDS)})")
            table[rest] = value
            return
        try:
            number = fractions.Fraction(value)
        except (ValueError, ZeroDivisionError):
            die(f"--numerics {spec!r}: {rest} takes a number")
        if isinstance(old, int) and number.denominator != 1:  # int() would truncate it silently
            die(f"--numerics {spec!r}: {rest} takes a whole number")
        table[rest] = type(old)(number)
        allowed = NUMBER_ENTRIES.get(rest)
        if allowed and not allowed[0](table[rest]):
            die(f"--numerics {spec!r}: {rest} must be {allowed[1]}")
        return
    entry, _, field = rest.rpartition(".")
    if entry not in table or field not in QUANT_FIELDS:
        die(f"--numerics {spec!r}: {module}'s entries are {', '.join(table)}; an nvfp4.Quant "
            f"entry's fields are {', '.join(QUANT_FIELDS)}")
    if not isinstance(table[entry], nvfp4.Quant):
        die(f"--numerics {spec!r}: {entry} is {table[entry]!r}, not an nvfp4.Quant: set the whole "
            "entry")
    current = table[entry]
    parsed = {"block": parse_block,
              "four_over_six": lambda v: {"true": True, "false": False, "none": None}[v.lower()]}
    try:
        table[entry] = dataclasses.replace(current, **{field: parsed.get(field, str)(value)})
        nvfp4.linear_contract(False) if module == "linear" else optim._entry(entry)
    except (ValueError, KeyError) as e:  # what the layers / the optimizer would raise at step 1
        die(f"--numerics {spec!r}: {e}")


def parse_block(text):
    """--numerics ...block=ROWSxCOLS -> (rows, cols); ValueError naming the form otherwise."""
    dims = text.split("x")
    if len(dims) != 2 or not all(d.isdigit() for d in dims):
        raise ValueError(f"block takes ROWSxCOLS in whole numbers, one of "
                         f"{', '.join('x'.join(map(str, b)) for b in nvfp4.BLOCKS)}; got {text!r}")
    return tuple(int(d) for d in dims)


def check_sizes(args, recipe, world_size):
    """The numeric flags: lengths, periods, the LoRA rank against the config's layers, the sequence
    against the context and the 16-element blocks, the batch against the ranks."""
    for flag in ("batch_size", "grad_accum", "seq_len", "eval_iters", "log_every"):
        if getattr(args, flag) < 1:
            die(f"--{flag} {getattr(args, flag)}: must be >= 1")
    if args.max_tokens is not None:
        if not args.max_tokens >= 1:
            die(f"--max_tokens {args.max_tokens:g}: must be >= 1")
        tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
        args.max_steps = math.ceil(args.max_tokens / tokens_per_step)
    if args.max_steps < 1:
        die(f"--max_steps {args.max_steps}: must be >= 1")
    if args.save_every < -1:
        die(f"--save_every {args.save_every}: must be >= -1")
    for flag in ("eval_every", "realign_every", "lora_rank", "weight_decay", "clip"):
        if getattr(args, flag) < 0:
            die(f"--{flag} {getattr(args, flag):g}: must be >= 0")
    if not args.lora_beta > 0:  # LoRA-SVD splits sqrt(S / beta) into L1 and L2
        die(f"--lora_beta {args.lora_beta:g}: must be > 0")
    cfg = GPTConfig(**{**CONFIGS[args.config], **model_shape(args)})
    check_shape(cfg, recipe)
    if recipe.linear in LORA_LINEARS:  # r of every block linear: 1 .. min(in, out)
        kv = cfg.n_kv_head * cfg.head_dim
        smallest, name = min((kv, f"k_proj/v_proj ({kv} x {cfg.n_embd})"),
                             (cfg.n_embd, f"hidden {cfg.n_embd}"), (cfg.ffn_hidden, "the FFN"))
        if not 1 <= args.lora_rank <= smallest:
            die(f"--lora_rank {args.lora_rank}: recipe {args.recipe}'s LoRA branch needs a rank in "
                f"[1, {smallest}] for config {args.config} (its smallest layer dim: {name})")
    if args.seq_len > cfg.block_size:
        die(f"--seq_len {args.seq_len}: above the context of config {args.config} "
            f"({cfg.block_size})")
    if (recipe.linear != "bf16" or recipe.attention != "bf16") and args.seq_len % 16:
        die(f"--seq_len {args.seq_len}: recipe {args.recipe} quantizes in 16-element blocks; use a "
            "multiple of 16")
    if args.batch_size % world_size:
        die(f"--batch_size {args.batch_size}: does not divide across {world_size} ranks")
    if args.fsdp and world_size == 1:
        die("--fsdp: shards over the ranks of a torchrun launch; run it under torchrun "
            "--nproc_per_node=N (N > 1)")


def model_shape(args):
    """The shape flags given (--n_embd ...): overrides of --config's GPTConfig."""
    return {dim: getattr(args, dim) for dim in SHAPE_FLAGS if getattr(args, dim) is not None}


def check_shape(cfg, recipe):
    """A model shape the layers can build: heads that divide the width and share K/V evenly, a head
    dim RoPE and the attention kernels take, NVFP4 dims in whole 16-element blocks."""
    for dim in SHAPE_FLAGS:
        if getattr(cfg, dim) < 1:
            die(f"--{dim} {getattr(cfg, dim)}: must be >= 1")
    if cfg.n_embd % cfg.n_head:
        die(f"--n_embd {cfg.n_embd} / --n_head {cfg.n_head}: the heads must divide the width")
    if cfg.n_head % cfg.n_kv_head:
        die(f"--n_head {cfg.n_head} / --n_kv_head {cfg.n_kv_head}: GQA needs n_kv_head to divide "
            "n_head")
    if recipe.attention != "bf16" and cfg.head_dim not in attention.HEAD_DIMS:
        die(f"--n_embd {cfg.n_embd} / --n_head {cfg.n_head}: head dim {cfg.head_dim}; recipe "
            f"attention {recipe.attention} takes {' or '.join(map(str, attention.HEAD_DIMS))}")
    if cfg.head_dim % 2:
        die(f"--n_embd {cfg.n_embd} / --n_head {cfg.n_head}: head dim {cfg.head_dim} must be even "
            "(RoPE rotates pairs)")
    dims = {"n_embd": cfg.n_embd, "ffn_hidden": cfg.ffn_hidden,
            "n_kv_head": cfg.n_kv_head * cfg.head_dim}
    for dim, size in dims.items():
        if recipe.linear != "bf16" and size % 16:
            die(f"--{dim}: a layer dim of {size}; recipe {recipe.linear}'s linear layers quantize "
                "in 16-element blocks, so every dim must be a multiple of 16")


def fill_schedule(args):
    """The schedule's derived defaults (after a resume has put back the checkpoint's), then its
    checks."""
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
        die(f"--lr {args.lr:g} / --min_lr {args.min_lr:g} / --lora_lr {args.lora_lr:g}: need "
            "lr > 0, lora_lr > 0 and 0 <= min_lr <= lr")


def lr_factor(step, args):
    """Linear warmup to 1, then cosine decay to min_lr/lr at lr_decay_steps (then flat)."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    if step >= args.lr_decay_steps:
        return args.min_lr / args.lr
    progress = (step - args.warmup) / max(1, args.lr_decay_steps - args.warmup)
    floor = args.min_lr / args.lr
    return floor + 0.5 * (1.0 - floor) * (1.0 + math.cos(math.pi * progress))


# --------------------------------------------------------------------------------------------------
# The run in --out_dir: continue it, restart it, replace it, or refuse to touch it

def existing_run_files(out_dir):
    return sorted(os.path.basename(p) for pattern in RUN_FILES
                  for p in glob.glob(os.path.join(out_dir, pattern)))


def open_out_dir(args, ckpt_path, world_size, explicit, device):
    """What this run does with --out_dir: (the checkpoint to continue or None, a line saying so)."""
    existing = existing_run_files(args.out_dir)
    has_ckpt = os.path.exists(ckpt_path)
    if args.resume and has_ckpt:
        ckpt = load_resumable(args, ckpt_path, world_size, device)
        note = resume_schedule(args, ckpt["args"], explicit)
        return ckpt, f"resumed from {ckpt_path} at step {ckpt['step']}; {note}"
    if args.resume and "summary.json" in existing:  # finished without a checkpoint: keep its record
        die(f"--resume: {args.out_dir} holds a finished run without a checkpoint (--save_every -1 "
            "writes none), so there is nothing to continue: --overwrite reruns it, or pick another "
            "--out_dir")
    if args.resume:
        why = "it stopped before its first checkpoint" if existing else "nothing is there yet"
        return None, f"--resume: no checkpoint at {ckpt_path} ({why}): starting the run at step 0"
    if existing and not args.overwrite:
        files = ", ".join(existing)
        if any(name.startswith("ckpt") for name in existing):
            die(f"--out_dir {args.out_dir} already holds a run ({files}): --resume continues it, "
                "--overwrite replaces it, or pick another --out_dir")
        if "summary.json" in existing:
            die(f"--out_dir {args.out_dir} already holds a finished run ({files}, no checkpoint): "
                "--overwrite replaces it, or pick another --out_dir")
        die(f"--out_dir {args.out_dir} holds a run stopped before its first checkpoint ({files}): "
            "--overwrite (or --resume) starts it again, or pick another --out_dir")
    return None, None


def take_saved_flags(args, given, rank):
    """--resume: every flag of the run the command line does not give comes from its checkpoint
    (the model, batch, recipe, --numerics, periods, length; the schedule: resume_schedule), so
    `--resume` alone continues the run; a flag given that differs is refused (load_resumable)."""
    names = [checkpoint_path(args, rank)]
    if "fsdp" not in given:  # an FSDP2 run's shards
        names.append(os.path.join(args.out_dir, f"ckpt_rank{rank}.pt"))
    path = next((name for name in names if os.path.isfile(name)), None)
    try:  # only its args: mapped, not read (a damaged file: load_checkpoint says what is wrong)
        saved = dict(torch.load(path, map_location="cpu", weights_only=False, mmap=True)["args"])
    except Exception:
        return
    for flag in (*RESUME_MUST_MATCH, "numerics", "eval_every", "log_every", "save_every"):
        if flag not in given and flag in saved:
            setattr(args, flag, saved[flag])
    if not given & {"max_steps", "max_tokens"} and "max_steps" in saved:
        args.max_steps = saved["max_steps"]


def load_resumable(args, ckpt_path, world_size, device):
    """The checkpoint to continue, after checking it is this run's (same model, batch, ranks...)."""
    try:
        ckpt = load_checkpoint(ckpt_path, device)
    except CheckpointError as e:
        die(f"--resume: {e}")
    for key in RESUME_MUST_MATCH:
        if ckpt["args"].get(key) != getattr(args, key):
            die(f"--{key} {getattr(args, key)!r}: the checkpoint {ckpt_path} was trained with "
                f"{ckpt['args'].get(key)!r}")
    if "numerics" not in ckpt:
        die(f"--resume: {ckpt_path} records no numerics (an older train.py wrote it), so this run "
            "cannot be checked against it: --overwrite reruns it")
    differ = numerics_differ(ckpt["numerics"], numerics(args, world_size))
    if differ:
        key, saved, now = differ
        die(f"--resume: {key} is {now} in this run, {saved} in the checkpoint {ckpt_path} (its "
            f"--numerics: {' '.join(ckpt['args']['numerics']) or 'none'}; this run's: "
            f"{' '.join(args.numerics) or 'none'})")
    if ckpt["world_size"] != world_size:
        die(f"--resume: checkpoint has {ckpt['world_size']} ranks, this run has {world_size}")
    if ckpt["step"] >= args.max_steps:
        die(f"--max_steps {args.max_steps}: the checkpoint {ckpt_path} is already at step "
            f"{ckpt['step']}; raise --max_steps")
    return ckpt


def resume_schedule(args, saved, explicit):
    """A resumed run keeps the checkpoint's schedule (lr, warmup, cosine length...) unless a flag
    says otherwise: a larger --max_steps alone must not stretch the cosine under a run that is half
    way down it. Returns a line saying what differs from the checkpoint."""
    changed = []
    for flag in SCHEDULE_FLAGS:
        if flag not in explicit:
            setattr(args, flag, saved[flag])
        elif getattr(args, flag) != saved[flag]:
            changed.append(f"--{flag} {saved[flag]:g} -> {getattr(args, flag):g}")
    note = "schedule " + ("changed: " + ", ".join(changed) if changed else "as in the checkpoint")
    end = max(args.lr_decay_steps, args.warmup)  # lr_factor: warmup, then the cosine, then min_lr
    if args.max_steps > end:
        note += (f"; the cosine ends at step {end}, steps {end + 1}-{args.max_steps} run at min_lr "
                 f"{args.min_lr:g} (--lr_decay_steps stretches it)")
    return note


def git_commit():
    """$NANOFP4_COMMIT when set (a copy of the tree, e.g. on a GPU machine, whose .git, if any, is
    not the tree's), else the checkout's commit, "+dirty" when tracked files differ; None outside
    git."""
    if os.environ.get("NANOFP4_COMMIT"):
        return os.environ["NANOFP4_COMMIT"]
    root = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, timeout=20,
                              capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               timeout=20, capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode:
        return None
    changed = dirty.returncode == 0 and dirty.stdout.strip()
    return head.stdout.strip() + ("+dirty" if changed else "")


def numerics(args, world_size):
    """Everything that decides the run's numbers and only what its recipe reads, resolved, as plain
    JSON: the number-changing flags it reads (read_flags), the recipe's layer choices (its attention
    after --attn_policy), the precision contracts after --numerics that its layers and optimizer
    read (whole tables: nvfp4.LINEAR for FP4 linears, optim.CONTRACT for quantized states, its
    attention policy, the LoRA branch's dtype, Root's fitted coefficients for the NVFP4
    Newton-Schulz), and the versions of the SR draw and encoding schemes where anything is FP4."""
    recipe = RECIPES[args.recipe]
    if args.attn_policy is not None:
        recipe = dataclasses.replace(recipe, attention=args.attn_policy)
    plain = lambda v: dataclasses.asdict(v) if isinstance(v, nvfp4.Quant) else v
    root, fp4 = args.optimizer == "root", recipe.optim_states != "fp32"
    contracts = {f"attention.POLICIES[{recipe.attention!r}]": attention.POLICIES[recipe.attention]}
    if recipe.linear != "bf16":
        contracts.update({f"nvfp4.LINEAR[{k!r}]": plain(v) for k, v in nvfp4.LINEAR.items()})
    if fp4:  # Root's entries only under Root (AdamW reads adamw.*)
        contracts.update({f"optim.CONTRACT[{k!r}]": plain(v) for k, v in optim.CONTRACT.items()
                          if root or k.startswith("adamw.")})
    if recipe.linear in LORA_LINEARS:
        contracts["lora_svd.BRANCH"] = lora_svd.BRANCH
    if root and fp4:
        contracts["optim root coefficients"] = {f"{m}x{n}": abc for (m, n), abc
                                                in sorted(optim._fitted().items())}
    quantizes = fp4 or recipe.linear != "bf16" or any(attention.POLICIES[recipe.attention].values())
    versions = ({"nvfp4.SR_SCHEME": nvfp4.SR_SCHEME, "nvfp4.ENCODING": nvfp4.ENCODING}
                if quantizes else {})
    return json.loads(json.dumps({
        "flags": {**{f: getattr(args, f) for f in read_flags(recipe)}, "world_size": world_size},
        "recipe": dataclasses.asdict(recipe), "contracts": contracts, "versions": versions}))


def read_flags(recipe):
    """The NUMERIC_FLAGS a run of `recipe` (resolved) reads: the LoRA branch's rank and lr only
    with a branch, its beta and the realignment period only LoRA-SVD's; --attn_policy through the
    recipe's attention."""
    unread = {"attn_policy"}
    if recipe.linear not in LORA_LINEARS:
        unread |= {"lora_rank", "lora_lr"}
    if recipe.linear != "lora_svd":
        unread |= {"lora_beta", "realign_every"}
    return [f for f in NUMERIC_FLAGS if f not in unread]


def numerics_differ(saved, now):
    """The first contract or scheme version where two numerics() differ: (key, saved, now), or
    None. (The flags are --resume's RESUME_MUST_MATCH.)"""
    for part in ("versions", "contracts"):
        for key in sorted(set(saved[part]) | set(now[part])):
            if saved[part].get(key) != now[part].get(key):
                return key, saved[part].get(key), now[part].get(key)
    return None


def numerics_id(numbers):
    """A short hash of numerics(): runs with the same id compute the same function."""
    return hashlib.sha256(json.dumps(numbers, sort_keys=True).encode()).hexdigest()[:12]


def run_settings(args, recipe, world_size):
    """Every resolved setting of the run: the flags after defaults and a resume, the recipe's
    fields, the tokens per step, the ranks, the numerics and their id, and the code's commit
    (summary.json, metrics.jsonl's header)."""
    ui_only = ("overwrite", "no_progress")
    settings = {k: v for k, v in vars(args).items() if k not in ui_only}
    numbers = numerics(args, world_size)
    return {**settings, "precision": dataclasses.asdict(recipe), "world_size": world_size,
            "tokens_per_step": args.batch_size * args.grad_accum * args.seq_len,
            "numerics_id": numerics_id(numbers), "numerics": numbers, "commit": git_commit(),
            "kernels": nvfp4.kernels_line(args.device)}


def settings_line(s):
    """The first log line: what this run is."""
    branch = s["precision"]["linear"] in LORA_LINEARS  # lora_rank and lora_lr: read by it only
    lora = f" | lora_rank {s['lora_rank']}" if branch else ""
    lora_lr = f" (lora {s['lora_lr']:g})" if branch else ""
    shape = "".join(f", {dim} {s[dim]}" for dim in SHAPE_FLAGS if s.get(dim) is not None)
    return (f"run: config {s['config']}{shape} | recipe {s['recipe']}{lora} | optimizer "
            f"{s['optimizer']} | lr {s['lr']:g}{lora_lr}, warmup {s['warmup']}, "
            f"cosine to {s['min_lr']:g} at step {s['lr_decay_steps']} | batch {s['batch_size']} "
            f"x grad_accum {s['grad_accum']} x seq_len {s['seq_len']} = "
            f"{s['tokens_per_step']:,} tokens/step | {s['max_steps']:,} steps | seed {s['seed']} | "
            f"numerics_id {s['numerics_id']} | commit {s['commit']} | route {s['route']}, "
            f"{s['kernels']}")


# --------------------------------------------------------------------------------------------------
# Will it fit? The data and the memory, checked before anything trains

def check_fits(args, cfg, train_tokens, world_size):
    """A step that needs more tokens than the train split, or a micro-batch that clearly cannot fit
    the memory: one line and exit 2 now, not a traceback minutes later."""
    tokens_per_step = args.batch_size * args.grad_accum * args.seq_len
    if tokens_per_step > train_tokens:
        die(f"--batch_size {args.batch_size} x --grad_accum {args.grad_accum} x --seq_len "
            f"{args.seq_len} = {tokens_per_step:,} tokens a step: more than the {train_tokens:,} "
            f"tokens of the train split in --data {args.data}; lower --batch_size, or use more "
            "data")
    need, parts = memory_lower_bound(args, cfg, world_size)
    have = available_memory_bytes(args.device)
    if have is not None and need > have:
        where = "this GPU has" if args.device == "cuda" else "this machine has"
        die(f"--batch_size {args.batch_size} x --seq_len {args.seq_len}: a micro-step needs at "
            f"least {need / 2**30:.1f} GiB ({parts}) and {where} {have / 2**30:.1f} GiB free; "
            "lower --batch_size (raise --grad_accum to keep the tokens per step) or --seq_len")


def memory_lower_bound(args, cfg, world_size):
    """Bytes one rank needs at least, and how they split: fp32 weights + gradients (8 bytes a
    parameter, before any optimizer state), the logits with their fp32 copy and gradient (the
    largest activation of a small model), and per layer the activations its backward keeps (hidden
    x 4 + FFN x 3 per token). Everything else (optimizer states, attention, workspace) comes on
    top, so a batch above this bound cannot run."""
    with torch.device("meta"):  # parameter count without memory (BF16 layers: LoRA adds ~1%)
        n_params = GPT(dataclasses.replace(cfg, recipe=RECIPES["bf16"])).num_params()
    tokens = args.batch_size // world_size * args.seq_len
    act = 2 if args.dtype == "bfloat16" else 4
    weights = 8 * n_params // (world_size if args.fsdp else 1)
    logits = tokens * cfg.vocab_size * (act + 8)
    layers = cfg.n_layer * tokens * (4 * cfg.n_embd + 3 * cfg.ffn_hidden) * act
    gib = lambda n: f"{n / 2**30:.1f}"
    return weights + logits + layers, (f"weights + grads {gib(weights)}, logits {gib(logits)}, "
                                       f"layer activations {gib(layers)} GiB")


def available_memory_bytes(device):
    """Free memory for one rank: the GPU's free bytes, or the machine's MemAvailable shared by the
    ranks on it; None when unknown."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024 // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


# --------------------------------------------------------------------------------------------------
# The run's state, built once: the model, optimizer, data and where the files go

@dataclasses.dataclass
class Run:
    """Everything a step, an eval and a checkpoint read: main's loop passes this one object."""
    args: argparse.Namespace
    recipe: object
    cfg: GPTConfig
    model: torch.nn.Module  # what the forward runs (DDP / compiled wrapper, or raw_model itself)
    raw_model: GPT
    optimizer: torch.optim.Optimizer
    loader: data.TokenLoader
    val_path: str
    device: str
    autocast: object  # a function: `with run.autocast():` enters a fresh context each time
    rank: int = 0
    world_size: int = 1
    step: int = 0
    saved_step: int = None  # the step of the last checkpoint written or resumed from
    bar: object = None  # tqdm progress bar (a terminal only)
    progress: object = None  # StepProgress: a long step's sign of life

    @property
    def master(self):
        return self.rank == 0

    @property
    def distributed(self):
        return self.world_size > 1

    @property
    def ckpt_path(self):
        return checkpoint_path(self.args, self.rank)

    @property
    def metrics_path(self):
        return os.path.join(self.args.out_dir, "metrics.jsonl")

    @property
    def tokens_per_step(self):
        return self.args.batch_size * self.args.grad_accum * self.args.seq_len


def checkpoint_path(args, rank):
    return os.path.join(args.out_dir, f"ckpt_rank{rank}.pt" if args.fsdp else "ckpt.pt")


def build_run(args, recipe, device, rank, world_size):
    """Process group, data (the default corpus is built on first use), the fit checks, then the
    model (same init on every rank) and its optimizer."""
    if world_size > 1:
        if args.device == "cuda":
            torch.cuda.set_device(device)
        torch.distributed.init_process_group(backend="nccl" if args.device == "cuda" else "gloo")
    set_cpu_threads(recipe, args.device)
    try:
        if rank == 0 and os.path.normpath(args.data) == os.path.normpath(data.DEFAULT_DIR):
            data.prepare_default(args.data)  # rank 0 builds, the others wait
        if world_size > 1:
            torch.distributed.barrier()
        paths = data.shard_paths(args.data)
        loader = data.TokenLoader(paths["train"], args.batch_size // world_size, args.seq_len, rank,
                                  world_size, seed=args.seed)
        data.TokenLoader(paths["val"], 1, args.seq_len)  # evaluate()'s windows fit in val
    except (FileNotFoundError, ValueError, RuntimeError) as e:  # e.g. a corpus package missing
        die(f"--data {args.data}: {e}")
    cfg = config_from_name(args.config, recipe=recipe, lora_rank=args.lora_rank,
                           lora_beta=args.lora_beta, **model_shape(args))
    if rank == 0:
        print(model_line(args, cfg, world_size, len(loader.tokens)), flush=True)
    check_fits(args, cfg, len(loader.tokens), world_size)
    torch.manual_seed(args.seed)
    with still_at(rank == 0, "building the model and its optimizer"):
        with torch.device(device):
            model = GPT(cfg)
        if args.fsdp:  # FSDP2: shard each block, then the root (embeddings, norm, lm_head)
            from torch.distributed.fsdp import fully_shard
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        optimizer = optim.build_optimizer(
            model, optimizer=args.optimizer, states=recipe.optim_states, lr=args.lr,
            lora_lr=args.lora_lr, weight_decay=args.weight_decay, betas=(0.9, 0.95))
    amp = torch.bfloat16 if args.dtype == "bfloat16" else None
    # a fresh context per use: one torch.autocast object entered twice, nested (an eval through
    # GraphedMicroStep), restores the inner state on exit and leaves autocast on for what follows
    autocast = (functools.partial(torch.autocast, args.device, dtype=amp) if amp
                else contextlib.nullcontext)
    return Run(args, recipe, cfg, model, model, optimizer, loader, paths["val"], device, autocast,
               rank, world_size)


def model_line(args, cfg, world_size, train_tokens):
    """The second log line, printed before the model is built: its size (counted on the meta
    device), recipe, ranks and data."""
    with torch.device("meta"):
        n_params = GPT(cfg).num_params()
    epochs = args.max_steps * args.batch_size * args.grad_accum * args.seq_len / train_tokens
    ranks = " FSDP2" if args.fsdp else " DDP" if world_size > 1 else ""
    return (f"model {n_params / 1e6:.2f}M params, {cfg.recipe.describe()} | {world_size} rank(s) "
            f"on {args.device}{ranks} | data {args.data}: {train_tokens:,} train tokens, "
            f"{epochs:.3g} epochs | -> {args.out_dir}/")


@contextlib.contextmanager
def still_at(master, what):
    """A phase that can take minutes (a 1b model built on a CPU: its LoRA-SVD init is an SVD per
    layer) says so every PROGRESS_EVERY seconds while it lasts; a short one prints nothing."""
    done, t0 = threading.Event(), time.perf_counter()

    def watch():
        while not done.wait(PROGRESS_EVERY):
            print(f"{what}: {time.perf_counter() - t0:.0f} s so far", flush=True)
    thread = threading.Thread(target=watch, daemon=True)
    if master:
        thread.start()
    try:
        yield
    finally:
        done.set()
        if thread.is_alive():
            thread.join()


def begin(run, ckpt, settings):
    """Put a resumed run back where its checkpoint left it, or clear --out_dir for a fresh one; then
    the per-rank streams, the DDP / compile wrappers and the progress bar."""
    args = run.args
    if ckpt is not None:
        base_lrs = [g["base_lr"] for g in run.optimizer.param_groups]  # this run's schedule
        try:
            run.raw_model.load_state_dict(ckpt["model"])
            run.optimizer.load_state_dict(ckpt["optimizer"])
            run.loader.load_state_dict(ckpt["loader"])
        except (RuntimeError, ValueError, KeyError) as e:
            reason = str(e).strip().splitlines()[0]
            die(f"--resume: {run.ckpt_path} does not fit this run ({reason})")
        for group, base_lr in zip(run.optimizer.param_groups, base_lrs):
            group["base_lr"] = base_lr
        run.step = run.saved_step = ckpt["step"]
        set_rng_state(ckpt["ranks"][run.rank]["rng"])  # each rank's own SR / Hadamard streams
        if run.master:  # rows after the checkpoint (a crash between two saves) go
            rows = [r for r in read_metrics(run.metrics_path) if r["step"] <= run.step]
            rows.append({"step": run.step, "resumed": settings})
            with open(run.metrics_path, "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
    else:
        torch.manual_seed(args.seed + 1000 * run.rank)  # per-rank SR / Hadamard streams
        if run.master:  # a fresh run (--overwrite, or a --resume with no checkpoint: old files go)
            os.makedirs(args.out_dir, exist_ok=True)
            for name in existing_run_files(args.out_dir):
                os.remove(os.path.join(args.out_dir, name))
            with open(run.metrics_path, "w") as f:
                f.write(json.dumps({"step": 0, "settings": settings}) + "\n")
    if run.distributed and not args.fsdp:
        device_ids = [torch.device(run.device).index] if args.device == "cuda" else None
        run.model = torch.nn.parallel.DistributedDataParallel(run.model, device_ids=device_ids)
    if args.compile:  # the FP4 layers as custom ops in the graph
        run.model = compile_model(run.model, "reduce-overhead" if args.cuda_graphs else None)
    elif args.cuda_graphs:
        run.model = GraphedMicroStep(run.model, run.autocast, (args.batch_size, args.seq_len),
                                     run.device)
    if args.cuda_graphs:
        graph_grads(run.raw_model)
    if run.master and not args.no_progress and sys.stderr.isatty():  # a log file gets plain lines
        from tqdm import tqdm
        run.bar = tqdm(total=args.max_steps, initial=run.step, desc="train", dynamic_ncols=True)


# --------------------------------------------------------------------------------------------------
# One step, one eval, one checkpoint

def compute_gradients(run):
    """One optimizer step's gradients: grad_accum micro-batches (gradient sync on the last only),
    the LoRA-SVD projection of eqs. 3-4, clipping. Returns (mean loss, grad norm) as 0-d tensors
    (no host sync here)."""
    args, model = run.args, run.model
    loss_sum = torch.zeros((), device=run.device)
    for micro in range(args.grad_accum):
        x, y = run.loader.next_batch()
        if args.device == "cuda":  # pinned memory: the copies are truly asynchronous (from pageable
            x, y = x.pin_memory(), y.pin_memory()  # memory a host-to-device copy syncs the stream)
        x, y = x.to(run.device, non_blocking=True), y.to(run.device, non_blocking=True)
        last = micro == args.grad_accum - 1
        if args.fsdp:
            model.set_requires_gradient_sync(last)
        no_sync = run.distributed and not args.fsdp and not last
        with model.no_sync() if no_sync else contextlib.nullcontext():
            with run.autocast():
                _, loss = model(x, y)
            (loss / args.grad_accum).backward()
        loss_sum += loss.detach()
        if run.progress is not None:
            run.progress.micro_done()
    loss_mean = loss_sum / args.grad_accum
    if run.distributed:
        torch.distributed.all_reduce(loss_mean, op=torch.distributed.ReduceOp.AVG)
    if run.recipe.linear == "lora_svd":  # eqs. 3-4 split dW into dW_res, dL1, dL2 here, so that the
        lora_svd.project_all(run.raw_model)  # clipped norm is that of the gradients applied
    clip = args.clip if args.clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(run.raw_model.parameters(), clip)
    if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor
        grad_norm = grad_norm.full_tensor()
    return loss_mean, grad_norm


class _Loss(torch.nn.Module):
    """model(x, y)'s loss under the run's autocast: the module GraphedMicroStep captures."""

    def __init__(self, model, autocast):
        super().__init__()
        self.model, self.autocast = model, autocast

    def forward(self, x, y):
        with self.autocast():
            return self.model(x, y)[1]


class GraphedMicroStep(torch.nn.Module):
    """--cuda_graphs without --compile: the micro-step's forward and backward captured as CUDA
    graphs (torch.cuda.make_graphed_callables) and replayed, so the host launches two graphs instead
    of thousands of kernels; returns (None, loss) as the model does (an eval runs eagerly). Nothing
    in them waits for the host: the global amaxes and scales stay on the device, and every SR seed
    and Hadamard sign is drawn there by torch's CUDA RNG (nvfp4.sr_seed), whose Philox offset each
    replay advances, so a replay draws what eager would from the same RNG state. The warm-up and
    capture run with the RNG forked: the run's streams stay an eager run's."""

    def __init__(self, model, autocast, batch_shape, device):
        super().__init__()
        self.loss = _Loss(model, autocast)
        x = torch.zeros(batch_shape, dtype=torch.long, device=device)  # (sequences, seq_len)
        with torch.random.fork_rng(devices=[torch.device(device)]):
            torch.cuda.make_graphed_callables(self.loss, (x, x.clone()), allow_unused_input=True)

    def forward(self, x, y):
        nvfp4.refresh_weights(self.loss)  # the graphs read each layer's quantized W in place
        return None, self.loss(x, y)


def graph_grads(model):
    """--cuda_graphs: every gradient allocated once and zeroed in place from here on
    (zero_grad(set_to_none=False)), so each micro-step adds into it. A backward graph writes its
    gradients into fixed buffers, which autograd would otherwise take over as .grad on a step's
    first micro-step and the next replay overwrite. (0 + g is g, up to the sign of a zero.)"""
    for p in model.parameters():
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)


@torch.no_grad()
def evaluate(run):
    """Mean val loss over eval_iters fixed batches (a fresh loader: every eval sees the same data).
    The RNG is forked so evaluation never shifts the training streams (SR, Hadamard signs): resume
    stays exact."""
    args = run.args
    loader = data.TokenLoader(run.val_path, args.batch_size // run.world_size, args.seq_len,
                              run.rank, run.world_size, seed=1234)
    run.model.eval()
    devices = [torch.cuda.current_device()] if args.device == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        losses = torch.zeros(args.eval_iters, device=run.device)
        for i in range(args.eval_iters):
            x, y = loader.next_batch()
            with run.autocast():
                _, loss = run.model(x.to(run.device), y.to(run.device))
            losses[i] = loss.float()
    run.model.train()
    val_loss = losses.mean()
    if run.distributed:
        torch.distributed.all_reduce(val_loss, op=torch.distributed.ReduceOp.AVG)
    return val_loss.item()


def save_checkpoint(run):
    """ckpt.pt (ckpt_rank{r}.pt under FSDP2): model, optimizer, step, every rank's RNG and loader
    state, config, args and numerics; then loss.png."""
    states = {"rng": rng_state(), "loader": run.loader.state_dict()}
    all_states = [states]
    if run.distributed:
        all_states = [None] * run.world_size
        torch.distributed.all_gather_object(all_states, states)
    if run.master or run.args.fsdp:
        atomic_save({"model": run.raw_model.state_dict(), "optimizer": run.optimizer.state_dict(),
                     "step": run.step, "loader": states["loader"], "ranks": all_states,
                     "world_size": run.world_size, "config": dataclasses.asdict(run.cfg),
                     "args": vars(run.args), "numerics": numerics(run.args, run.world_size)},
                    run.ckpt_path)
    run.saved_step = run.step
    if run.master:
        plot_metrics(run.args.out_dir, title(run.args))


def log(run, row):
    if run.master:
        with open(run.metrics_path, "a") as f:
            f.write(json.dumps(row) + "\n")


def say(run, line):
    """A line of the log, above the progress bar if there is one."""
    if run.master:
        run.bar.write(line) if run.bar is not None else print(line, flush=True)


def stop(run, why, code):
    """Leave mid-run (Ctrl-C, a crash we catch, a non-finite loss): one line saying what is on disk
    and what --resume will do, then exit with `code`."""
    if run.bar is not None:
        run.bar.close()
    if run.saved_step is None:
        kept = "no checkpoint was written yet: --resume starts the run again"
    elif code == 1:
        kept = f"the last good checkpoint is {run.ckpt_path} (step {run.saved_step})"
    else:
        kept = f"--resume continues from {run.ckpt_path} (step {run.saved_step})"
    if run.master:
        print(f"train.py: {why}; {kept}", file=sys.stderr, flush=True)
    if run.distributed and code == 1:  # every rank saw the same reduced loss: all leave together
        torch.distributed.destroy_process_group()
    sys.exit(code)


class Throughput:
    """Tokens/s over training time only (no eval or checkpoint time): per log interval, and for the
    summary without the first tenth of the steps (compile, warmup)."""

    def __init__(self, run):
        self.run, self.start = run, run.step
        left = run.args.max_steps - run.step
        self.skip = min(left - 1, max(1, left // 10))
        self.total = self.total_tokens = self.interval = self.interval_tokens = 0.0
        if run.args.device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def tic(self):
        self.t0 = time.perf_counter()

    def toc(self):
        """The step just done: add its time (after the GPU has finished it)."""
        if self.run.args.device == "cuda":
            torch.cuda.synchronize()
        dt, tokens = time.perf_counter() - self.t0, self.run.tokens_per_step
        if self.run.step - self.start > self.skip:
            self.total, self.total_tokens = self.total + dt, self.total_tokens + tokens
        self.interval, self.interval_tokens = self.interval + dt, self.interval_tokens + tokens

    def interval_rate(self):
        rate = self.interval_tokens / self.interval
        self.interval = self.interval_tokens = 0.0
        return rate

    def rate(self):
        return self.total_tokens / self.total if self.total > 0 else float("nan")


class StepProgress:
    """A step that runs for minutes (a big config on a CPU) says how far it is: a daemon thread
    prints, every PROGRESS_EVERY seconds of a step, the micro-steps done and, from the first one,
    about how long the step's micro-steps take. A step shorter than that prints nothing."""

    def __init__(self, run):
        self.run, self.t0, self.done, self.first = run, None, 0, None
        self.stopped, self.thread = threading.Event(), threading.Thread(target=self.watch,
                                                                         daemon=True)
        if run.master:
            self.thread.start()

    def start(self):
        self.done, self.first, self.t0 = 0, None, time.perf_counter()

    def micro_done(self):
        self.done += 1
        if self.done == 1:
            self.first = time.perf_counter() - self.t0

    def end(self):
        self.t0 = None

    def watch(self):
        while not self.stopped.wait(PROGRESS_EVERY):
            t0, done, first, accum = self.t0, self.done, self.first, self.run.args.grad_accum
            if t0 is None or time.perf_counter() - t0 < PROGRESS_EVERY:
                continue
            line = (f"step {self.run.step + 1}/{self.run.args.max_steps}: {done}/{accum} "
                    f"micro-steps done, {time.perf_counter() - t0:.1f} s into the step")
            if first is not None:
                line += f", about {first * accum:.1f} s of micro-steps a step (from the first)"
            say(self.run, line + ("; clipping and the optimizer update" if done == accum else ""))

    def close(self):
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()  # no line after the run's last


def bf16_peak_flops(device):
    """The dense BF16 peak of this GPU (BF16_PEAK_FLOPS), None on a CPU or a GPU not listed."""
    if torch.device(device).type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for part, peak in BF16_PEAK_FLOPS if part in name), None)


def mfu(run, tokens_per_s):
    """Model FLOPs utilization against this GPU's BF16 peak (every recipe against it); None on a
    CPU or a GPU whose peak BF16_PEAK_FLOPS does not list."""
    peak = bf16_peak_flops(run.device)
    if peak is None:
        return None
    flops = run.raw_model.flops_per_token(run.args.seq_len) * tokens_per_s
    return flops / (peak * run.world_size)


def log_step(run, loss, grad_norm, lr_scale, tok_s):
    """A metrics row, and a log line (or the progress bar's text)."""
    row = {"step": run.step, "loss": loss, "lr": run.args.lr * lr_scale, "grad_norm": grad_norm,
           "tokens": run.step * run.tokens_per_step, "tokens_per_s": tok_s}
    if run.args.device == "cuda":
        row["mfu"] = mfu(run, tok_s)
    log(run, row)
    speed = f"{tok_s:,.0f} tok/s" + (f" | mfu {100 * row['mfu']:.1f}%" if row.get("mfu") is not None
                                       else "")
    if run.bar is not None:
        run.bar.set_postfix_str(f"loss {loss:.4f} | {speed}")
    else:
        say(run, f"step {run.step}/{run.args.max_steps} | loss {loss:.4f} | lr {row['lr']:.2e} | "
            f"{speed}")


def finish(run, settings, loss, val_loss, tok_s):
    """summary.json (the run's record: settings, losses, speed, memory), loss.png, the last line."""
    args = run.args
    opt_bytes = optimizer_state_bytes(run.optimizer, args.fsdp, run.device)  # every rank calls it
    if not run.master:
        return
    plot_metrics(args.out_dir, title(args))
    n_params = run.raw_model.num_params()
    tokens = run.step * run.tokens_per_step
    epochs = args.max_steps * run.tokens_per_step / len(run.loader.tokens)
    summary = {"config": args.config, "recipe": args.recipe, "precision": settings["precision"],
               "optimizer": args.optimizer, "seed": args.seed, "params": n_params,
               "steps": run.step, "tokens": tokens, "epochs": epochs, "final_loss": loss,
               "final_val_loss": val_loss, "world_size": run.world_size, "fsdp": args.fsdp,
               "compile": args.compile, "device": args.device, "dtype": args.dtype,
               "tokens_per_s": tok_s, "mfu": mfu(run, tok_s),
               "flops_per_token": run.raw_model.flops_per_token(args.seq_len),
               "peak_mem_bytes": peak_memory_bytes(args.device),
               "peak_mem_kind": ("torch.cuda.max_memory_allocated (rank 0)" if args.device == "cuda"
                                 else "max RSS"),
               "optimizer_state_bytes": opt_bytes,
               "optimizer_bytes_per_param": opt_bytes / n_params,
               "checkpoint": run.ckpt_path if run.saved_step == run.step else None,
               "numerics_id": settings["numerics_id"], "commit": settings["commit"],
               "kernels": settings["kernels"], "settings": settings}
    with open(os.path.join(args.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    val = "none" if val_loss is None else f"{val_loss:.4f}"
    files = "metrics.jsonl, loss.png, summary.json" + (
        f", {os.path.basename(run.ckpt_path)}" if summary["checkpoint"] else "; no checkpoint "
        "(--save_every -1)")
    print(f"done: {run.step} steps, loss {loss:.4f}, val {val}, {tok_s:,.0f} tokens/s, peak mem "
          f"{summary['peak_mem_bytes'] / 2**30:.2f} GiB, optimizer state "
          f"{summary['optimizer_bytes_per_param']:.2f} bytes/param -> {args.out_dir}/ ({files})")


def main(argv=None):
    args, given = parse_args(argv), given_flags(argv)
    explicit = given & set(SCHEDULE_FLAGS)  # by hand
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if args.resume:
        take_saved_flags(args, given, rank)  # the run's own flags, unless given
    recipe = resolve_args(args, world_size)
    device = f"cuda:{local_rank}" if args.device == "cuda" else "cpu"
    ckpt, note = open_out_dir(args, checkpoint_path(args, rank), world_size, explicit, device)
    fill_schedule(args)
    settings = run_settings(args, recipe, world_size) if rank == 0 else None
    if rank == 0:  # the first line before anything slow (a 1b model built on a CPU takes minutes)
        print(settings_line(settings), flush=True)
    run = build_run(args, recipe, device, rank, world_size)  # data, fit checks, model, optimizer
    begin(run, ckpt, settings)  # resumed state or a clean --out_dir; DDP / compile wrappers
    ckpt = None
    if run.master and note:
        print(note)

    clock, run.progress = Throughput(run), StepProgress(run)
    loss, val_loss = float("nan"), None
    try:
        while run.step < args.max_steps:
            clock.tic()
            run.progress.start()
            lr_scale = lr_factor(run.step, args)
            for group in run.optimizer.param_groups:
                group["lr"] = group["base_lr"] * lr_scale
            loss, grad_norm = (t.item() for t in compute_gradients(run))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                stop(run, f"non-finite loss {loss} / grad norm {grad_norm} at step {run.step + 1}: "
                     "stopped before the update", code=1)
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=not args.cuda_graphs)  # graphs: see graph_grads
            run.step += 1
            step = run.step
            realign = args.realign_every and step % args.realign_every == 0
            if recipe.linear == "lora_svd" and realign:  # §3.2: re-split W into top r + the rest
                lora_svd.realign_model(run.raw_model, run.optimizer)
            clock.toc()
            run.progress.end()

            if step % args.log_every == 0 or step == args.max_steps:
                log_step(run, loss, grad_norm, lr_scale, clock.interval_rate())
            if run.bar is not None:
                run.bar.update(1)
            if args.eval_every and (step % args.eval_every == 0 or step == args.max_steps):
                val_loss = evaluate(run)
                log(run, {"step": step, "val_loss": val_loss, "tokens": step * run.tokens_per_step})
                say(run, f"step {step}: train loss {loss:.4f}, val loss {val_loss:.4f}")
            periodic = args.save_every > 0 and step % args.save_every == 0
            if args.save_every >= 0 and (periodic or step == args.max_steps):
                save_checkpoint(run)
    except KeyboardInterrupt:  # Ctrl-C: no traceback; the last checkpoint is whole (atomic_save)
        stop(run, f"interrupted at step {run.step}", code=130)
    finally:
        run.progress.close()
    if run.bar is not None:
        run.bar.close()

    finish(run, settings, loss, val_loss, clock.rate())
    if run.distributed:  # the other ranks wait for rank 0's plot and summary, then all leave
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------------------------------
# Helpers: RNG state, atomic checkpoints, metrics, memory, CPU threads

def title(args):
    return f"{args.config} / {args.recipe} / {args.optimizer}"


def rng_state():
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()  # this rank's device only
    return state


def set_rng_state(state):
    # .cpu(): a checkpoint loaded onto the GPU (map_location) moved the ByteTensors there
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def atomic_save(obj, path):
    """Write path.tmp, fsync, rename over path: until the rename the previous checkpoint stays
    whole, so a run killed while saving leaves the last complete one (and a stale path.tmp, which
    the next save replaces)."""
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
    except Exception as e:  # a damaged file raises many types (RuntimeError, UnpicklingError...)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path}: truncated or not a checkpoint ({size:,} bytes; torch.load: "
                              f"{reason})") from None
    missing = {"model", "optimizer", "step", "config", "args"} - set(ckpt if isinstance(ckpt, dict)
                                                                     else ())
    if missing:
        missing = ", ".join(sorted(missing))
        raise CheckpointError(f"{path}: not a train.py checkpoint (no {missing})")
    try:
        GPTConfig(**ckpt["config"])
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: its model config does not fit this model.py ({e})") \
            from None
    return ckpt


def optimizer_state_bytes(optimizer, fsdp, device):
    """Bytes of optimizer state over the whole model. Without FSDP every rank holds all of it;
    with FSDP2 each rank holds its shard (DTensor states: their local part; optim.py's packed NVFP4
    states are local tensors already)."""
    if not fsdp and hasattr(optimizer, "state_nbytes"):
        return int(optimizer.state_nbytes())
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t
    total = sum(local(v).nbytes for state in optimizer.state.values() for v in state.values()
                if torch.is_tensor(v))
    if fsdp and torch.distributed.is_initialized():  # every rank must call this
        total = torch.tensor(float(total), device=device)
        torch.distributed.all_reduce(total)
    return int(total)


def read_metrics(path):
    """metrics.jsonl's rows: the header (step 0, "settings"), then logged steps and evals."""
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


def peak_memory_bytes(device):
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def set_cpu_threads(recipe, device):
    """One thread for FP4 recipes on CPU unless OMP_NUM_THREADS says otherwise: their reference
    paths are thousands of small ops a step, where OpenMP fan-out costs more than it gains
    (docs/model_and_train.md has the measurement)."""
    fp4 = recipe.linear != "bf16" or recipe.attention != "bf16"
    if device == "cpu" and fp4 and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)


def cli(argv=None):
    """`python train.py`: main(), and a Ctrl-C before the first step (building the corpus or the
    model) as one line, exit 130; the loop handles its own (main's `stop`)."""
    try:
        main(argv)
    except KeyboardInterrupt:
        print("train.py: interrupted before the first step; --out_dir is as it was",
              file=sys.stderr, flush=True)
        sys.exit(130)


if __name__ == "__main__":
    cli()
