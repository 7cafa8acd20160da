"""SR seeds on the device and the micro-step in a CUDA graph: every SR draw of a step is a 0-d int64
tensor drawn by the device's RNG (nvfp4.sr_seed), and the kernels read it from memory, so a
captured graph that replays the step reads each replay's fresh seed and rounds as the reference does
for it."""
import functools
import math

import pytest
import torch

import nvfp4
import optim
import train
from kernels import nvfp4_quant
from model import GPT, GPTConfig, Recipe
from test_train import byte_data, micro  # noqa: F401  (fixtures)

BLOCKS = ((1, 16), (16, 1), (16, 16))  # the rows, cols and tile kernels


def test_sr_seeds_are_device_tensors_the_rng_draws_and_restores():
    """A seed is drawn on the tensor's device by torch's RNG there: on the CPU the very int the host
    RNG drew before (so a CPU run's draws are unchanged), on CUDA without a host int. Each draw
    advances the RNG; restoring its state (a checkpoint's) gives the same seeds again."""
    state = torch.get_rng_state()
    host = int(torch.randint(0, 2**31 - 1, ()))
    torch.set_rng_state(state)
    seed = nvfp4.sr_seed(device="cpu")
    assert seed.dtype == torch.int64 and seed.dim() == 0 and int(seed) == host
    c = nvfp4.linear_contract(True)
    seed_dx, _, seeds_dw = nvfp4.backward_draws(c, True, True, "cpu")
    torch.set_rng_state(state)
    nvfp4.sr_seed(device="cpu")
    again_dx, _, again_dw = nvfp4.backward_draws(c, True, True, "cpu")
    assert all(torch.is_tensor(s) for s in (seed_dx, *seeds_dw))
    assert len({int(s) for s in (seed, seed_dx, *seeds_dw)}) == 4  # each draw advanced the RNG
    assert torch.equal(seed_dx, again_dx) and all(map(torch.equal, seeds_dw, again_dw))


@pytest.mark.parametrize("block", BLOCKS)
def test_kernels_read_the_seed_from_memory(block):
    """What a graph replay does: the same seed tensor, its value rewritten in place by the step's
    next draw. The kernels read the new value and round as the reference (nvfp4.sr_uniforms) does
    for it: fresh codes each time, equal to the reference's."""
    x = torch.randn(32, 64)
    seed = nvfp4.sr_seed()
    codes = []
    for _ in range(2):
        got = nvfp4_quant.quantize(x, block, "sr", seed=seed)
        ref = nvfp4.quantize_reference(x, block, "sr", seed=int(seed))
        assert torch.equal(got[0], ref.codes) and torch.equal(got[1], ref.scales)
        codes.append(got[0])
        seed.copy_(nvfp4.sr_seed())
    assert not torch.equal(*codes)


def test_optimizer_seeds_come_from_its_saved_sr_generator():
    """The optimizers' SR seeds are drawn on the parameter's device by their "sr" generator (the one
    their checkpoint carries; on the CPU the ints the former CPU generator drew), and a loaded state
    dict continues its stream exactly."""
    p = torch.nn.Parameter(torch.randn(16, 32))
    opt = optim.QuantizedAdamW([p])
    first = optim._seeds(opt._generators, opt.seed, 2, p.device)
    expected = torch.randint(0, 2**31 - 1, (2,), generator=torch.Generator().manual_seed(opt.seed))
    assert first.dtype == torch.int64 and torch.equal(first, expected)
    resumed = optim.QuantizedAdamW([p])
    resumed.load_state_dict(opt.state_dict())
    assert list(opt.state_dict()["generator_states"]) == ["sr/cpu"]
    assert torch.equal(optim._seeds(opt._generators, opt.seed, 2, p.device),
                       optim._seeds(resumed._generators, resumed.seed, 2, p.device))


def test_cuda_graphs_flag_needs_one_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        train.main(["--cuda_graphs", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "--cuda_graphs" in err[0]


def test_an_eval_through_the_graphed_loss_leaves_autocast_off():
    """evaluate() runs a GraphedMicroStep's loss eagerly (eval mode) inside `with run.autocast()`,
    so the loss enters the run's autocast a second time, nested. Autocast must be off afterwards: one
    torch.autocast object entered twice restored the inner state on exit, and every projection and
    optimizer matmul after a --cuda_graphs eval ran in bf16 (the graphs run left the eager run's
    path at its first eval)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_embd=64, n_head=1, n_kv_head=1, ffn_hidden=128, block_size=16,
                    vocab_size=32, recipe=Recipe(linear="bf16", attention="bf16"))
    autocast = functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    loss = train._Loss(GPT(cfg), autocast).eval()
    x = torch.randint(0, 32, (2, 16))
    with torch.no_grad(), autocast():
        assert loss(x, x).dtype == torch.float32 and torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    a = torch.randn(8, 8)
    assert (a @ a).dtype == torch.float32


@pytest.mark.gpu
@pytest.mark.parametrize("block", BLOCKS)
def test_gpu_captured_quantize_replays_fresh_draws_equal_to_the_reference(block):
    x = torch.randn(256, 256, device="cuda")
    nvfp4.quantize(x, block, "sr")  # compile the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        seed = nvfp4.sr_seed(device="cuda")
        q = nvfp4.quantize(x, block, "sr", seed=seed)
    seeds = []
    for _ in range(3):
        graph.replay()
        ref = nvfp4.quantize_reference(x, block, "sr", seed=seed.clone())
        assert torch.equal(q.codes, ref.codes) and torch.equal(q.scales, ref.scales)
        seeds.append(int(seed))
    assert len(set(seeds)) == 3


@pytest.mark.gpu
@pytest.mark.parametrize("linear", ["nvfp4", "lora_svd"])
def test_gpu_graphed_micro_step_equals_eager_bit_for_bit(linear):
    """train.GraphedMicroStep's replay of forward + backward gives eager's loss and gradients bit
    for bit from the same RNG state (up to the sign of a zero gradient: graph_grads adds into
    zeros); two replays from one state draw differently."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=256, n_head=4, n_kv_head=2, ffn_hidden=512, block_size=256,
                    vocab_size=97, recipe=Recipe(linear=linear, attention="fp4"))
    model = GPT(cfg).cuda()
    x = torch.randint(0, cfg.vocab_size, (4, 256), device="cuda")
    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16)

    def step(forward):
        model.zero_grad(set_to_none=False)
        loss = forward(x, x)[1]
        loss.backward()
        return [loss.detach().clone()] + [p.grad.clone() for p in model.parameters()]

    def eager(x, y):
        with autocast():
            return model(x, y)

    train.graph_grads(model)
    step(eager)  # compile and tune the kernels outside the capture
    torch.cuda.manual_seed(1)
    want = step(eager)
    graphed = train.GraphedMicroStep(model, autocast, tuple(x.shape), "cuda")
    torch.cuda.manual_seed(1)
    got = step(graphed)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert not all(torch.equal(a, b) for a, b in zip(step(graphed), want))  # fresh draws


@pytest.mark.gpu
def test_gpu_train_with_cuda_graphs_is_the_eager_run(byte_data, micro, tmp_path):  # noqa: F811
    """train.py --cuda_graphs trains the eager run, bit for bit: each step's loss, gradient norm and
    val loss (grad_accum 2: two replays add into the gradients; the evals run eagerly)."""
    def rows(out, *flags):
        train.main(["--config", "micro", "--recipe", "fullstack", "--data", byte_data,
                    "--out_dir", str(out), "--device", "cuda", "--no_progress", "--max_steps", "4",
                    "--grad_accum", "2", "--eval_every", "2", *flags])
        return [(r.get("loss"), r.get("grad_norm"), r.get("val_loss"))
                for r in train.read_metrics(out / "metrics.jsonl") if "settings" not in r]
    assert rows(tmp_path / "graphs", "--cuda_graphs") == rows(tmp_path / "eager")


@pytest.mark.gpu
def test_gpu_train_with_compile_and_cuda_graphs_trains_the_compiled_run(byte_data, micro,  # noqa: F811
                                                                         tmp_path):
    """--compile --cuda_graphs (torch.compile's CUDA graph trees, mode reduce-overhead) trains: nothing
    the FP4 ops make outlives a step inside the trees' memory pool (which they refuse: a lazily cached
    device constant did), every step and eval is logged, and the losses are --compile's. Not bit for
    bit: two --compile runs in fresh processes already differ in step 1's gradients (Inductor's
    kernels: timed choice of reduction configs, atomic adds in the embedding backward), so the
    forward's first loss must agree to fp32 sums (1e-5) and three steps later to 2e-3."""
    def rows(out, *flags):
        train.main(["--config", "micro", "--recipe", "fullstack", "--data", byte_data,
                    "--out_dir", str(out), "--device", "cuda", "--no_progress", "--max_steps", "3",
                    "--eval_every", "2", "--compile", *flags])
        return [(r.get("step"), r.get("loss"), r.get("val_loss"))
                for r in train.read_metrics(out / "metrics.jsonl") if "settings" not in r]
    got, want = rows(tmp_path / "graphs", "--cuda_graphs"), rows(tmp_path / "compiled")
    assert [(s, a is None, b is None) for s, a, b in got] == [(s, a is None, b is None)
                                                               for s, a, b in want]
    losses = [(x, y) for (_, *a), (_, *b) in zip(got, want) for x, y in zip(a, b) if x is not None]
    assert all(math.isfinite(x) for x, _ in losses)
    assert losses[0][0] == pytest.approx(losses[0][1], rel=1e-5)
    assert all(x == pytest.approx(y, rel=2e-3) for x, y in losses)
