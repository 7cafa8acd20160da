#!/usr/bin/env bash
# Scale and throughput checks on a 2-GPU H200 machine (nvidia-h200-x2), one call (~9 min):
#   1. side by side: GPU0 scripts/profile_step.py (toy fullstack AdamW / Root: where a step's time goes), then the
#      1-GPU half of the DDP comparison; GPU1 the 1b config on one GPU (fullstack/root and bf16/adamw: fits,
#      tokens/s, peak memory)
#   2. the same toy bf16 run under torchrun on 2 GPUs, DDP then FSDP2 (same global batches: 32 x 1024 tokens/step;
#      data.TokenLoader's batches do not depend on the world size, so the curves must agree with the 1-GPU run)
#   3. 3b fullstack/root with FSDP2 on 2 GPUs, a few steps
#   4. side by side: toy fullstack without / with --compile (tokens/s, MFU; bf16 measured 2026-11-29)
# Every run's small files go into $OUT/scale_runs.tgz; the log and the loss comparisons into $OUT/scale.log.
# Needs data_cache/default (carry it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG="$OUT/scale.log"
START=$(date +%s); DEADLINE=${DEADLINE:-540}
left() { local l=$(( START + DEADLINE - $(date +%s) )); [ "$l" -gt "$1" ] && l=$1; echo $(( l > 5 ? l : 5 )); }
COMMON="--eval_iters 5 --save_every -1 --no_progress --seed 0"

run() {  # name gpus cap args...   (gpus: "0", "1" or "0,1" = torchrun on both)
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

TOY_DDP="--config toy --recipe bf16 --max_steps 150 --batch_size 32 --seq_len 1024 --warmup 15 --eval_every 50 --log_every 5 $COMMON"
ONE_B="--config 1b --max_steps 6 --batch_size 4 --grad_accum 1 --seq_len 2048 --warmup 1 --eval_every 0 --log_every 1 $COMMON"

# 1. ------------------------------------------------------------------------------------------------------
( for opt in adamw root; do
    CUDA_VISIBLE_DEVICES=0 timeout "$(left 150)" python scripts/profile_step.py --recipe fullstack --optimizer $opt \
        > runs/profile_fullstack_$opt.log 2>&1
  done
  run ddp_1gpu 0 90 $TOY_DDP ) &
( run 1b_fullstack_root 1 180 $ONE_B --recipe fullstack --optimizer root
  run 1b_bf16_adamw 1 90 $ONE_B --recipe bf16 --optimizer adamw ) &
wait
{ for opt in adamw root; do echo "== profile fullstack $opt"; head -45 runs/profile_fullstack_$opt.log; done; } >> "$LOG"

# 2. ------------------------------------------------------------------------------------------------------
run ddp_2gpu 0,1 90 $TOY_DDP
run fsdp_2gpu 0,1 90 $TOY_DDP --fsdp

# 3. ------------------------------------------------------------------------------------------------------
run 3b_fsdp_fullstack_root 0,1 200 --config 3b --recipe fullstack --optimizer root --fsdp --max_steps 4 --batch_size 2 \
    --grad_accum 1 --seq_len 2048 --warmup 1 --eval_every 0 --log_every 1 $COMMON

# 4. ------------------------------------------------------------------------------------------------------
PERF="--config toy --max_steps 60 --batch_size 16 --seq_len 1024 --warmup 6 --eval_every 0 --log_every 10 $COMMON"
( run perf_toy_fullstack 0 150 $PERF --recipe fullstack ) &
( run perf_toy_fullstack_compile 1 150 $PERF --recipe fullstack --compile ) &
wait

python - >> "$LOG" 2>&1 <<'EOF'
import json
def losses(d):
    rows = [json.loads(l) for l in open(f"runs/{d}/metrics.jsonl")]
    return {r["step"]: r for r in rows if "loss" in r}, {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
try:
    (a, va), out = losses("ddp_1gpu"), {}
    for d in ("ddp_2gpu", "fsdp_2gpu"):
        b, vb = losses(d)
        steps = sorted(set(a) & set(b))
        diff = max(abs(a[s]["loss"] - b[s]["loss"]) for s in steps)
        print(f"{d} vs ddp_1gpu: {len(steps)} common logged steps, max |train loss diff| {diff:.4f}, "
              f"final train {a[steps[-1]]['loss']:.4f} vs {b[steps[-1]]['loss']:.4f}, val {va} vs {vb}")
except Exception as e:
    print("comparison failed:", e)
for d in ("ddp_1gpu", "ddp_2gpu", "fsdp_2gpu", "1b_fullstack_root", "1b_bf16_adamw", "3b_fsdp_fullstack_root",
          "perf_toy_bf16", "perf_toy_bf16_compile", "perf_toy_fullstack", "perf_toy_fullstack_compile"):
    try:
        s = json.load(open(f"runs/{d}/summary.json"))
        print(d, {k: s.get(k) for k in ("tokens_per_s", "mfu", "peak_mem_bytes", "optimizer_bytes_per_param",
                                          "params", "final_loss", "final_val_loss")})
    except Exception as e:
        print(d, "no summary:", e)
EOF
tar czf "$OUT/scale_runs.tgz" runs/*/cmd.txt runs/*/train.log runs/*/metrics.jsonl runs/*/summary.json \
    runs/*/exit_code runs/profile_*.log 2>/dev/null
echo "scale: done in $(( $(date +%s) - START ))s" >> "$LOG"
