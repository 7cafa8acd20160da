"""torch.compile of the FP4 recipes. The NVFP4 linears (LoRA-SVD's too) and FP4 attention are
autograd.Functions (nvfp4.LinearFunction, attention.AttentionFunction) whose bodies run under
torch.compile as torch.library custom ops (nvfp4.linear_op, attention.attention_op, each with its
backward op) and eagerly as plain calls, so a fullstack transformer block compiles into one graph,
and a compiled run gives an eager run's bits from the same RNG state: the random draws (SR seeds,
eq. 2's Hadamard, dS's stream seed) are made inside the bodies when they run, in eager's order.

Where bits may differ, and why: inductor generates its own code for what lies between the ops
(RMSNorm, RoPE, SwiGLU), with its own summation order and without eager's bf16 rounding of every
intermediate. So the bf16 bit-for-bit tests run the "aot_eager_decomp_partition" backend (dynamo,
AOTAutograd's joint graph and functionalization, inductor's decompositions and min-cut partitioner:
everything torch.compile does to the ops, without inductor's code generation); the inductor tests
run fp32, where the FP4 layers' inputs come out bit-identical, and hold everything to the bit but
the sums inductor orders its own way (dX over the residual's branches, the RMSNorm weights over the
tokens)."""

import pytest
import torch
import torch.nn as nn

import attention
import lora_svd
import nvfp4
from model import RECIPES, Block, GPTConfig, compile_model, rope_cache

T = 32  # tokens per sequence; 2 sequences


def fullstack_block(n_embd=128, n_head=2, ffn_hidden=256, tokens=T):
    """A model.Block of the fullstack recipe (head dim 64: FP4 attention takes it) and its RoPE."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_embd=n_embd, n_head=n_head, n_kv_head=1, ffn_hidden=ffn_hidden,
                    block_size=tokens, lora_rank=8, recipe=RECIPES["fullstack"])
    return Block(cfg), rope_cache(tokens, cfg.head_dim, cfg.rope_theta)


def forward_backward(fn, module, rope, dtype, seed=1234, device="cpu", width=None, shape=(2, T)):
    """y, dX and every parameter's gradient of a forward and backward, from manual_seed(seed), on
    inputs of shape (*shape, width). dtype bf16: fp32 inputs, the forward under bf16 autocast, as
    train.py runs it."""
    module.zero_grad(set_to_none=True)
    width = width or module.mlp_norm.weight.shape[0]
    x = torch.randn(*shape, width, generator=torch.Generator().manual_seed(5)).to(device)
    x.requires_grad_()
    torch.manual_seed(seed)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        y = fn(x, *(t.to(device) for t in rope))
    y.float().square().sum().backward()
    return {"y": y, "dx": x.grad, **{n: p.grad for n, p in module.named_parameters()}}


def assert_same_bits(eager, compiled, except_=()):
    """The same tensors bit for bit; None (LoRA-SVD's L1, L2 get no gradient from autograd) in
    both."""
    assert eager.keys() == compiled.keys()
    same = lambda a, b: a is b is None or (a is not None and b is not None and torch.equal(a, b))
    different = [n for n in eager if n not in except_ and not same(eager[n], compiled[n])]
    assert not different, f"compiled differs from eager in {different}"


def test_fullstack_block_compiles_without_a_graph_break():
    block, rope = fullstack_block()
    x = torch.randn(2, T, 128, requires_grad=True)
    explained = torch._dynamo.explain(block)(x, *rope)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    # the FP4 parts, in it: the autograd.Functions' forward and backward bodies, as the custom ops
    ops = {str(n.target) for g in explained.graphs for m in g.modules()
           if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes}
    assert {"nanofp4.linear.default", "nanofp4.linear_backward.default",
            "nanofp4.attention.default", "nanofp4.attention_backward.default"} <= ops, ops


class CalledOps(torch.utils._python_dispatch.TorchDispatchMode):
    """The ops a piece of code dispatches (custom ops included), by name."""

    def __enter__(self):
        self.names = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_the_bodies_without_the_custom_ops():
    """Eager runs the Functions' bodies as plain calls: a custom op's dispatch is host time an eager
    step pays per layer (docs/performance.md); the compiled graph holds the ops (the test above)."""
    torch.manual_seed(0)
    x = torch.randn(16, 64, requires_grad=True)
    q = torch.randn(1, 1, 16, 64, requires_grad=True)
    with CalledOps() as called:
        for y in (nvfp4.NVFP4Linear(64, 64)(x), lora_svd.LoRASVDLinear(64, 64, 8)(x),
                  attention.attention(q, q, q, policy="fp4")):
            y.float().square().sum().backward()
    assert "aten.mm.default" in called.names  # the mode sees the layers' work
    assert not {n for n in called.names if n.startswith("nanofp4.")}, called.names


def test_compiled_block_gives_eager_bits():
    """fullgraph=True through AOTAutograd, under bf16 autocast as train.py runs: output, dX and
    every gradient (FP4 layers, L1/L2 zeros, norms) bit for bit; a second compiled step too; another
    seed differs."""
    block, rope = fullstack_block()
    eager = forward_backward(block, block, rope, torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager_decomp_partition")
    assert_same_bits(eager, forward_backward(compiled, block, rope, torch.bfloat16))
    assert_same_bits(eager, forward_backward(compiled, block, rope, torch.bfloat16))
    with pytest.raises(AssertionError):  # the draws matter: another RNG state gives other bits
        assert_same_bits(eager, forward_backward(compiled, block, rope, torch.bfloat16, seed=99))


class FP4Parts(nn.Module):
    """A LoRA-SVD and a direct NVFP4 linear on one input, as q and k (= v) of FP4 attention: each
    FP4 op once, small enough for Triton's interpreter."""

    def __init__(self):
        super().__init__()
        self.a, self.b = lora_svd.LoRASVDLinear(64, 64, 8), nvfp4.NVFP4Linear(64, 64)

    def forward(self, x, *_):
        q, k = (f(x).view(1, 1, 16, 64) for f in (self.a, self.b))
        return attention.attention(q, k, k, policy="fp4")


def test_compiled_fp4_ops_give_eager_bits_on_the_kernel_route(monkeypatch):
    """NANOFP4_ROUTE=kernels: the ops run the Triton kernels (the interpreter on a CPU), as on a
    GPU, under bf16 autocast through AOTAutograd: output, dX and every gradient bit for bit. (A
    whole block on this route takes the interpreter ~25 s a pass: the FP4 parts alone here.)"""
    monkeypatch.setenv("NANOFP4_ROUTE", "kernels")
    torch.manual_seed(0)
    model = FP4Parts()
    run = lambda fn: forward_backward(fn, model, (), torch.bfloat16, width=64, shape=(16,))
    eager = run(model)
    assert_same_bits(eager, run(torch.compile(model, fullgraph=True,
                                              backend="aot_eager_decomp_partition")))


def assert_close_sums(eager, compiled, names, rel=1e-5):
    for n in names:  # by default a few fp32 roundings of the largest term
        assert (compiled[n] - eager[n]).abs().max() <= rel * eager[n].abs().max(), n


def test_inductor_block_gives_eager_bits_in_the_fp4_layers():
    """The default backend (inductor, what train.py --compile runs) schedules the opaque ops in the
    graph's order: the output and every FP4 layer's gradients bit for bit; dX and the norms' weight
    gradients within fp32 rounding."""
    block, rope = fullstack_block()
    eager = forward_backward(block, block, rope, torch.float32)
    compiled = forward_backward(torch.compile(block, fullgraph=True), block, rope, torch.float32)
    sums = ("dx", "attn_norm.weight", "mlp_norm.weight")
    assert_same_bits(eager, compiled, except_=sums)
    assert_close_sums(eager, compiled, sums)


class Siblings(nn.Module):
    """Three FP4 layers on one input, as q, k and v: their backward ops depend on nothing of each
    other, so a compiler free to reorder them would change which layer gets which draws."""

    def __init__(self):
        super().__init__()
        self.a, self.c = (lora_svd.LoRASVDLinear(128, 128, 8) for _ in "ac")
        self.b = nvfp4.NVFP4Linear(128, 128)

    def forward(self, x, *_):
        return self.a(x) + self.b(x) + self.c(x)


@pytest.mark.parametrize("device, mode", [("cpu", None),
                                          pytest.param("cuda", None, marks=pytest.mark.gpu),
                                          pytest.param("cuda", "reduce-overhead",
                                                       marks=pytest.mark.gpu)])
def test_inductor_keeps_the_draws_of_independent_layers(device, mode):
    """Under model.compile_model (inductor; "reduce-overhead": in CUDA graphs, as train.py
    --compile --cuda_graphs) the layers' output and weight gradients equal eager's bit for bit (the
    dX sum of the three branches is inductor's own). Failed on the H200 with inductor's default
    reordering (a's and b's weight gradients: another order of their draws)."""
    torch.manual_seed(0)
    model = Siblings().to(device)
    eager = forward_backward(model, model, (), torch.float32, device=device, width=128)
    compiled = forward_backward(compile_model(model, mode), model, (), torch.float32,
                                device=device, width=128)
    assert_same_bits(eager, compiled, except_=("dx",))
    assert_close_sums(eager, compiled, ("dx",))


@pytest.mark.gpu
def test_gpu_compiled_block_gives_eager_bits():
    """On the GPU (the Triton kernels), under bf16 autocast, through AOTAutograd as on the CPU:
    the output and every FP4 layer's gradients bit for bit. The RMSNorms' backward is decomposed
    into other CUDA kernels than eager's fused one, which sum in another order (seen on the H200:
    their weights' gradients and dX differ there, nothing else), so those are held to summation-
    order closeness."""
    block, rope = fullstack_block()
    block = block.cuda()
    eager = forward_backward(block, block, rope, torch.bfloat16, device="cuda")
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager_decomp_partition")
    ours = forward_backward(compiled, block, rope, torch.bfloat16, device="cuda")
    norms = ("dx", "attn_norm.weight", "mlp_norm.weight")
    assert_same_bits(eager, ours, except_=norms)
    assert_close_sums(eager, ours, norms, rel=2e-2)  # bf16 intermediates: a few bf16 roundings


def _op_cases():
    """(op, args) for every custom op, with real inputs from one eager forward."""
    torch.manual_seed(0)
    bf16, fp32 = torch.bfloat16, torch.float32
    x, w = torch.randn(2, 16, 64, dtype=bf16), torch.randn(32, 64)
    L1, L2 = torch.randn(8, 64), torch.randn(32, 8)
    dy = torch.randn(2, 16, 32, dtype=bf16)
    lin, lin_bwd = nvfp4.linear_op, nvfp4.linear_backward_op
    _, *lin_made = lin(x, w, None, None, 1.0, bf16, True)
    _, *lora_made = lin(x, w, L1, L2, 0.5, bf16, True)
    q, k = torch.randn(1, 2, 32, 64, dtype=bf16), torch.randn(1, 1, 32, 64, dtype=bf16)
    o, lse, *att_made = attention.attention_op(q, k, k, True, "fp4")
    none = [x[:0] for _ in "qkv"]
    return [(lin, (x, w, None, None, 1.0, bf16, True)),
            (lin_bwd, (dy, *lin_made, None, None, 1.0, bf16, True, fp32, fp32, True, True, None)),
            (lin_bwd, (dy, *lin_made, None, None, 1.0, bf16, True, fp32, bf16, True, False, None)),
            (lin_bwd, (dy, *lin_made, None, None, 1.0, bf16, True, fp32, fp32, True, True,
                       torch.randn(2, 16, 64))),  # dX summed into a tensor (_GradientSum)
            (lin, (x, w, L1, L2, 0.5, bf16, True)),
            (lin_bwd, (dy, *lora_made, L1, L2, 0.5, bf16, True, fp32, fp32, True, True, None)),
            (attention.attention_op, (q, k, k, True, "fp4")),
            (attention.attention_op, (q, k, k, True, "bf16")),
            (attention.attention_backward_op, (q, o, lse, *att_made, *none, True, "fp4"))]


def test_no_op_leaves_an_argument_it_writes_to_a_default():
    """An argument an op writes (linear_backward's dx_into) is passed by every call: torch 2.11's
    in-place bookkeeping (the device's torch) drops one left at its default and then indexes it,
    failing every --compile run; CI's torch does not, so the schema is checked here."""
    ops = {op for op, _ in _op_cases()}
    writes = [(op, a) for op in ops for a in op._opoverload._schema.arguments
              if a.alias_info is not None and a.alias_info.is_write]
    assert writes  # linear_backward's dx_into
    assert not [f"{op}: {a.name}" for op, a in writes if a.has_default_value()]


@pytest.mark.parametrize("route", ["reference", "kernels"])
def test_fake_ops_match_the_real_ones(route, monkeypatch):
    """torch.library.opcheck: each op's register_fake gives the real outputs' shapes, dtypes and
    strides, what the compiler plans with (on a CPU the kernel route keeps W as the Hopper kernels'
    bf16 grid values)."""
    monkeypatch.setenv("NANOFP4_ROUTE", route)
    for op, args in _op_cases():
        torch.library.opcheck(op, args, test_utils="test_faketensor")
