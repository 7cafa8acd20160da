"""
Generate text from a train.py checkpoint (any recipe: the model is rebuilt with the checkpoint's precision policy).

    python sample.py --out_dir out --prompt "To be, or not to be" --max_new_tokens 100 --temperature 0.8 --top_k 50
"""
import argparse
import os
import sys

import torch

from model import GPT, GPTConfig


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out_dir", default="out", help="directory holding ckpt.pt (from train.py)")
    p.add_argument("--ckpt", default=None, help="checkpoint path (default: <out_dir>/ckpt.pt)")
    p.add_argument("--prompt", default="\n", help="start text")
    p.add_argument("--num_samples", type=int, default=2)
    p.add_argument("--max_new_tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top_k", type=int, default=50, help="0: no top-k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args(argv)
    path = args.ckpt or os.path.join(args.out_dir, "ckpt.pt")
    if not os.path.isfile(path):
        sys.exit(f"sample.py: error: --ckpt {path}: no such checkpoint (train.py writes <out_dir>/ckpt.pt; "
                 "FSDP runs write per-rank shards, which this script does not read)")
    if args.temperature < 0 or args.top_k < 0 or args.max_new_tokens < 0:
        sys.exit("sample.py: error: --temperature, --top_k and --max_new_tokens must be >= 0")

    ckpt = torch.load(path, map_location=args.device, weights_only=False)
    cfg = GPTConfig(**ckpt["config"])
    with torch.device(args.device):
        model = GPT(cfg)
    model.load_state_dict(ckpt["model"])
    model.eval()
    torch.manual_seed(args.seed)

    import data
    enc = data.get_tokenizer()
    ids = enc.encode(args.prompt, allowed_special={"<|endoftext|>"})
    if max(ids, default=0) >= cfg.vocab_size:
        sys.exit(f"sample.py: error: --prompt: token ids above the model's vocab_size {cfg.vocab_size}")
    x = torch.tensor(ids, dtype=torch.long, device=args.device).expand(args.num_samples, -1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if args.device == "cuda" else torch.autocast("cpu", enabled=False)
    with autocast:
        out = model.generate(x, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k or None)
    print(f"# {path}: step {ckpt['step']}, config {ckpt['args']['config']}, recipe {ckpt['args']['recipe']}")
    for row in out.tolist():
        print(enc.decode([t for t in row if t < enc.n_vocab]))  # padded ids (>= 50257) have no text
        print("-" * 60)


if __name__ == "__main__":
    main()
