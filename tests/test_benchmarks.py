"""The four benchmark scripts of the GPU check run end to end: `--dry` runs every code path once on the CPU (Triton's
interpreter, tiny shapes, no timing) and writes the JSON the README's tables come from. A script broken here
would waste a GPU call (device time is scarce), so CI runs them."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_dry(script, tmp_path, *flags):
    out = tmp_path / f"{script}.json"
    proc = subprocess.run([sys.executable, f"{script}.py", "--dry", "--out", str(out), *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_nvfp4_dry_run(tmp_path):
    result = run_dry("bench_nvfp4", tmp_path)
    assert result["dry"] and {r["section"] for r in result["rows"]} == {"quantize", "gemm", "linear"}
    assert all(r["ms"] > 0 for r in result["rows"])


def test_bench_nvfp4_rows_sweep_dry_run(tmp_path):
    result = run_dry("bench_nvfp4", tmp_path, "--rows_sweep")
    sweep = [r["name"] for r in result["rows"] if r["section"] == "rows sweep"]
    assert len(sweep) == 27 and any(n.endswith("loop") for n in sweep)  # 9 launch settings x RTN, 4/6, SR+RHT


def test_bench_lora_svd_dry_run(tmp_path):
    result = run_dry("bench_lora_svd", tmp_path)
    names = [r["name"] for r in result["rows"]]
    assert "nvfp4 (4/6)" in names and "lora_svd fused cublas" in names and "lora_svd fused triton" in names
    assert result["pieces"] and not [p for p in result["pieces"] if "error" in p]


def test_bench_attention_dry_run(tmp_path):
    result = run_dry("bench_attention", tmp_path)
    names = {r["name"] for r in result["rows"]}
    assert {"ours bf16", "ours fp4", "ours fp4_all"} <= names and any(n.startswith("sdpa") for n in names)
    assert result["bf16_max_abs_err_vs_sdpa"] < 0.05  # our bf16 kernel (interpreted) against SDPA on the CPU


def test_bench_optim_dry_run(tmp_path):
    result = run_dry("bench_optim", tmp_path)
    assert {"copy", "fused_quantized_adamw_kernel", "quantized_adamw_step", "torch_adamw_fused"} <= set(result["adamw"])
    assert 1.0 < result["adamw"]["quantized_adamw_step"]["state_bytes_per_param"] < 1.3  # packed NVFP4 states
    assert [tuple(r["shape"]) for r in result["root"]] == [(64, 128), (128, 128), (128, 384)]  # the tiny config
