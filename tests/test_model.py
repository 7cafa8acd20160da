import dataclasses
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import attention
import lora_svd
import nvfp4
from model import (CONFIGS, GPT, RECIPES, GPTConfig, Recipe, apply_rope, compile_model, config_from_name, make_linear,
                   rope_cache)


def small_config(**kw):
    return GPTConfig(**{**dict(n_layer=2, n_embd=64, n_head=4, n_kv_head=2, ffn_hidden=128, block_size=32,
                               vocab_size=97), **kw})


def test_forward_shapes_loss_and_gqa_projections():
    torch.manual_seed(0)
    cfg = small_config()
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (3, 20))
    logits, loss = model(idx, torch.randint(0, cfg.vocab_size, (3, 20)))
    assert logits.shape == (3, 20, cfg.vocab_size)
    assert loss.ndim == 0 and abs(loss.item() - math.log(cfg.vocab_size)) < 0.5  # near-uniform at init
    attn = model.blocks[0].attn
    assert attn.q_proj.weight.shape == (cfg.n_head * cfg.head_dim, cfg.n_embd)
    assert attn.k_proj.weight.shape == (cfg.n_kv_head * cfg.head_dim, cfg.n_embd)  # GQA: fewer K/V heads
    assert attn.v_proj.weight.shape == (cfg.n_kv_head * cfg.head_dim, cfg.n_embd)
    with pytest.raises(ValueError, match="exceeds the context"):
        model(torch.zeros(1, cfg.block_size + 1, dtype=torch.long))


def test_logits_are_lm_head_of_the_normed_last_block_and_loss_their_cross_entropy():
    """Pre-norm GPT: the last block's output goes through the final RMSNorm (its gain trained) and
    then lm_head; the loss is the mean cross-entropy of those logits in fp32."""
    torch.manual_seed(0)
    cfg = small_config(tie_embeddings=False)
    model = GPT(cfg)
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 2.0)
    out = {}
    model.blocks[-1].register_forward_hook(lambda m, args, y: out.update(last=y))
    idx = torch.randint(0, cfg.vocab_size, (2, 12))
    targets = torch.randint(0, cfg.vocab_size, (2, 12))
    logits, loss = model(idx, targets)
    h = out["last"]  # (B, T, C)
    normed = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * model.norm.weight
    torch.testing.assert_close(logits, normed @ model.lm_head.weight.t())
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                                                     targets.reshape(-1)))


def test_attention_matches_explicit_gqa_with_repeated_kv_heads():
    """Query head h must attend with K/V head h // (n_head / n_kv_head), causally."""
    torch.manual_seed(1)
    cfg = small_config()
    attn = GPT(cfg).blocks[0].attn
    B, T, H, Hkv, D = 2, 12, cfg.n_head, cfg.n_kv_head, cfg.head_dim
    x = torch.randn(B, T, cfg.n_embd)
    cos, sin = rope_cache(T, D, cfg.rope_theta)
    q = apply_rope(attn.q_proj(x).view(B, T, H, D).transpose(1, 2), cos, sin)
    k = apply_rope(attn.k_proj(x).view(B, T, Hkv, D).transpose(1, 2), cos, sin)
    v = attn.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
    k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)  # (B, H, T, D)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    scores = scores.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, H * D)
    torch.testing.assert_close(attn(x, cos, sin), attn.o_proj(y), atol=1e-5, rtol=1e-5)


def test_causal_future_tokens_do_not_change_past_logits():
    torch.manual_seed(2)
    model = GPT(small_config())
    idx = torch.randint(0, 97, (1, 16))
    idx2 = idx.clone()
    idx2[0, 10:] = (idx2[0, 10:] + 1) % 97
    a, _ = model(idx)
    b, _ = model(idx2)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_rope_scores_depend_only_on_relative_position():
    """(R_m q) . (R_n k) = q^T R_{n-m} k: a Toeplitz score matrix, varying with the offset, norms preserved."""
    torch.manual_seed(3)
    T, D = 24, 64
    cos, sin = rope_cache(T, D, 10000.0)
    q, k = torch.randn(D, dtype=torch.float64), torch.randn(D, dtype=torch.float64)
    qr = apply_rope(q.expand(1, 1, T, D).clone(), cos.double(), sin.double())[0, 0]  # q placed at every position
    kr = apply_rope(k.expand(1, 1, T, D).clone(), cos.double(), sin.double())[0, 0]
    S = qr @ kr.T  # S[m, n] = score of q at m with k at n
    for offset in range(-T + 1, T):
        diag = torch.diagonal(S, offset)
        assert torch.allclose(diag, diag[0].expand_as(diag), atol=1e-4), offset
    assert torch.diagonal(S, 0)[0] != pytest.approx(torch.diagonal(S, 5)[0].item(), abs=1e-3)  # not constant
    torch.testing.assert_close(qr.norm(dim=-1), q.norm().expand(T))  # a rotation
    torch.testing.assert_close(qr[0], q)  # position 0 is the identity
    # the turn's sense (Llama's rotate_half layout: pair i is channels i and i + D/2): the first
    # channel's unit vector at position t goes to (cos, sin) of t * theta^0
    e = torch.zeros(1, 1, T, D, dtype=torch.float64)
    e[..., 0] = 1.0
    turned = apply_rope(e, cos.double(), sin.double())[0, 0]
    torch.testing.assert_close(turned[:, 0], cos.double()[:, 0])
    torch.testing.assert_close(turned[:, D // 2], sin.double()[:, 0])
    # RoFormer's frequencies: position t turns channel pair i by t * theta^(-2i/D)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, D, 2) / D)
    torch.testing.assert_close(cos.double(), angles.cos(), atol=1e-5, rtol=0)
    torch.testing.assert_close(sin.double(), angles.sin(), atol=1e-5, rtol=0)


def test_param_counts_of_named_configs_on_meta_device():
    counts = {}
    for name in CONFIGS:
        with torch.device("meta"):
            counts[name] = GPT(config_from_name(name)).num_params()
    assert abs(counts["1b"] - 1e9) / 1e9 < 0.10, counts["1b"]
    assert abs(counts["3b"] - 3e9) / 3e9 < 0.10, counts["3b"]
    assert abs(counts["toy"] - 150e6) / 150e6 < 0.10, counts["toy"]  # App. 13: ~150M
    assert counts["tiny"] < 10e6
    # analytic check of the 3b count: per layer q,o (C*C) + k,v (C*Hkv*D) + SwiGLU 3*C*F + 2 norms; untied V*C twice
    C, F_, L, V, kv = 3072, 9216, 24, 50304, 12 * 128
    assert counts["3b"] == L * (2 * C * C + 2 * C * kv + 3 * C * F_ + 2 * C) + C + 2 * V * C


def test_tied_and_untied_embeddings():
    tied, untied = GPT(small_config(tie_embeddings=True)), GPT(small_config(tie_embeddings=False))
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_params() - tied.num_params() == 97 * 64
    # an untied lm_head starts as the embedding does, N(0, 0.02) (not nn.Linear's uniform init)
    big = GPT(small_config(tie_embeddings=False, vocab_size=4096, n_layer=1))
    assert abs(big.lm_head.weight.std().item() - 0.02) < 0.0005
    assert abs(big.lm_head.weight.mean().item()) < 0.0005
    assert abs(big.wte.weight.std().item() - 0.02) < 0.0005  # GPT-2's N(0, 0.02) embedding


def test_each_block_reads_its_own_norms_and_swiglu_gates_through_silu():
    """Pre-norm blocks: the MLP reads mlp_norm(x) (not the attention's norm: both gains start at 1,
    so only a gradient tells them apart), SwiGLU = down(silu(gate x) * up x), and the loss reaches
    every parameter."""
    torch.manual_seed(0)
    model = GPT(small_config())
    idx = torch.randint(0, 97, (2, 16))
    model(idx, torch.roll(idx, -1, dims=1))[1].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    mlp, x = model.blocks[0].mlp, torch.randn(2, 16, 64)
    torch.testing.assert_close(mlp(x), mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x)))


def test_make_linear_follows_the_recipe_and_init():
    torch.manual_seed(4)
    lin = make_linear(256, 512, RECIPES["bf16"], std=0.02)
    assert isinstance(lin, nn.Linear) and lin.bias is None
    assert abs(lin.weight.std().item() - 0.02) < 0.002
    kinds = {name: make_linear(64, 32, recipe, lora_rank=4) for name, recipe in RECIPES.items()}
    assert type(kinds["nvfp4"]) is type(kinds["nvfp4_46"]) is type(kinds["naive_fp4"]) is nvfp4.NVFP4Linear
    assert not kinds["nvfp4"].four_over_six and kinds["nvfp4_46"].four_over_six
    assert isinstance(kinds["lora_naive"], lora_svd.NaiveLoRALinear)
    assert isinstance(kinds["lora_svd"], lora_svd.LoRASVDLinear)
    assert isinstance(kinds["fullstack"], lora_svd.LoRASVDLinear)
    # the residual projections (o_proj, down_proj) get GPT-2's 0.02 / sqrt(2L), the others 0.02
    model = GPT(small_config(n_layer=8, n_embd=128, ffn_hidden=512))
    for block in model.blocks:
        for name, layer in [*block.attn.named_children(), *block.mlp.named_children()]:
            std = 0.02 / math.sqrt(2 * 8) if name in ("o_proj", "down_proj") else 0.02
            assert abs(layer.weight.std().item() / std - 1) < 0.1, name


PAPER_ROWS = {  # Table 3's rows (and App. 13's baseline): linear, 4/6, attention, optimizer states
    "bf16": ("bf16", False, "bf16", "fp32"),
    "nvfp4": ("nvfp4", False, "bf16", "fp32"),
    "nvfp4_46": ("nvfp4", True, "bf16", "fp32"),
    "lora_naive": ("lora_naive", True, "bf16", "fp32"),
    "lora_svd": ("lora_svd", True, "bf16", "fp32"),
    "fullstack": ("lora_svd", True, "fp4", "nvfp4"),
    "naive_fp4": ("nvfp4", False, "fp4_all", "direct"),
}


def test_recipes_hold_the_paper_rows_and_check_their_names():
    """One table (model.RECIPES) says what each ablation row quantizes; attention names come from
    attention.py. The paper's rows must be there with these fields; a recipe you add (the docs invite
    it) is welcome."""
    for name, (linear, four_over_six, attn, states) in PAPER_ROWS.items():
        r = RECIPES[name]
        fields = (r.linear, r.four_over_six, r.attention, r.optim_states)
        assert fields == (linear, four_over_six, attn, states), name
    assert RECIPES["bf16"].describe() == "linear bf16, attention bf16, optimizer states fp32"
    assert set(r.attention for r in RECIPES.values()) <= set(attention.POLICIES)
    with pytest.raises(ValueError, match="Recipe.linear 'int8'"):
        Recipe(linear="int8")
    with pytest.raises(ValueError, match="Recipe.attention 'fp8'"):
        Recipe(attention="fp8")
    cfg = small_config(recipe=RECIPES["fullstack"])  # a checkpoint stores asdict(cfg): the recipe
    assert GPTConfig(**dataclasses.asdict(cfg)) == cfg  # comes back whole


def _math_sdpa(q, k, v, is_causal, enable_gqa):
    """SDPA as plain matmuls, so that FlopCounterMode sees them (it counts no CPU SDPA kernel)."""
    G, T = q.shape[1] // k.shape[1], q.shape[2]
    s = q @ k.repeat_interleave(G, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v.repeat_interleave(G, 1)


def test_flops_per_token_equals_a_count_of_the_models_matmuls(monkeypatch):
    """flops_per_token against torch's FlopCounterMode over one forward and backward: every mm
    and attention product the model runs, counted from their shapes. Two conventions of the formula
    stated: causal attention is half the full T x T products counted, and the 6N rule counts the
    norms' weights too (6 per parameter, though no matmul multiplies them)."""
    from torch.utils.flop_counter import FlopCounterMode
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", _math_sdpa)
    cfg = small_config(tie_embeddings=True)
    model, T = GPT(cfg), 16
    idx = torch.randint(0, cfg.vocab_size, (1, T))
    with FlopCounterMode(display=False) as counter:
        model(idx, idx)[1].backward()
    counts = counter.get_flop_counts()["Global"]
    linears, attention_full = counts[torch.ops.aten.mm], counts[torch.ops.aten.bmm]
    norms = (2 * cfg.n_layer + 1) * cfg.n_embd
    assert linears > 0 and attention_full > 0 and set(counts) == {torch.ops.aten.mm,
                                                                  torch.ops.aten.bmm}
    assert model.flops_per_token(T) * T == linears + attention_full / 2 + 6 * norms * T


def test_generate_greedy_is_deterministic_and_extends():
    torch.manual_seed(5)
    model = GPT(small_config()).eval()
    idx = torch.randint(0, 97, (2, 4))
    out1 = model.generate(idx, 6, temperature=0)
    out2 = model.generate(idx, 6, temperature=0)
    assert out1.shape == (2, 10) and torch.equal(out1, out2) and torch.equal(out1[:, :4], idx)
    sampled = model.generate(idx, 40, temperature=1.0, top_k=3)  # crops to block_size past 32 tokens
    assert sampled.shape == (2, 44) and int(sampled.max()) < 97
    # past block_size the context is the last block_size tokens
    nxt = model.generate(sampled, 1, temperature=0)[:, -1]
    torch.testing.assert_close(nxt, model(sampled[:, -32:])[0][:, -1].argmax(-1))


def _compiled_vs_eager(device):
    """model.compile_model on a model with every FP4 part (LoRA-SVD linears, FP4 attention): the FP4 parts run
    as custom ops inside the graph (tests/test_compile.py checks their bits); forward losses agree, backward gives
    finite grads."""
    torch.manual_seed(0)
    cfg = small_config(n_embd=128, n_head=2, n_kv_head=1, ffn_hidden=256, block_size=64, lora_rank=8,  # head dim
                       recipe=Recipe(linear="lora_svd", four_over_six=True, attention="fp4"))  # 64: FP4 attention takes it
    with torch.device(device):
        model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab_size, (2, 64), device=device)
    tgt = torch.randint(0, cfg.vocab_size, (2, 64), device=device)
    with torch.no_grad():
        eager = model(idx, tgt)[1]
    compiled = compile_model(model)
    _, loss = compiled(idx, tgt)
    loss.backward()
    assert abs(loss.item() - eager.item()) < 1e-3 * eager.item()  # RTN forward: same up to fused-op roundings
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert model.blocks[0].attn.q_proj.weight_res.grad.abs().sum() > 0


def test_compile_with_fp4_layers_cpu():  # ~20 s: inductor compiles the non-FP4 parts
    _compiled_vs_eager("cpu")


@pytest.mark.gpu
def test_gpu_compile_with_fp4_layers():
    _compiled_vs_eager("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("linear", ["nvfp4", "lora_svd"])
def test_gpu_fp4_forward_backward_never_waits_for_the_gpu(linear):
    """A training micro-batch with FP4 linears and FP4 attention (the fullstack recipe's model) must not
    synchronize the host with the GPU: every sync drains the launch queue, and the GPU then idles while Python
    launches the next kernels (six Python-number -> CUDA copies per layer once did that). torch's sync debug
    mode raises on any synchronizing torch call; a first micro-batch (route picking, autotuning) runs before."""
    torch.manual_seed(0)
    cfg = small_config(n_embd=256, n_head=4, n_kv_head=2, ffn_hidden=512, block_size=256,
                       recipe=Recipe(linear=linear, attention="fp4"))
    model = GPT(cfg).cuda()
    idx = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
    for debug_mode in (0, "error"):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(debug_mode)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(idx, idx)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # every parameter has its gradient but LoRA-SVD's L1, L2 (lora_svd.project_gradients makes theirs)
    lora = lambda name: name.endswith((".L1", ".L2"))
    assert all((p.grad is None) == lora(n) for n, p in model.named_parameters())


# --------------------------------------------------------------------------------------------------
# generate's sampling distribution: softmax(logits / temperature), restricted to the top k

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, -0.5])  # one fixed next-token row


def frequencies(temperature, top_k=None, n=20000):
    """Empirical next-token frequencies of model.generate over n rows, the model's last logits
    fixed to LOGITS (its forward replaced: the sampling is what is under test)."""
    model = GPT(small_config(n_layer=1, vocab_size=len(LOGITS)))
    model.forward = lambda idx, targets=None: (LOGITS.expand(*idx.shape, len(LOGITS)), None)
    out = model.generate(torch.zeros(n, 1, dtype=torch.long), 1, temperature=temperature,
                         top_k=top_k)
    return torch.bincount(out[:, -1], minlength=len(LOGITS)).double() / n


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_generate_samples_the_softmax_of_the_logits_over_the_temperature(temperature):
    expected = F.softmax(LOGITS.double() / temperature, dim=-1)
    assert (frequencies(temperature) - expected).abs().max() < 0.02  # ~5 sigma at n = 20000


def test_generate_temperature_zero_is_argmax_and_a_high_one_flattens():
    assert frequencies(0.0, n=100).tolist() == F.one_hot(LOGITS.argmax(), len(LOGITS)).tolist()
    entropy = lambda p: -(p[p > 0] * p[p > 0].log()).sum().item()
    low, mid, high = (entropy(frequencies(t)) for t in (0.25, 1.0, 8.0))
    assert low < mid < high and high > 0.95 * math.log(len(LOGITS))  # near uniform


@pytest.mark.parametrize("top_k,temperature", [(1, 1.0), (3, 0.5), (3, 2.0)])
def test_generate_top_k_samples_only_the_k_largest_in_their_softmax(top_k, temperature):
    freq = frequencies(temperature, top_k=top_k)
    top = LOGITS.topk(top_k).indices
    outside = torch.ones(len(LOGITS), dtype=torch.bool)
    outside[top] = False
    assert freq[outside].sum() == 0
    expected = F.softmax(LOGITS[top].double() / temperature, dim=-1)
    assert (freq[top] - expected).abs().max() < 0.02
