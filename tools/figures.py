r"""
Regenerate the paper's analysis figures from the modules: PNGs plus one figures.json of every
number.

    python tools/figures.py                             # all figures, --size small, CPU: minutes
    python tools/figures.py --fig 3 7 --size full --device cuda \
        --checkpoint runs/toy_bf16_adamw/ckpt.pt

  Fig. 3   rel. MSE of a layer's output, LoRA-SVD vs direct NVFP4 (§3.2): random-init weights per
           shape and rank; with --checkpoint also the trained weights on real activations
           (lora_svd.lora_svd_error)
  Fig. 4a  second-moment v in NVFP4: direct vs the sqrt / tile-mean / Hadamard pipeline (§3.3):
           error in v space, in sqrt(v) (what Adam divides by) and the fraction of v > 0 that
           decodes to 0
  Fig. 4b  NVFP4 Newton-Schulz error per shape, our fitted Root coefficients vs Muon's (§3.4)
  Fig. 5   attention precision variants (§3.5): relative MSE of O, dQ, dK, dV per policy, and App.
           10's numbers (simplex violation of a quantized P, dS error from an NVFP4 dO V^T)
  Fig. 7   quantization MSE vs hidden dim (App. 7): the analytic single-matmul version
           (nvfp4.matmul_quant_error) and the paper's measured one: the final-block output of a
           6-layer GPT, NVFP4 forward vs high-precision forward on the same weights and tokens, at
           init and after training

--size small runs each figure on 2 CPU cores in about a minute (smaller shapes, stated in the JSON);
--size full uses the paper-scale shapes and wants a GPU. Everything is seeded.
"""
import argparse
import contextlib
import json
import math
import os
import sys
import time
import traceback

import torch
import torch.nn as nn

# the repo root: the modules
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import nvfp4  # noqa: E402

FIGS = ("3", "4a", "4b", "5", "7")

# What each figure runs at each size. small: a couple of CPU-minutes at most; full: the paper's
# scale on a GPU.
SIZES = {
    "small": {
        # Fig. 3: (out, in) of a hidden-512 block's q/o, k/v, gate/up, down projections
        "fig3_shapes": [(512, 512), (256, 512), (2048, 512), (512, 2048)],
        "fig3_ranks": (8, 32, 128),
        "fig3_tokens": 256, "fig3_trained_blocks": "ends", "fig3_batch": (1, 256),
        "fig4a_shape": (256, 1024), "fig4b_min_dim": 128, "fig4b_configs": ("toy", "1b", "3b"),
        "fig5_shape": dict(B=1, H=4, Hkv=2, T=256, D=64), "fig5_sharpness": (1.0, 4.0),
        "fig7_matmul_dims": (512, 1024, 2048, 4096),
        "fig7_hidden": (64, 128, 256), "fig7_batch": (1, 64), "fig7_steps": (0, 3), "fig7_lr": 1e-3,
        "fig7_variants": ("nvfp4",),
    },
    "full": {
        # Fig. 3: the 1b config's shapes (hidden 2048, FFN 6144, 8 KV heads of 128)
        "fig3_shapes": [(2048, 2048), (1024, 2048), (6144, 2048), (2048, 6144)],
        "fig3_ranks": (8, 32, 128, 256), "fig3_tokens": 4096, "fig3_trained_blocks": "all",
        "fig3_batch": (4, 1024),
        "fig4a_shape": (3072, 9216),
        # at min dim 512 (aspect kept; 0 = real size): polar_error's float64 SVD per call makes
        # 3072x9216 slow
        "fig4b_min_dim": 512,
        "fig4b_configs": ("toy", "1b", "3b"),
        "fig5_shape": dict(B=2, H=16, Hkv=8, T=2048, D=64), "fig5_sharpness": (1.0, 2.0, 4.0, 8.0),
        "fig7_matmul_dims": (512, 1024, 2048, 4096, 8192),
        "fig7_hidden": (512, 1024, 2048), "fig7_batch": (8, 1024), "fig7_steps": (0, 100, 300),
        "fig7_lr": 1e-3, "fig7_variants": ("nvfp4", "nvfp4_46"),
    },
}


def rel(x_hat, x):
    """||x_hat - x||^2 / ||x||^2 = MSE / mean(x^2): the paper's Rel. MSE (§3.2)."""
    return ((x_hat.double() - x.double()).pow(2).sum() / x.double().pow(2).sum()).item()


# --------------------------------------------------------------------------------------------------
# Shared: tokens, and a trained checkpoint as a dense model

def token_batch(split, batch, seq_len, seed, device, vocab_size=50304):
    """(B, T+1) tokens of the default corpus (data_cache/default/<split>.bin) or, without it,
    uniform random tokens (then "data": "random" in the JSON)."""
    import data
    path = os.path.join(data.DEFAULT_DIR, f"{split}.bin")
    if os.path.exists(path):
        loader = data.TokenLoader(path, batch, seq_len, seed=seed)
        x, y = loader.next_batch()
        # the modulo: a no-op for our GPT-2-vocabulary models
        tokens = torch.cat([x, y[:, -1:]], 1) % vocab_size
        return tokens.to(device), "default corpus"
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab_size, 50257), (batch, seq_len + 1),
                         generator=g).to(device), "random"


def dense_model_from_checkpoint(path, device):
    """train.py's ckpt.pt -> a GPT whose block linears are plain nn.Linear holding each layer's
    EFFECTIVE weight (lora_svd: W_res + beta L2 L1; naive LoRA: W + L2 L1; nvfp4/bf16: W). Figures
    then quantize these weights themselves, whatever recipe trained them."""
    from model import GPT, RECIPES, GPTConfig
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    if "model" not in ckpt or "config" not in ckpt:
        raise ValueError(f"--checkpoint {path}: not a train.py checkpoint "
                         "(needs 'model' and 'config' entries)")
    # the shape, not the recipe
    conf = {k: v for k, v in ckpt["config"].items() if k in GPTConfig.__dataclass_fields__}
    beta = conf.get("lora_beta", 1.0)
    cfg = GPTConfig(**{**conf, "recipe": RECIPES["bf16"]})
    sd = {k.replace("_orig_mod.", "").replace("module.", ""): v for k, v in ckpt["model"].items()}
    dense = {}
    for key, value in sd.items():
        base = key.rsplit(".", 1)[0]
        if key.endswith(".weight_res"):  # LoRA-SVD: W = W_res + beta L2 L1
            dense[base + ".weight"] = value.float() + beta * (sd[base + ".L2"].float()
                                                              @ sd[base + ".L1"].float())
        elif key.endswith((".L1", ".L2")):
            continue
        elif key.endswith(".weight") and base + ".L1" in sd:  # naive LoRA: y = W x + L2 L1 x
            dense[key] = value.float() + sd[base + ".L2"].float() @ sd[base + ".L1"].float()
        else:
            dense[key] = value
    model = GPT(cfg)
    model.load_state_dict(dense)
    return model.to(device).eval(), ckpt.get("step"), ckpt.get("args", {}).get("recipe")


def block_linears(model, blocks="all"):
    """[(name, nn.Linear)] of the transformer blocks' linear layers; blocks="ends": first and last
    block only."""
    keep = range(len(model.blocks)) if blocks == "all" else sorted({0, len(model.blocks) - 1})
    return [(f"blocks.{i}.{name}", mod)
            for i in keep for name, mod in model.blocks[i].named_modules()
            if isinstance(mod, nn.Linear)]


# --------------------------------------------------------------------------------------------------
# Fig. 3: LoRA-SVD vs direct NVFP4

def fig3(size, device, checkpoint=None, seed=0):
    import lora_svd
    g = torch.Generator().manual_seed(seed)
    random_rows = []
    for out_f, in_f in size["fig3_shapes"]:
        W = (torch.randn(out_f, in_f, generator=g) * 0.02).to(device)  # model.make_linear's init
        X = torch.randn(size["fig3_tokens"], in_f, generator=g).to(device)
        for rank in size["fig3_ranks"]:
            r = lora_svd.lora_svd_error(W, X, rank)
            random_rows.append({"shape": [out_f, in_f], "rank": rank, **r})
    result = {"random_init": random_rows, "weights": "N(0, 0.02^2) i.i.d.",
              "activations": "N(0, 1) i.i.d.", "four_over_six": True}
    if checkpoint:
        model, step, recipe = dense_model_from_checkpoint(checkpoint, device)
        rank = model.cfg.lora_rank
        layers = block_linears(model, size["fig3_trained_blocks"])
        inputs = {}
        hooks = [mod.register_forward_hook(
                     lambda m, a, o, name=name: inputs.__setitem__(name, a[0].detach()))
                 for name, mod in layers]
        tokens, source = token_batch("val", *size["fig3_batch"], seed, device, model.cfg.vocab_size)
        with torch.no_grad():
            model(tokens[:, :-1])
        for h in hooks:
            h.remove()
        rows = []
        for name, mod in layers:
            X = inputs[name].reshape(-1, mod.in_features).float()
            rows.append({"layer": name, "rank": rank,
                         **lora_svd.lora_svd_error(mod.weight.float(), X, rank)})
        result["trained"] = {"checkpoint": checkpoint, "step": step, "recipe": recipe, "rank": rank,
                             "activations": source, "layers": rows}
    return result


def plot_fig3(res, path):
    import matplotlib.pyplot as plt
    panels = 2 if "trained" in res else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
    ax = axes[0][0]
    shapes = []
    for row in res["random_init"]:
        if row["shape"] not in shapes:
            shapes.append(row["shape"])
    for i, shape in enumerate(shapes):
        rows = [r for r in res["random_init"] if r["shape"] == shape]
        color = plt.cm.tab10(i)
        ax.plot([r["rank"] for r in rows], [r["lora_svd"] for r in rows], "o-", color=color,
                label=f"LoRA-SVD {shape[0]}x{shape[1]}")
        ax.axhline(rows[0]["nvfp4"], color=color, ls="--", lw=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("LoRA rank r")
    ax.set_ylabel("rel. MSE of Y = X W^T")
    ax.set_title("Fig. 3, random init (dashed: direct NVFP4)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    if "trained" in res:
        ax = axes[0][1]
        t = res["trained"]
        kinds = {}
        for row in t["layers"]:
            kinds.setdefault(row["layer"].rsplit(".", 1)[-1], []).append(row)
        names = list(kinds)
        mean = lambda rows, k: sum(r[k] for r in rows) / len(rows)
        xs = range(len(names))
        ax.bar([x - 0.2 for x in xs], [mean(kinds[n], "nvfp4") for n in names], 0.4,
               label="direct NVFP4 (4/6)")
        ax.bar([x + 0.2 for x in xs], [mean(kinds[n], "lora_svd") for n in names], 0.4,
               label=f"LoRA-SVD r={t['rank']}")
        for x, n in zip(xs, names):
            ax.text(x, mean(kinds[n], "nvfp4"), f"-{100 * mean(kinds[n], 'reduction'):.0f}%",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(xs), names, rotation=20)
        ax.set_ylabel("rel. MSE (mean over layers)")
        ax.set_title(f"trained weights ({t['recipe']}, step {t['step']}), "
                     f"{t['activations']} activations")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Fig. 4a: the second moment in NVFP4

def fig4a(size, device, seed=0):
    """fit_root_coefficients.fig4a_numbers on its synthetic_moments (Adam moments of a gradient
    stream with log-normal row and column scales and 1% spikes): relative Frobenius errors of v and
    sqrt(v), the fraction of v > 0 decoded to <= 0, and the error of Adam's direction
    m / sqrt(v)."""
    import fit_root_coefficients as fit  # tools/fit_root_coefficients.py
    R, C = size["fig4a_shape"]
    m, v = fit.synthetic_moments(R, C, seed=seed)
    numbers = fit.fig4a_numbers(v.to(device), m.to(device))
    return {"shape": [R, C], "v": "synthetic_moments (bias-corrected Adam moments, 30 steps)",
            **numbers}


def plot_fig4a(res, path):
    import matplotlib.pyplot as plt
    metrics = [("v_rel_err", "rel. error of v"), ("sqrt_rel_err", "rel. error of sqrt(v)"),
               ("update_rel_err", "rel. error of m / sqrt(v)"),
               ("zero_fraction", "fraction of v > 0 decoded to 0")]
    methods = [("direct", "direct", "tab:red"), ("pipeline", "pipeline", "tab:green"),
               ("pipeline_rtn", "pipeline, RTN", "tab:olive")]
    methods = [mt for mt in methods if mt[0] in res]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.8))
    for ax, (key, label) in zip(axes, metrics):
        vals = [res[name].get(key, float("nan")) for name, _, _ in methods]
        ax.bar([lab for _, lab, _ in methods], vals, color=[c for _, _, c in methods])
        for i, val in enumerate(vals):
            ax.text(i, val, f"{val:.3g}", ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
        if key == "update_rel_err":
            ax.set_yscale("log")  # direct: v decoded to 0 -> m / (0 + eps) explodes
    fig.suptitle(f"Fig. 4a: second moment v ({res['shape'][0]}x{res['shape'][1]}) in NVFP4. "
                 "Pipeline vs direct: "
                 f"{100 * res['pipeline_reduction_sqrt_rel_err']:.0f}% less error in sqrt(v), "
                 f"{100 * res['pipeline_reduction_v_rel_err']:.0f}% less in v")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Fig. 4b: NVFP4 Newton-Schulz, Root vs Muon coefficients

def fig4b(size, device, seed=0):
    """fit_root_coefficients.fig4b_numbers: orthogonality (polar) error after 5 NVFP4 NS steps with
    the shape's fitted Root coefficients vs Muon's, and fp32 NS with Muon's as the unquantized
    reference, for every Root-routed shape of the toy/1b/3b configs (at --size small evaluated at
    min dim 128, aspect ratio kept)."""
    import fit_root_coefficients as fit  # tools/fit_root_coefficients.py
    import optim
    shapes = fit.config_shapes(list(size["fig4b_configs"]))
    rows = fit.fig4b_numbers(shapes, fit_min_dim=size["fig4b_min_dim"], seed=1234 + seed,
                             device=device)
    return {"rows": rows, "error": "polar_error after 5 NS steps, mean over representative_inputs; "
                                   "10 is ns_error's cap (the iteration blew up)",
            "coefficients": os.path.basename(optim.COEFFICIENTS_JSON)
            if os.path.exists(optim.COEFFICIENTS_JSON) else "none fitted"}


def plot_fig4b(res, path):
    import matplotlib.pyplot as plt
    rows = res["rows"]
    labels = [f"{r['shape'][0]}x{r['shape'][1]}" for r in rows]
    xs = list(range(len(rows)))
    bars = [("nvfp4_muon", "NVFP4 NS, Muon coefficients", "tab:gray"),
            ("nvfp4_published_nearest", "NVFP4 NS, ROOT's published set (nearest shape)",
             "tab:orange"),
            ("nvfp4_root", "NVFP4 NS, Root fitted per shape (ours)", "tab:blue"),
            ("fp32_muon", "fp32 NS, Muon (unquantized reference)", "tab:green")]
    bars = [b for b in bars if b[0] in rows[0]]
    width = 0.8 / len(bars)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(rows)), 4.2))
    for i, (key, label, color) in enumerate(bars):
        ax.bar([x + (i - (len(bars) - 1) / 2) * width for x in xs], [r[key] for r in rows],
               width, label=label, color=color)
    ax.set_xticks(xs, labels, rotation=20)
    ax.set_yscale("log")
    ax.set_ylabel("orthogonality error after 5 steps")
    ax.set_title("Fig. 4b: quantized Newton-Schulz error per shape "
                 "(10 = capped: the iteration blew up)")
    ax.set_ylim(top=200)  # room for the legend above the capped bars
    ax.legend(fontsize=8, ncol=2, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Fig. 5: attention precision variants

def fig5(size, device, seed=0):
    """q, k with variance `sharpness` each, so the scores q.k/sqrt(D) have std `sharpness`: 1 gives
    flat attention, 4-8 the peaked rows of a trained model (where App. 10 says PV and dO V^T hurt
    most)."""
    import attention
    s = size["fig5_shape"]
    # the training dtype on the GPU
    dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    g = torch.Generator().manual_seed(seed)
    rows = []
    for sharpness in size["fig5_sharpness"]:
        q = torch.randn(s["B"], s["H"], s["T"], s["D"], generator=g) * math.sqrt(sharpness)
        k = torch.randn(s["B"], s["Hkv"], s["T"], s["D"], generator=g) * math.sqrt(sharpness)
        v = torch.randn(s["B"], s["Hkv"], s["T"], s["D"], generator=g)
        do = torch.randn(s["B"], s["H"], s["T"], s["D"], generator=g)
        q, k, v, do = (t.to(device, dtype) for t in (q, k, v, do))
        _, p = attention.exact_attention(q, k, v, causal=True)
        rows.append({"sharpness": sharpness,
                     "policies": attention.policy_errors(q, k, v, do, causal=True),
                     "simplex_violation": attention.simplex_violation(p),
                     "ds_error": attention.ds_error(q, k, v, do, causal=True)})
        del p
    return {"shape": s, "rows": rows, "dtype": str(dtype).replace("torch.", ""),
            "error": "nvfp4.relative_mse against float64 attention: ||x - x_ref||^2 / ||x_ref||^2"}


def plot_fig5(res, path):
    import matplotlib.pyplot as plt
    rows = res["rows"]
    policies = [p for p in rows[0]["policies"] if p != "bf16"]
    outputs = ("o", "dq", "dk", "dv")
    fig, axes = plt.subplots(1, len(rows) + 1, figsize=(5 * (len(rows) + 1), 4))
    for ax, row in zip(axes, rows):
        width = 0.8 / len(policies)
        for i, policy in enumerate(policies):
            ax.bar([x + (i - (len(policies) - 1) / 2) * width for x in range(len(outputs))],
                   [row["policies"][policy][o] for o in outputs], width, label=policy)
        ax.set_xticks(range(len(outputs)), ["O", "dQ", "dK", "dV"])
        ax.set_title(f"score std {row['sharpness']:g}")
        ax.set_ylabel("rel. MSE vs float64")
        ax.legend(fontsize=8)
    ax = axes[-1]  # App. 10: the two mechanisms against sharpness
    xs = [r["sharpness"] for r in rows]
    ax.plot(xs, [r["simplex_violation"]["row_sum_dev_mean"] for r in rows], "o-",
            label="|1 - sum P_hat| (10.1)")
    ax.plot(xs, [r["simplex_violation"]["zeroed_mass"] for r in rows], "s-",
            label="P mass flushed to 0 (10.1)")
    ax.plot(xs, [r["ds_error"]["nvfp4"]["rel_mse_peaks"] for r in rows], "^-",
            label="dS rel. MSE at peaks, NVFP4 dO V^T (10.2)")
    ax.plot(xs, [r["ds_error"]["nvfp4"]["rel_mse_tail"] for r in rows], "v-",
            label="dS rel. MSE in the tail (10.2)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("score std")
    ax.set_title("App. 10")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.suptitle(f"Fig. 5: attention precision variants "
                 f"(B,H,T,D = {res['shape']['B']},{res['shape']['H']},"
                 f"{res['shape']['T']},{res['shape']['D']})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------
# Fig. 7: quantization MSE grows with the hidden dimension

class NVFP4Forward(nn.Module):
    """A dense nn.Linear's OWN weight through NVFP4's forward GEMM, Q1x16(X) Q16x16(W)^T (RTN): same
    weights, so the difference to the dense forward is the quantization error alone."""

    def __init__(self, linear, four_over_six):
        super().__init__()
        self.linear, self.four_over_six = linear, four_over_six

    def forward(self, x):
        return nvfp4.nvfp4_linear(x, self.linear.weight, self.four_over_six)


@contextlib.contextmanager
def nvfp4_linears(model, four_over_six=False):
    """Temporarily run every block linear of `model` in NVFP4 (embeddings, norms, lm_head stay
    dense)."""
    swaps = [(parent, name, child) for parent in model.blocks.modules()
             for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, child in swaps:
        setattr(parent, name, NVFP4Forward(child, four_over_six))
    try:
        yield model
    finally:
        for parent, name, child in swaps:
            setattr(parent, name, child)


def final_block_output(model, idx):
    x = model.wte(idx)  # (B, T, C)
    for block in model.blocks:
        x = block(x, model.rope_cos, model.rope_sin)
    return x.float()  # the residual stream after the last block (before the final norm)


def fig7_measured(size, device, seed=0):
    """For each hidden dim: a 6-layer GPT (toy family: FFN 4x, head dim 64, GQA 2:1), trained in
    high precision (fp32 on CPU, bf16 autocast on CUDA) with AdamW; at each step of fig7_steps, the
    MSE between the final block's output with NVFP4 block linears (RTN forward; at full size also
    with 4/6) and with dense ones."""
    from model import GPT, GPTConfig
    B, T = size["fig7_batch"]
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if str(device).startswith("cuda")
                else contextlib.nullcontext())
    eval_tokens, source = token_batch("val", B, T, seed + 1, device)
    rows = []
    for hidden in size["fig7_hidden"]:
        torch.manual_seed(seed)
        cfg = GPTConfig(n_layer=6, n_embd=hidden, n_head=hidden // 64,
                        n_kv_head=max(1, hidden // 128), ffn_hidden=4 * hidden, block_size=T)
        model = GPT(cfg).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=size["fig7_lr"], betas=(0.9, 0.95),
                                weight_decay=0.1, foreach=True)
        step = 0
        for target in sorted(size["fig7_steps"]):
            model.train()
            while step < target:
                tokens, _ = token_batch("train", B, T, seed + 100 + step, device)
                with autocast:
                    _, loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
            model.eval()
            with torch.no_grad(), autocast:
                ref = final_block_output(model, eval_tokens[:, :-1])
                row = {"hidden": hidden, "params": model.num_params(), "step": step,
                       "ref_mean_sq": ref.pow(2).mean().item()}
                for name in size["fig7_variants"]:
                    with nvfp4_linears(model, four_over_six=name == "nvfp4_46"):
                        out = final_block_output(model, eval_tokens[:, :-1])
                    row[f"{name}_mse"] = (out - ref).pow(2).mean().item()
                    row[f"{name}_rel_mse"] = row[f"{name}_mse"] / row["ref_mean_sq"]
            rows.append(row)
        del model, opt
    return {"rows": rows, "tokens": source, "batch": [B, T], "lr": size["fig7_lr"],
            "reference": "bf16 autocast" if str(device).startswith("cuda") else "fp32"}


def fig7(size, device, seed=0):
    matmul = []
    for rounding in ("rtn", "sr"):
        matmul += nvfp4.matmul_quant_error(size["fig7_matmul_dims"], rounding=rounding, seed=seed,
                                           device=device)
    return {"matmul": matmul, "measured": fig7_measured(size, device, seed)}


def plot_fig7(res, path):
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for rounding in ("rtn", "sr"):
        rows = [r for r in res["matmul"] if r["rounding"] == rounding]
        ax.plot([r["N"] for r in rows], [r["mse"] for r in rows], "o-",
                label=f"{rounding.upper()}: MSE of X W^T")
    rows = [r for r in res["matmul"] if r["rounding"] == "rtn"]
    ax.plot([r["N"] for r in rows], [rows[0]["mse"] * r["N"] / rows[0]["N"] for r in rows], "k:",
            label="∝ N")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("contraction length N (hidden dim)")
    ax.set_ylabel("MSE")
    ax.set_title("App. 7: one NVFP4 matmul, Gaussian inputs")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    ax = axes[1]
    m = res["measured"]
    steps = sorted({r["step"] for r in m["rows"]})
    for i, step in enumerate(steps):
        rows = [r for r in m["rows"] if r["step"] == step]
        color = plt.cm.viridis(i / max(1, len(steps) - 1))
        ax.plot([r["hidden"] for r in rows], [r["nvfp4_mse"] for r in rows], "o-", color=color,
                label=f"NVFP4, step {step}")
        if "nvfp4_46_mse" in rows[0]:
            ax.plot([r["hidden"] for r in rows], [r["nvfp4_46_mse"] for r in rows], "s--",
                    color=color, lw=1, label=f"NVFP4 4/6, step {step}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("hidden dim (6 layers)")
    ax.set_ylabel(f"final-block output MSE vs {m['reference']}")
    ax.set_title("Fig. 7: measured in a 6-layer GPT")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------

RUNNERS = {"3": (fig3, plot_fig3), "4a": (fig4a, plot_fig4a), "4b": (fig4b, plot_fig4b),
           "5": (fig5, plot_fig5), "7": (fig7, plot_fig7)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fig", nargs="+", default=["all"], help=f"any of {' '.join(FIGS)}, or all")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu | cuda")
    p.add_argument("--size", default="small", help="small (CPU minutes) | full (paper scale, GPU)")
    p.add_argument("--checkpoint", default=None,
                   help="a train.py ckpt.pt (toy): Fig. 3 on its trained weights")
    p.add_argument("--out_dir", default="results/figures")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    figs = list(FIGS) if "all" in args.fig else args.fig
    bad = [f for f in figs if f not in FIGS]
    if bad:
        p.error(f"--fig {' '.join(bad)}: unknown; choose from {' '.join(FIGS)} or all")
    if args.size not in SIZES:
        p.error(f"--size {args.size!r}: expected small or full")
    if (args.device not in ("cpu", "cuda")
            or (args.device == "cuda" and not torch.cuda.is_available())):
        p.error(f"--device {args.device!r}: expected cpu, or cuda on a machine with a GPU")
    if args.checkpoint and not os.path.isfile(args.checkpoint):
        p.error(f"--checkpoint {args.checkpoint}: no such file")
    import matplotlib
    matplotlib.use("Agg")
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "figures.json")
    # keep figures not rerun
    results = json.load(open(json_path)) if os.path.exists(json_path) else {}
    size = SIZES[args.size]
    failed = []
    for f in figs:
        run, plot = RUNNERS[f]
        t0 = time.time()
        kwargs = {"checkpoint": args.checkpoint} if f == "3" else {}
        # one figure failing (a missing module, a GPU-only bug) must not cost the others on a
        # one-shot run
        try:
            res = run(size, args.device, seed=args.seed, **kwargs)
            png = os.path.join(args.out_dir, f"fig{f}.png")
            plot(res, png)
        except Exception:
            traceback.print_exc()
            failed.append(f)
            continue
        res["meta"] = {"size": args.size, "device": args.device, "seed": args.seed,
                       "seconds": time.time() - t0}
        results[f"fig{f}"] = res
        # after every figure: a later failure keeps the earlier numbers
        with open(json_path, "w") as fh:
            json.dump(results, fh, indent=1)
        print(f"fig {f}: {time.time() - t0:.0f}s -> {png}", flush=True)
    print(f"numbers -> {json_path}")
    if failed:
        raise SystemExit(f"figures.py: fig {' '.join(failed)} failed (tracebacks above)")


if __name__ == "__main__":
    main()
