"""
The CPU probe behind README.md's `lora_naive` / Root table: a micro GPT trained with the repository's own modules
(model.GPT, optim.build_optimizer, lora_svd.NaiveLoRALinear / project_all), small enough for dozens of CPU runs.
Run from the repository root (the numbers in lora_naive_probe.json came from commit eb03e8a's modules):

    python results/ablation/lora_naive_probe.py OUT.jsonl bf16:root:0:1e-3: bf16_lora:root:0:1e-3:1e-3 ...

Each argument is recipe:optimizer:seed:lr:lora_lr (empty lora_lr: 2 x lr, train.py's default). Recipes: the
linear policies of model.make_linear (bf16, nvfp4, nvfp4_46, lora_naive, lora_svd), and bf16_lora: naive LoRA
with its main weight in BF16 (the branch without quantization noise). Besides the val loss, each run records the
spectral norm and the RMS of one optimizer step of every block linear's effective weight (W + L2 L1 for naive
LoRA), divided by the lr, averaged over the layers and every 10th step.
"""
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.getcwd())
import data  # noqa: E402
import lora_svd  # noqa: E402
import model  # noqa: E402
import optim  # noqa: E402

VOCAB = 2048  # the 2047 most frequent GPT-2 tokens of the train split + one out-of-vocabulary id
STEPS, BATCH, SEQ, WARMUP, RANK, WIDTH, LAYERS = 150, 8, 128, 20, 8, 128, 2


def corpus(data_dir="data_cache/default"):
    train = np.asarray(data.read_shard(os.path.join(data_dir, "train.bin"))).astype(np.int64)
    val = np.asarray(data.read_shard(os.path.join(data_dir, "val.bin"))).astype(np.int64)
    top = np.argsort(-np.bincount(train, minlength=50304))[: VOCAB - 1]
    remap = np.full(50304, VOCAB - 1, dtype=np.int64)
    remap[top] = np.arange(VOCAB - 1)
    return torch.from_numpy(remap[train]), torch.from_numpy(remap[val])


def batch(tokens, B, T, generator):
    starts = torch.randint(0, len(tokens) - T - 1, (B,), generator=generator)
    return (torch.stack([tokens[s:s + T] for s in starts]), torch.stack([tokens[s + 1:s + T + 1] for s in starts]))


def effective_weight(m):
    if isinstance(m, lora_svd.LoRASVDLinear):
        return m.effective_weight().detach().float().clone()
    if isinstance(m, lora_svd.NaiveLoRALinear):
        return (m.weight + m.L2 @ m.L1).detach().float().clone()
    return m.weight.detach().float().clone()


def bf16_main_weight(on):
    """bf16_lora: NaiveLoRALinear's NVFP4 product replaced by a plain one (restored for the other recipes)."""
    nvfp4 = lora_svd.nvfp4
    if not hasattr(nvfp4, "_nvfp4_linear"):
        nvfp4._nvfp4_linear = nvfp4.nvfp4_linear
    nvfp4.nvfp4_linear = (lambda x, w, **kw: F.linear(x, w.to(x.dtype))) if on else nvfp4._nvfp4_linear


def run(recipe, optimizer, seed, lr, lora_lr, train, val):
    bf16_main_weight(recipe == "bf16_lora")
    torch.manual_seed(seed)
    cfg = model.GPTConfig(n_layer=LAYERS, n_embd=WIDTH, n_head=2, n_kv_head=1, ffn_hidden=4 * WIDTH, block_size=SEQ,
                          vocab_size=VOCAB, linear_policy="lora_naive" if recipe == "bf16_lora" else recipe,
                          lora_rank=RANK)
    net = model.GPT(cfg)
    try:  # the optimizer-state argument was renamed after eb03e8a
        opt = optim.build_optimizer(net, optimizer=optimizer, states="fp32", lr=lr, lora_lr=lora_lr)
    except TypeError:
        opt = optim.build_optimizer(net, optimizer=optimizer, state_quant="none", lr=lr, lora_lr=lora_lr)
    g = torch.Generator().manual_seed(seed)
    layers = [m for name, m in net.named_modules() if name.startswith("blocks") and (
        isinstance(m, (torch.nn.Linear, lora_svd.NaiveLoRALinear, lora_svd.LoRASVDLinear))
        or type(m).__name__ == "NVFP4Linear")]  # every block linear, whatever its recipe
    spectral = rms = 0.0
    probes = 0
    for step in range(STEPS):  # train.py's schedule: linear warmup, cosine to lr/10
        f = (step + 1) / WARMUP if step < WARMUP else 0.1 + 0.45 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * f
        x, y = batch(train, BATCH, SEQ, g)
        _, loss = net(x, y)
        loss.backward()
        if recipe == "lora_svd":
            lora_svd.project_all(net)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        probe = step % 10 == 5
        before = [effective_weight(m) for m in layers] if probe else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        if probe:
            for m, w0 in zip(layers, before):
                d = effective_weight(m) - w0
                spectral += torch.linalg.matrix_norm(d, 2).item() / (lr * f)
                rms += (d.norm() / math.sqrt(d.numel())).item() / (lr * f)
                probes += 1
    net.eval()
    gv, losses = torch.Generator().manual_seed(1234), []
    with torch.no_grad():
        for _ in range(8):
            x, y = batch(val, 16, SEQ, gv)
            losses.append(net(x, y)[1].item())
    return {"recipe": recipe, "optimizer": optimizer, "seed": seed, "lr": lr, "lora_lr": lora_lr, "rank": RANK,
            "val_loss": sum(losses) / len(losses), "train_loss": loss.item(),
            "update_spectral_per_lr": spectral / probes, "update_rms_per_lr": rms / probes}


if __name__ == "__main__":
    torch.set_num_threads(1)
    train, val = corpus()
    for spec in sys.argv[2:]:
        recipe, optimizer, seed, lr, lora_lr = spec.split(":")
        start = time.time()
        row = run(recipe, optimizer, int(seed), float(lr), float(lora_lr) if lora_lr else 2 * float(lr), train, val)
        row["wall_s"] = round(time.time() - start, 1)
        print(json.dumps(row), flush=True)
        with open(sys.argv[1], "a") as f:
            f.write(json.dumps(row) + "\n")
