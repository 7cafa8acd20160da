"""
Generate text from a train.py checkpoint (any recipe: the model is rebuilt with the checkpoint's
recipe, precision contracts (its --numerics) and autocast dtype).

    python sample.py --out_dir out --prompt "To be, or not to be" --max_new_tokens 100 --temperature
    0.8 --top_k 50
"""
import argparse
import os
import sys

import torch

import data
from model import GPT, GPTConfig
from train import (CheckpointError, load_checkpoint, numerics, numerics_differ, set_cpu_threads,
                   set_numerics)


def die(msg):
    """Bad input: one line on stderr, exit 2."""
    print(f"sample.py: error: {msg}", file=sys.stderr, flush=True)
    sys.exit(2)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = die  # argparse's usage + error -> one line, exit 2
    p.add_argument("--out_dir", default="out",
                   help="the train.py run to sample (default: %(default)s)")
    p.add_argument("--ckpt", default=None, help="checkpoint path (default: <out_dir>/ckpt.pt)")
    p.add_argument("--prompt", default="\n", help="start text (default: a newline)")
    p.add_argument("--num_samples", type=int, default=2, help="(default: %(default)s)")
    p.add_argument("--max_new_tokens", type=int, default=100, help="(default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.8,
                   help="0: greedy (default: %(default)s)")
    p.add_argument("--top_k", type=int, default=50, help="0: no top-k (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="(default: %(default)s)")
    args = p.parse_args(argv)
    path = args.ckpt or os.path.join(args.out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        die(f"{path}: no such checkpoint (train.py writes <out_dir>/ckpt.pt; FSDP runs write "
            "per-rank shards, which "
            "this script does not read)")
    no_gpu = args.device == "cuda" and not torch.cuda.is_available()
    if args.device not in ("cpu", "cuda") or no_gpu:
        die(f"--device {args.device!r}: expected cpu, or cuda on a machine with a GPU")
    if args.temperature < 0 or args.top_k < 0 or args.max_new_tokens < 0 or args.num_samples < 1:
        die("--temperature, --top_k and --max_new_tokens must be >= 0, --num_samples >= 1")
    try:  # first: its files missing is one line now, not after minutes of loading
        enc = data.get_tokenizer()
    except RuntimeError as e:
        die(str(e))
    print(f"# loading {path} onto {args.device}", flush=True)  # a 1b checkpoint takes minutes
    try:
        ckpt = load_checkpoint(path, args.device)
    except CheckpointError as e:
        die(str(e))
    run = ckpt["args"]
    for spec in run["numerics"]:  # the contracts the run trained with, then checked against its own
        set_numerics(spec)
    differ = "numerics" in ckpt and numerics_differ(
        ckpt["numerics"], numerics(argparse.Namespace(**run), ckpt["world_size"]))
    if differ:
        die(f"{path}: trained with {differ[0]} = {differ[1]}, this code gives {differ[2]}: the "
            "model it trained cannot be rebuilt here")
    cfg = GPTConfig(**ckpt["config"])
    set_cpu_threads(cfg.recipe, args.device)
    print(f"# building the model: config {run['config']}, recipe {run['recipe']}, step "
          f"{ckpt['step']}", flush=True)
    with torch.device(args.device):
        model = GPT(cfg)
    model.load_state_dict(ckpt["model"])
    model.eval()
    torch.manual_seed(args.seed)

    ids = enc.encode(args.prompt, allowed_special={"<|endoftext|>"})
    if not ids:
        die("--prompt: empty; give at least one character")
    if max(ids) >= cfg.vocab_size:
        die(f"--prompt: token ids above the model's vocab_size {cfg.vocab_size}")
    x = torch.tensor(ids, dtype=torch.long, device=args.device).expand(args.num_samples, -1)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=run["dtype"] == "bfloat16")
    print(f"# generating {args.num_samples} x {args.max_new_tokens} tokens on {args.device} (no "
          "KV cache: each token runs the whole context)", flush=True)
    with autocast:
        out = model.generate(x, args.max_new_tokens, temperature=args.temperature,
                             top_k=args.top_k or None)
    print(f"# {path}: step {ckpt['step']}, config {run['config']}, recipe {run['recipe']}")
    for row in out.tolist():
        print(enc.decode([t for t in row if t < enc.n_vocab]))  # padded ids (>= 50257) have no text
        print("-" * 60)


if __name__ == "__main__":
    main()
