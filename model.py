"""
The GPT of the paper's §4: pre-norm decoder with RMSNorm, RoPE, grouped-query attention (GQA) and a
SwiGLU MLP.

Precision is a property of the *recipe*, not of the model code: a `Recipe` names the linear layers,
the attention and the optimizer states of one row of the paper's ablation (Table 3), and `RECIPES`
holds those rows. Every linear layer inside the transformer blocks is built by `make_linear` and
every attention product goes through `attention_core`, both driven by `GPTConfig.recipe`. Swapping
BF16 for direct NVFP4, LoRA-SVD or FP4 attention therefore never touches the rest of this file.
Embeddings, lm_head and norms stay high precision (the paper quantizes the transformer blocks, not
the embedding/head).
"""
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

import attention
import lora_svd
import nvfp4

LINEAR_KINDS = ("bf16", "nvfp4", "lora_naive", "lora_svd")


@dataclass(frozen=True)
class Recipe:
    """One precision recipe: what the model (linear, four_over_six, attention) and the optimizer
    (optim_states) do in low precision. train.py --recipe picks a row of RECIPES; --attn_policy may
    swap its attention."""
    # bf16 | nvfp4 (eqs. 1-2 without LoRA) | lora_naive (+ a plain BF16 branch) | lora_svd (§3.2)
    linear: str = "bf16"
    # 4/6 scaling of the linear layers' NVFP4 blocks (each block maps its max to 6 or 4)
    four_over_six: bool = False
    # a key of attention.POLICIES: bf16, fp4 (§3.5), or one of Fig. 5's variants
    attention: str = "bf16"
    # optim.STATES: fp32 | nvfp4 (§3.3 states, §3.4 NVFP4 NS) | direct (App. 13)
    optim_states: str = "fp32"

    def __post_init__(self):  # optim.build_optimizer checks optim_states
        for name, value, allowed in (("linear", self.linear, LINEAR_KINDS),
                                     ("attention", self.attention, tuple(attention.POLICIES))):
            if value not in allowed:
                raise ValueError(f"Recipe.{name} {value!r}: expected one of {', '.join(allowed)}")

    def describe(self):
        linear = self.linear + (" + 4/6" if self.four_over_six else "")
        return f"linear {linear}, attention {self.attention}, optimizer states {self.optim_states}"


RECIPES = {  # the paper's Table 3 rows
    # the high-precision baseline: BF16 compute, fp32 master weights and optimizer states
    "bf16": Recipe(),
    "nvfp4": Recipe(linear="nvfp4"),  # direct NVFP4 linears
    # + 4/6: the linear-only state of the art
    "nvfp4_46": Recipe(linear="nvfp4", four_over_six=True),
    # NVFP4 + a plain BF16 LoRA branch
    "lora_naive": Recipe(linear="lora_naive", four_over_six=True),
    "lora_svd": Recipe(linear="lora_svd", four_over_six=True),  # §3.2 LoRA-SVD, linear layers only
    "fullstack": Recipe(linear="lora_svd", four_over_six=True, attention="fp4",
                        optim_states="nvfp4"),  # §3.2-3.5
    # App. 13: collapses
    "naive_fp4": Recipe(linear="nvfp4", attention="fp4_all", optim_states="direct"),
}


@dataclass
class GPTConfig:
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 2
    n_kv_head: int = 1  # GQA: n_head query heads share n_kv_head key/value heads
    ffn_hidden: int = 384  # SwiGLU inner width
    block_size: int = 256  # context length
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64 (nanoGPT): faster matmuls
    tie_embeddings: bool = True
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # the precision: see make_linear / attention_core
    recipe: Recipe = field(default_factory=Recipe)
    lora_rank: int = 32  # r of the LoRA branch (lora_naive, lora_svd)
    lora_beta: float = 1.0  # the branch's scale beta of eq. 1

    def __post_init__(self):
        if isinstance(self.recipe, dict):  # GPTConfig(**asdict(cfg)), e.g. from a checkpoint
            self.recipe = Recipe(**self.recipe)

    @property
    def head_dim(self):
        return self.n_embd // self.n_head


# Named configs. 3b is the paper's main model; 1b is our choice (the paper's copy lacks its 1B
# table). Untied embeddings for 1b/3b put them at 1.01B / 3.03B parameters. toy is App. 13's
# 6-layer, hidden-1024 model; with a 4x SwiGLU width and tied embeddings it has ~146M parameters
# (the paper says ~150M). tiny exists so CPU runs finish in minutes; its parameters are mostly the
# 50304x128 embedding.
CONFIGS = {
    "tiny": dict(n_layer=4, n_embd=128, n_head=2, n_kv_head=1, ffn_hidden=384, block_size=256,
                 tie_embeddings=True),
    "toy": dict(n_layer=6, n_embd=1024, n_head=16, n_kv_head=8, ffn_hidden=4096, block_size=1024,
                tie_embeddings=True),
    "1b": dict(n_layer=16, n_embd=2048, n_head=16, n_kv_head=8, ffn_hidden=6144, block_size=2048,
               tie_embeddings=False),
    "3b": dict(n_layer=24, n_embd=3072, n_head=24, n_kv_head=12, ffn_hidden=9216, block_size=2048,
               tie_embeddings=False),
}

def make_linear(in_f, out_f, recipe, std=0.02, lora_rank=32, lora_beta=1.0):
    """The ONE place that builds a block's linear layer (no bias). Every recipe starts from the same
    freshly initialised nn.Linear, so all recipes share the same initial function for a given
    seed."""
    lin = nn.Linear(in_f, out_f, bias=False)
    nn.init.normal_(lin.weight, mean=0.0, std=std)
    if recipe.linear == "bf16":
        return lin  # fp32 master weight; BF16 compute comes from autocast
    if recipe.linear == "nvfp4":  # direct NVFP4, eqs. 1-2 without the LoRA branch
        return nvfp4.NVFP4Linear.from_linear(lin, recipe.four_over_six)
    # NVFP4 main weight + a plain BF16 LoRA branch (the ablation's "naive LoRA")
    if recipe.linear == "lora_naive":
        return lora_svd.NaiveLoRALinear.from_linear(lin, lora_rank, recipe.four_over_six)
    # lora_svd, §3.2: the top-r SVD of the init in the BF16 branch, the residual in NVFP4
    return lora_svd.LoRASVDLinear.from_linear(lin, lora_rank, lora_beta, recipe.four_over_six)


def attention_core(q, k, v, policy):
    """The ONE place that computes causal softmax(q k^T / sqrt(D)) v. q: (B, H, T, D);
    k, v: (B, Hkv, T, D)."""
    if policy == "bf16":
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    # §3.5 FP4 attention and Fig. 5's variants
    return attention.attention(q, k, v, causal=True, policy=policy)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rope_cache(seq_len, head_dim, theta, device=None):
    """cos/sin tables (T, D/2) in fp32: position t rotates channel pair i by angle t *
    theta^(-2i/D)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
                                / head_dim))
    # (T, D/2)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate (x1, x2) = the two halves of the head dim; x: (B, H, T, D). Then q_t . k_s depends
    only on t - s."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[: x.size(-2)], sin[: x.size(-2)]  # (T, D/2), broadcast over B, H
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        # GPT-2: scale residual projections
        hd, proj_std = cfg.head_dim, 0.02 / math.sqrt(2 * cfg.n_layer)
        lin = lambda i, o, std=0.02: make_linear(i, o, cfg.recipe, std, cfg.lora_rank,
                                                 cfg.lora_beta)
        self.q_proj = lin(cfg.n_embd, cfg.n_head * hd)
        self.k_proj = lin(cfg.n_embd, cfg.n_kv_head * hd)
        self.v_proj = lin(cfg.n_embd, cfg.n_kv_head * hd)
        self.o_proj = lin(cfg.n_head * hd, cfg.n_embd, proj_std)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        hd = self.cfg.head_dim
        q = self.q_proj(x).view(B, T, self.cfg.n_head, hd).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(B, T, self.cfg.n_kv_head, hd).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(B, T, self.cfg.n_kv_head, hd).transpose(1, 2)  # (B, Hkv, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attention_core(q, k, v, self.cfg.recipe.attention)  # (B, H, T, D)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.cfg.n_head * hd))  # (B, T, C)


class SwiGLU(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        lin = lambda i, o, std=0.02: make_linear(i, o, cfg.recipe, std, cfg.lora_rank,
                                                 cfg.lora_beta)
        self.gate_proj = lin(cfg.n_embd, cfg.ffn_hidden)
        self.up_proj = lin(cfg.n_embd, cfg.ffn_hidden)
        self.down_proj = lin(cfg.ffn_hidden, cfg.n_embd, proj_std)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        if cfg.n_embd % cfg.n_head or cfg.n_head % cfg.n_kv_head or cfg.head_dim % 2:
            raise ValueError(f"n_embd={cfg.n_embd}, n_head={cfg.n_head}, "
                             f"n_kv_head={cfg.n_kv_head}: n_head must divide n_embd, n_kv_head "
                             "must divide n_head, and head_dim must be even (RoPE)")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        nn.init.normal_(self.wte.weight, mean=0.0, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        # high precision (not a block linear)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        else:
            nn.init.normal_(self.lm_head.weight, mean=0.0, std=0.02)
        cos, sin = rope_cache(cfg.block_size, cfg.head_dim, cfg.rope_theta)
        # rebuilt from cfg, not checkpointed
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.cfg.block_size:
            raise ValueError(f"sequence length {T} exceeds the context "
                             f"(block_size={self.cfg.block_size})")
        x = self.wte(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        logits = self.lm_head(self.norm(x))  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def num_params(self):
        return sum(p.numel() for p in self.parameters())  # shared (tied) tensors are counted once

    def flops_per_token(self, seq_len):
        """Training FLOPs per token (fwd + bwd = 3x fwd): 6 per weight that multiplies activations
        (all params but the input embedding lookup; lm_head counted even if tied), plus causal
        attention: QK^T and PV are 2*T*d_attn MACs per token per layer in full, half of that with
        the causal mask -> 6 * L * T * H * D."""
        c = self.cfg
        matmul_params = (self.num_params() - self.wte.weight.numel()
                         + c.vocab_size * c.n_embd * c.tie_embeddings)
        return 6 * matmul_params + 6 * c.n_layer * seq_len * c.n_head * c.head_dim

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample autoregressively (no KV cache: the context is cropped to block_size and
        recomputed)."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.block_size:])
            logits = logits[:, -1, :].float()
            if temperature == 0:
                next_id = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)
            idx = torch.cat([idx, next_id], dim=1)
        return idx


def compile_model(model, mode=None):
    """torch.compile(model), the FP4 parts included: the NVFP4 linears, LoRA-SVD and FP4 attention
    (nvfp4.LinearFunction, attention.AttentionFunction) run their bodies as torch.library custom
    ops under compilation, one opaque node each, so the graph has no break and inductor fuses what
    lies between them (norms, RoPE, SwiGLU, residuals, the loss) without re-tracing the Triton
    kernels inside. The ops' random draws are made when they run, in eager's order
    (tests/test_compile.py; docs/performance.md: what compiles, where bits can differ). mode:
    torch.compile's ("reduce-overhead": CUDA graphs; the draws are on the device, nvfp4.sr_seed).
    Inductor's node reordering is off: the layers' backward ops depend on nothing of each other, so
    its passes that lower peak memory or the number of CUDA graph partitions were free to run them
    in another order than eager's and give each layer another layer's draws (seen on the H200)."""
    if mode not in (None, "reduce-overhead"):
        raise ValueError(f"compile mode {mode!r}: expected None or 'reduce-overhead'")
    return torch.compile(model, options={"reorder_for_peak_memory": False,
                                         "triton.reorder_for_reducing_graph_partitions": False,
                                         "triton.cudagraphs": mode == "reduce-overhead"})


def config_from_name(name, **overrides):
    if name not in CONFIGS:
        raise ValueError(f"config {name!r} unknown; expected one of {sorted(CONFIGS)}")
    return GPTConfig(**{**CONFIGS[name], **overrides})


# python model.py: parameter counts of every config (built on the meta device), per recipe kind:
# the recipes with a LoRA branch (lora_naive, lora_svd, fullstack) add r x (in + out) per linear
if __name__ == "__main__":
    branch = [r for r, recipe in RECIPES.items() if recipe.linear in ("lora_naive", "lora_svd")]
    for name in CONFIGS:
        with torch.device("meta"):
            m = GPT(config_from_name(name))
            lora = GPT(config_from_name(name, recipe=RECIPES[branch[0]])).num_params()
        print(f"{name:>5}: {m.num_params() / 1e6:9.2f}M params, {lora / 1e6:.2f}M with the "
              f"rank-{m.cfg.lora_rank} LoRA branch of {', '.join(branch)}; "
              f"{m.flops_per_token(m.cfg.block_size) / 1e9:.2f} "
              f"GFLOP/token at T={m.cfg.block_size}  {asdict(m.cfg)}")
