#!/usr/bin/env bash
# The training check on a 2-GPU H200 machine (nvidia-h200-x2) in one call (~9 min):
#   1. the toy ablation, every recipe x optimizer, one job per GPU at a time (comparable tokens/s):
#      scripts/ablation.sh with STEPS (default 100) of 16 x 512 tokens, stopped at ABLATION_DEADLINE seconds
#   2. side by side: GPU0 the 1b config's main recipe (fullstack/root) on one GPU; GPU1 the 1-GPU half of the
#      DDP comparison, then toy fullstack with --compile
#   3. the same toy bf16 run under torchrun on both GPUs (DDP): the data do not depend on the world size
#      (data.TokenLoader), so its losses must track the 1-GPU run's step for step
# Results in $OUT: ablation/ (table, plot, JSON, runs.tgz), final.log, final_runs.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG="$OUT/final.log"
START=$(date +%s); DEADLINE=${DEADLINE:-560}
left() { local l=$(( START + DEADLINE - $(date +%s) )); [ "$l" -gt "$1" ] && l=$1; echo $(( l > 5 ? l : 5 )); }
COMMON="--eval_iters 5 --save_every -1 --no_progress --seed 0"

run() {  # name gpus cap args...   (gpus "0,1": torchrun on both)
  local name=$1 gpus=$2 cap=$3 d=runs/$1; shift 3
  mkdir -p $d
  local launcher="python"
  [ "$gpus" = "0,1" ] && launcher="torchrun --standalone --nproc_per_node=2"
  echo "$launcher train.py $* --out_dir $d" > $d/cmd.txt
  echo "[$(date +%T)] start $name on GPU $gpus: $(cat $d/cmd.txt)" >> "$LOG"
  CUDA_VISIBLE_DEVICES=$gpus timeout "$(left $cap)" $launcher train.py "$@" --out_dir $d > $d/train.log 2>&1
  echo $? > $d/exit_code
  echo "[$(date +%T)] exit $(cat $d/exit_code) $name: $(grep -E '^done|Error|error' $d/train.log | tail -2)" >> "$LOG"
}

# 1. ------------------------------------------------------------------------------------------------------
STEPS=${STEPS:-100} EVAL_EVERY=50 EVAL_ITERS=5 JOB_TIMEOUT=${JOB_TIMEOUT:-100} DEADLINE=${ABLATION_DEADLINE:-330} \
  GPUS="0 1" RUNS=runs/ablation bash scripts/ablation.sh >> "$LOG" 2>&1

# 2. ------------------------------------------------------------------------------------------------------
TOY_DDP="--config toy --recipe bf16 --max_steps 150 --batch_size 32 --seq_len 1024 --warmup 15 --eval_every 50 --log_every 5 $COMMON"
( run 1b_fullstack_root 0 150 --config 1b --recipe fullstack --optimizer root --max_steps 4 --batch_size 4 \
      --grad_accum 1 --seq_len 2048 --warmup 1 --eval_every 0 --log_every 1 $COMMON ) &
( run ddp_1gpu 1 60 $TOY_DDP
  run perf_toy_fullstack_compile 1 100 --config toy --recipe fullstack --compile --max_steps 40 --batch_size 16 \
      --seq_len 512 --warmup 4 --eval_every 0 --log_every 10 $COMMON ) &
wait

# 3. ------------------------------------------------------------------------------------------------------
run ddp_2gpu 0,1 60 $TOY_DDP

python - >> "$LOG" 2>&1 <<'EOF'
import json
def curve(d):
    rows = [json.loads(l) for l in open(f"runs/{d}/metrics.jsonl")]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
try:
    (a, va), (b, vb) = curve("ddp_1gpu"), curve("ddp_2gpu")
    steps = sorted(set(a) & set(b))
    diff = max(abs(a[s] - b[s]) for s in steps)
    print(f"ddp_2gpu vs ddp_1gpu (same global batches): {len(steps)} logged steps, max |train loss diff| {diff:.4f}; "
          f"step {steps[-1]}: {a[steps[-1]]:.4f} vs {b[steps[-1]]:.4f}; val {va} vs {vb}")
except Exception as e:
    print("comparison failed:", e)
for d in ("ddp_1gpu", "ddp_2gpu", "1b_fullstack_root", "perf_toy_fullstack_compile"):
    try:
        s = json.load(open(f"runs/{d}/summary.json"))
        print(d, {k: s.get(k) for k in ("tokens_per_s", "mfu", "peak_mem_bytes", "optimizer_bytes_per_param",
                                          "params", "final_loss", "final_val_loss")})
    except Exception as e:
        print(d, "no summary:", e)
EOF
tar czf "$OUT/final_runs.tgz" runs/*/cmd.txt runs/*/train.log runs/*/metrics.jsonl runs/*/summary.json \
    runs/*/exit_code 2>/dev/null
echo "final: done in $(( $(date +%s) - START ))s" >> "$LOG"
