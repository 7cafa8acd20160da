#!/usr/bin/env bash
# The toy ablation on a 2-GPU H200 machine (nvidia-h200-x2) in one call (~9 min): scripts/ablation.sh over both
# GPUs, one job per GPU at a time (comparable tokens/s), every recipe x optimizer, after a 2-step compile warm-up
# of each recipe (WARM=1: on a fresh machine fullstack compiles for 60-100 s). STEPS (default 150) of 16 x 512
# tokens, each run capped at JOB_TIMEOUT (120 s), the queue stopped at DEADLINE (540 s); rerunning the script on
# the same machine skips finished runs.
# Results in $OUT/ablation/: README_results.md (table), loss_curves.png, results.json, runs.tgz (every run's files).
# Needs data_cache/default (carry it). The DDP-vs-1-GPU, 1b, 3b and --compile checks: scripts/gpu_scale.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-150} EVAL_EVERY=${EVAL_EVERY:-50} EVAL_ITERS=${EVAL_ITERS:-5} JOB_TIMEOUT=${JOB_TIMEOUT:-120} \
  DEADLINE=${DEADLINE:-540} GPUS=${GPUS:-"0 1"} RUNS=${RUNS:-runs/ablation} bash scripts/ablation.sh
