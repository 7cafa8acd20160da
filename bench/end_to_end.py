"""
The end-to-end rows of the speed table: `train.py` itself, every recipe with and without --compile,
at the paper's 1M-token optimizer step (batch_size x grad_accum x seq_len = 2^20 tokens), against
`bf16` and the baseline a user would actually run, `bf16 --compile`. tokens/s is the median of
train.py's per-step rates (metrics.jsonl) after WARMUP_STEPS steps: the first step compiles the
model's kernels and allocates the optimizer state, and the NVFP4 optimizer's second step still
takes seconds (measured on the H200: 7.4 s, 6.6 s, then 0.06 s; its first fused update, most likely
Triton compiling it); neither is what a run of days spends.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_TOKENS = 2**20  # the paper's 1M-token batch
# (sequences, seq_len) per micro-step
MICRO_BATCH = {"toy": (16, 1024), "1b": (8, 2048), "tiny": (2, 64)}
WARMUP_STEPS = 2  # not timed (the docstring says why); bench/run.py --steps must exceed it
RUNS = (("bf16", "adamw"), ("nvfp4", "adamw"), ("nvfp4_46", "adamw"), ("lora_naive", "adamw"),
        ("lora_svd", "adamw"), ("fullstack", "adamw"), ("fullstack", "root"))


def command(config, recipe, optimizer, compile, steps, out_dir, data=None,
            step_tokens=STEP_TOKENS, device=None, cuda_graphs=False):
    batch, seq_len = MICRO_BATCH[config]
    grad_accum = max(1, step_tokens // (batch * seq_len))
    cmd = [sys.executable, "train.py", "--config", config, "--recipe", recipe,
           "--optimizer", optimizer,
           "--max_steps", str(steps), "--batch_size", str(batch), "--grad_accum", str(grad_accum),
           "--seq_len", str(seq_len), "--warmup", "1", "--eval_every", "0", "--log_every", "1",
           "--save_every", "-1", "--no_progress", "--seed", "0", "--out_dir", out_dir]
    cmd += ["--compile"] if compile else []
    cmd += ["--cuda_graphs"] if cuda_graphs else []
    cmd += ["--data", data] if data else []
    cmd += ["--device", device] if device else []
    return cmd


def run_one(config, recipe, optimizer, compile, steps, runs_dir, timeout, cuda_graphs=False, **kw):
    """One train.py run in a fresh directory; its summary as a row (or the error's last lines)."""
    name = f"{config}_{recipe}_{optimizer}{'_compile' if compile else ''}"
    name += "_graphs" if cuda_graphs else ""
    out_dir = os.path.join(runs_dir, name)
    # runs_dir belongs to the benchmark: a rerun replaces its run
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    cmd = command(config, recipe, optimizer, compile, steps, out_dir, cuda_graphs=cuda_graphs, **kw)
    result = {"section": "train", "name": name, "config": config, "recipe": recipe,
              "optimizer": optimizer, "compile": compile, "cuda_graphs": cuda_graphs,
              "command": " ".join(["python"] + cmd[1:])}
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**result, "error": f"timed out after {timeout:.0f} s"}
    with open(os.path.join(out_dir, "train.log"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    summary_path = os.path.join(out_dir, "summary.json")
    if proc.returncode != 0 or not os.path.exists(summary_path):
        return {**result, "error": f"exit {proc.returncode}: " + (proc.stdout + proc.stderr)[-600:]}
    with open(summary_path) as f:
        s = json.load(f)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        tokens_per_s, rates = steady_rate(map(json.loads, f))
    return {**result, "tokens_per_s": tokens_per_s, "step_rates": rates,
            "step_tokens": s["tokens"] // s["steps"],
            "steps": s["steps"], "params": s["params"], "peak_mem_gib": s["peak_mem_bytes"] / 2**30,
            "optimizer_bytes_per_param": s["optimizer_bytes_per_param"], "mfu": s.get("mfu")}


def steady_rate(metrics):
    """(the row's tokens/s, the rates it is taken from) over a run's metrics.jsonl rows: the median
    of the steps after WARMUP_STEPS, not their best (a fast outlier step must not flatter a row)."""
    rates = [row["tokens_per_s"] for row in metrics
             if "tokens_per_s" in row and row["step"] > WARMUP_STEPS]
    return statistics.median(rates), rates


def add_ratios(rows):
    """Each train row's tokens/s against bf16 (AdamW) and bf16 --compile of the same config (without
    --cuda_graphs: what a user runs), where measured, among `rows`: one call's rows (the host's
    speed varies between calls, so a ratio is only taken within one). The baseline's rate is kept
    with the ratio (bf16_tokens_per_s, bf16_compile_tokens_per_s)."""
    base = {(r["config"], r["compile"]): r["tokens_per_s"] for r in rows
            if r.get("section") == "train" and r["recipe"] == "bf16" and r["optimizer"] == "adamw"
            and not r.get("cuda_graphs") and "error" not in r}
    for r in rows:
        if r.get("section") == "train" and "error" not in r:
            for key, compiled in (("bf16", False), ("bf16_compile", True)):
                if (r["config"], compiled) in base:
                    r[f"vs_{key}"] = r["tokens_per_s"] / base[(r["config"], compiled)]
                    r[f"{key}_tokens_per_s"] = base[(r["config"], compiled)]
    return rows
