#!/usr/bin/env bash
# The whole GPU check in one call (run on the H200 through the device tool, from the repo root):
#   bash scripts/gpu_check.sh [tests] [bench] [train]      (default: tests bench)
# Results land in $OUT (the device tool's folder) or ./gpu_out: one log per stage plus the benchmarks' JSON.
# Needs the prepared corpus in data_cache/default (carry it: it is git-ignored).
set -uo pipefail
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages=${*:-tests bench}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/env.txt" 2>&1
for stage in $stages; do
  case $stage in
    tests) timeout 900 python -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
    bench) for b in bench_nvfp4 bench_lora_svd bench_optim bench_attention; do
             [ -f $b.py ] || continue
             echo "== $b"; timeout 300 python $b.py --out "$OUT/$b.json" 2>&1 | tail -40
           done 2>&1 | tee "$OUT/bench.log" ;;
    train) bash scripts/ablation.sh 2>&1 | tee "$OUT/train.log" | tail -40 ;;
  esac
done
