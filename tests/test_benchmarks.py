"""The speed table's one command runs end to end: `bench/run.py --dry_run` runs every section once on the CPU (tiny
shapes, the tiny config through train.py) and writes the record, so a broken benchmark shows up in CI and not in
a GPU run."""

import inspect
import json
import os
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest
import torch

import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(*flags):
    return subprocess.run([sys.executable, "bench/run.py", *flags], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)


def test_bench_dry_run_writes_every_row_with_its_baseline(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16)  # a tiny corpus for train.py
    data.write_shard(str(tmp_path / "train.bin"), tokens[:18_000])
    data.write_shard(str(tmp_path / "val.bin"), tokens[18_000:])
    out = tmp_path / "record"
    proc = bench("--dry_run", "--out_dir", str(out), "--runs_dir", str(tmp_path / "runs"), "--data", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.load(open(out / "speed.json"))["rows"]
    assert {r["section"] for r in rows} == {"attention", "linear", "optim", "quantize", "train"}
    for r in rows:
        assert r["measured"]["commit"] and r["measured"]["device"] == "cpu"
        if r["section"] != "train":
            assert r["ms"] > 0 and r["baseline_ms"] > 0 and r["baseline"]
            assert abs(r["speed_vs_baseline"] - r["baseline_ms"] / r["ms"]) < 1e-9
    attention = [r for r in rows if r["section"] == "attention"]
    assert {r["name"].split("'")[1] for r in attention} == {"bf16", "fp4", "fp4_all"}
    assert all(r["sdpa_backend"] != "unknown" for r in attention)  # the profiler named SDPA's backend
    train = {(r["recipe"], r["compile"]): r for r in rows if r["section"] == "train"}
    assert set(train) == {("bf16", False), ("fullstack", False)}
    for r in train.values():
        assert "error" not in r, r["error"]
        assert r["tokens_per_s"] > 0 and "--max_steps 3" in r["command"]
        assert r["step_rates"] and r["tokens_per_s"] == r["step_rates"][0]  # step 3 only
    assert train[("bf16", False)]["vs_bf16"] == 1.0 and 0 < train[("fullstack", False)]["vs_bf16"]
    assert "| tiny | `fullstack` | adamw |" in (out / "speed.md").read_text()

    # a partial rerun replaces its own rows and keeps the others
    before = {(r["section"], r["name"]): r for r in rows}
    proc = bench("--dry_run", "--only", "quantize", "--out_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = {(r["section"], r["name"]): r for r in json.load(open(out / "speed.json"))["rows"]}
    assert after.keys() == before.keys()
    assert all(after[k] == before[k] for k in after if k[0] != "quantize")


def test_bench_bad_flag_gives_one_line_and_exit_2():
    proc = bench("--dry_run", "--only", "attention,warp_drive")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "warp_drive" in proc.stderr
    for runs, word in (("fullstack:adamw:warp", "warp"), ("fullstack:adamw:graphs", "--cuda_graphs")):
        proc = bench("--dry_run", "--only", "train", "--runs", runs)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and word in proc.stderr


def test_profile_step_bad_recipe_gives_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "bench/profile_step.py", "--dry_run", "--recipes",
                           "bf16,int2"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "int2" in proc.stderr


def test_profile_keys_tell_torchs_elementwise_kernels_apart():
    """Two of torch's elementwise kernels whose names differ only after their shared template
    prefix (names as the H200's profiler gives them) get different keys; Triton's keep theirs."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from profile_step import kernel_key
    prefix = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
              "at::native::")
    copy = prefix + ("direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()()"
                     " const::{lambda()#7}::operator()() const::{lambda(c10::BFloat16)#1}>"
                     "(at::TensorIteratorBase&, ...)")
    add = prefix + ("CUDAFunctor_add<float>>(at::TensorIteratorBase&, "
                    "at::native::CUDAFunctor_add<float> const&)::{lambda(int)#1}>(int, ...)")
    assert copy[:80] == add[:80] and kernel_key(copy) != kernel_key(add)
    assert "direct_copy_kernel_cuda" in kernel_key(copy) and "BFloat16" in kernel_key(copy)
    assert kernel_key("_quantize_rows_kernel") == "_quantize_rows_kernel"


def test_linear_rows_quantize_x_and_w_in_every_call(monkeypatch):
    """The layer rows time one call as a layer that reads its input alone makes it: X and W
    quantized each time, not kept from the call before (the same x and W every call)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import layers
    import nvfp4
    made = []
    for name in ("quantized_input", "quantized_weight"):
        monkeypatch.setattr(nvfp4, name, lambda *a, f=getattr(nvfp4, name), name=name:
                            made.append(name) or f(*a))
    monkeypatch.setattr(layers, "time_ms", lambda fn, device: [fn() for _ in range(2)] and 1.0)
    monkeypatch.setattr(layers, "host_ms", lambda fn, device: 1.0)
    layers.linear_rows("cpu", dry=True)
    # three FP4 layers, two calls each
    assert (made.count("quantized_input"), made.count("quantized_weight")) == (6, 6)


def test_profile_by_function_puts_each_op_where_the_model_runs_it():
    """--by_function's table: an op lands in the repository function that ran it, an op of
    autograd's own backward node in the forward function that made the node (the last op to record
    its sequence number: SDPA's backward goes to attention_core, not to RoPE just before it), and
    the keys add up to the profile's own op time, each op counted once."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import model
    import profile_step
    torch.manual_seed(0)
    gpt = model.GPT(model.config_from_name("tiny", recipe=model.RECIPES["bf16"]))
    x = torch.randint(0, gpt.cfg.vocab_size, (1, 32))
    with profile_step.stack_profile([torch.profiler.ProfilerActivity.CPU]) as prof:
        profile_step.micro_step(gpt, x, x, "cpu")
    rms = f"model.py:{inspect.getsourcelines(model.RMSNorm.forward)[1]} RMSNorm.forward"
    core = f"model.py:{inspect.getsourcelines(model.attention_core)[1]} attention_core"
    own = sum(e.self_cpu_time_total for e in prof.events() if e.name.startswith("aten::")) / 1e3
    for frames_as_events in (True, False):
        if not frames_as_events:  # as torch 2.11 records a CUDA profile: no frame events, stacks
            for e in prof.events():
                e.name = "(a frame)" if profile_step.FRAME.match(e.name) else e.name
        times = profile_step.time_by_function(prof.events(), on_gpu=False)
        assert sum(times.values()) == pytest.approx(own)
        sites = [k.split(" | ") for k in times]
        assert any(site == rms for site, op in sites)
        assert any(site == "backward of " + rms for site, op in sites)
        assert any(site == "backward of " + core and "backward" in op for site, op in sites)


@pytest.mark.gpu
def test_profile_step_names_the_quantize_kernels_of_an_fp4_recipe(tmp_path):
    """The profile that results/speed/ quotes: the FP4 recipe's micro-step holds the quantize
    kernels and bf16's does not, and the kernel times add up to at most the wall time."""
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, "bench/profile_step.py", "--config", "tiny", "--recipes",
                           "bf16,nvfp4", "--batch_size", "2", "--seq_len", "256", "--iters", "1",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.load(open(out))
    assert record["gemm_route"] in ("grid values", "blackwell dot_scaled")
    r = record["recipes"]
    assert any("_quantize_rows_kernel" in k for k in r["nvfp4"]["kernels"])
    assert not any("quantize" in k for k in r["bf16"]["kernels"])
    for rec in r.values():
        assert rec["wall_ms"] > 0 and 0 < rec["busy"] <= 1.05
    assert "nvfp4 over bf16:" in proc.stdout


def test_ratios_are_taken_within_one_call():
    """The host's speed varies between calls to the GPU machine, so a train row's ratio is against
    the bf16 row measured in its own call (kept with the ratio), never against another call's."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import end_to_end

    def row(recipe, tokens_per_s, compile=False, cuda_graphs=False, optimizer="adamw"):
        return {"section": "train", "config": "1b", "recipe": recipe, "optimizer": optimizer,
                "compile": compile, "cuda_graphs": cuda_graphs, "tokens_per_s": tokens_per_s}
    first = end_to_end.add_ratios([row("bf16", 100.0), row("fullstack", 60.0),
                                   row("bf16", 150.0, compile=True)])
    assert first[1]["vs_bf16"] == 0.6 and first[1]["bf16_tokens_per_s"] == 100.0
    assert first[1]["vs_bf16_compile"] == 0.4 and first[0]["vs_bf16"] == 1.0
    second = end_to_end.add_ratios([row("bf16", 90.0), row("fullstack", 70.0, cuda_graphs=True)])
    assert second[1]["vs_bf16"] == 70.0 / 90.0 and "vs_bf16_compile" not in second[1]
    alone = end_to_end.add_ratios([row("fullstack", 70.0, cuda_graphs=True)])
    assert "vs_bf16" not in alone[0]  # no bf16 in its call: no ratio
    # the baseline is what a user runs: bf16 AdamW, eager, whatever else the call measured
    others = end_to_end.add_ratios([row("bf16", 80.0), row("bf16", 95.0, cuda_graphs=True),
                                    row("bf16", 85.0, optimizer="root"), row("fullstack", 60.0)])
    assert others[3]["bf16_tokens_per_s"] == 80.0 and others[3]["vs_bf16"] == 0.75


def test_a_train_rows_rate_is_the_median_of_its_timed_steps():
    """The warm-up steps (compilation, autotuning) are not timed, and the row reports the median of
    the rest, not the fastest step."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import end_to_end

    assert end_to_end.WARMUP_STEPS == 2
    metrics = [{"step": 1, "tokens_per_s": 10.0}, {"step": 2, "tokens_per_s": 20.0},
               {"step": 2, "eval": True}, {"step": 3, "tokens_per_s": 50.0},
               {"step": 4, "tokens_per_s": 30.0}, {"step": 5, "tokens_per_s": 40.0}]
    assert end_to_end.steady_rate(metrics) == (40.0, [50.0, 30.0, 40.0])


def test_attention_tiles_gives_each_candidate_the_same_draws_and_rejects_bad_tiles():
    """bench/attention_tiles.py times each candidate dK/dV (or dQ) tiling with the same dS draws
    (the interpreter runs its own tiles: every candidate's gradients equal the committed run's),
    its --schedule rows keep every bit, and a malformed --tiles or --schedule is one line, exit 2."""
    def run(*flags):
        return subprocess.run([sys.executable, "bench/attention_tiles.py", "--dry_run", *flags],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)

    def assert_same_gradients(proc, prefixes):  # one row per candidate, 0 from the committed tiles
        assert proc.returncode == 0, proc.stderr[-3000:]
        rows = [line for line in proc.stdout.splitlines() if line.startswith(prefixes)]
        assert len(rows) == 2 and all(r.rstrip(" |").endswith("0.0e+00") for r in rows), proc.stdout

    assert_same_gradients(run("--tiles", "32x64x4x3,16x128x8x2"), ("| 32 x 64", "| 16 x 128"))
    # the dQ pass's tiles, dQ compared; a register cap reaches the launch (and its row)
    proc = run("--pass", "dq", "--tiles", "64x32x4x4,32x64x4x3r168")
    assert "| dq tiles" in proc.stdout and "max |dQ - committed's|" in proc.stdout
    assert_same_gradients(proc, ("| 64 x 32, 4, 4 |", "| 32 x 64, 4, 3, 168 regs |"))
    for bad in ("32x64", "32x64x4x3r"):
        proc = run("--tiles", bad)
        assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and bad in proc.stderr
    # the launch order's head groups: one row each (1 kv head a group, and all), the same bits
    proc = run("--schedule", "1,1000000000")
    rows = [r for r in proc.stdout.splitlines() if r.startswith(("| 1 | 1 |", "| 1000000000 |"))]
    assert proc.returncode == 0 and len(rows) == 2, proc.stdout + proc.stderr[-3000:]
    assert all(r.rstrip(" |").endswith("True") for r in rows), proc.stdout
    proc = run("--schedule", "0")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "'0'" in proc.stderr


def test_fingerprint_is_stable_and_sees_a_changed_bit(monkeypatch):
    """tools/fingerprint.py's hashes: the same twice in one process (every part is seeded), and a
    contract that rounds X stochastically instead moves the linear layers' hashes and not
    attention's."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "tools"))
    import fingerprint
    import nvfp4

    def hashes(last=None):  # the parts in order, up to `last` (the GPT micro-step, last, takes most)
        out = {}
        for name, t in fingerprint.parts("cpu"):
            out[name] = fingerprint.digest(t)
            if name == last:
                break
        return out

    monkeypatch.setenv("NANOFP4_ROUTE", "reference")
    before = hashes()
    assert hashes() == before
    with monkeypatch.context() as m:
        m.setitem(nvfp4.LINEAR, "forward.x", replace(nvfp4.LINEAR["forward.x"], rounding="sr"))
        after = hashes(last="attention fp4")
    assert after["NVFP4Linear fp32"] != before["NVFP4Linear fp32"]
    assert after["attention fp4"] == before["attention fp4"]
    # the backward's bits are hashed too: a contract that moves only dX, or only dW, moves the hash
    # (4/6 on one operand: the same draws from the RNG, other bits)
    assert hashes(last="NVFP4Linear fp32")["NVFP4Linear fp32"] == before["NVFP4Linear fp32"]
    for name in ("dgrad.dy", "wgrad.dy"):
        with monkeypatch.context() as m:
            m.setitem(nvfp4.LINEAR, name, replace(nvfp4.LINEAR[name], four_over_six=True))
            assert hashes(last="NVFP4Linear fp32")["NVFP4Linear fp32"] != before["NVFP4Linear fp32"]
    # and every fp32 bit: one ulp apart hash apart
    x = torch.randn(64)
    assert fingerprint.digest([x]) != fingerprint.digest([torch.nextafter(x, x + 1)])


def test_quantize_tiles_keep_every_bit_and_bad_configs_give_one_line():
    """bench/quantize_tiles.py's dry run (the interpreter, tiny shapes): other launch configurations
    of the rows kernel's SR passes give the committed configuration's outputs bit for bit (the
    script exits 1 where one does not); a malformed candidate is one line and exit 2."""
    run = lambda *flags: subprocess.run([sys.executable, "bench/quantize_tiles.py", "--dry_run",
                                         *flags], cwd=ROOT, capture_output=True, text=True,
                                        timeout=600)
    proc = run("--kernel", "rows_sr", "--configs", "128x4x1,64x2x2")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| (")]
    assert len(rows) == 2 and all(line.endswith("| same |") for line in rows)
    proc = run("--kernel", "cols", "--configs", "4r168,fast")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "fast" in proc.stderr
