#!/usr/bin/env bash
# The toy-scale ablation of issue 7 (paper Table 3 rows at App. 13's toy scale): every recipe x optimizer,
# one `python train.py --config toy ...` run each, queued over the GPUs of this host (one job per GPU at a time,
# CUDA_VISIBLE_DEVICES=<gpu>), then report.py writes the table and the loss-curve plot.
#
#   bash scripts/ablation.sh                      # all 14 runs on every visible GPU, then runs/README_results.md
#   DRY_RUN=1 bash scripts/ablation.sh            # print the commands only
#   STEPS=700 BATCH=32 SEQ=1024 JOB_TIMEOUT=900 bash scripts/ablation.sh    # App. 13's length (a bigger budget)
#   RECIPES="bf16 fullstack" OPTIMIZERS=root bash scripts/ablation.sh       # a subset
#
# Budget: each run is capped at JOB_TIMEOUT seconds; DEADLINE bounds the whole script (jobs are capped to it, later
# ones are not started); rerun the script to continue: finished runs (summary.json present) are skipped unless
# FORCE=1. A run killed by the cap keeps its metrics.jsonl (report.py marks it "timeout"). Measured on 2 H200s
# (100 steps of 16 x 512, 2026-11-29): bf16 ~25 s, lora_svd ~50 s, naive_fp4 ~75 s a run with compilation, while
# fullstack's first run on a fresh machine spent its whole 100 s cap compiling; hence WARM=1 (default): a 2-step
# run of every recipe first fills Triton's disk cache (and its autotuning cache), then the timed runs start warm.
# tokens/s is only comparable across runs with one job per GPU (the default); JOBS_PER_GPU=2 trades that
# for throughput on these small models.
# Run directories are $RUNS/<config>_<recipe>_<optimizer>; each gets cmd.txt (the exact command), train.log,
# exit_code, metrics.jsonl, summary.json, ckpt.pt. With $OUT set (the device tool's folder) each run's small files
# go into $OUT/ablation/runs.tgz as soon as it ends, and the table and the plot at the end (or: python report.py
# <copied ablation dir> on any machine).
set -uo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs}
CONFIG=${CONFIG:-toy}  # tiny: a CPU smoke run of the queue
STEPS=${STEPS:-200}
BATCH=${BATCH:-16}
SEQ=${SEQ:-512}
WARMUP=${WARMUP:-20}
LR=${LR:-1e-3}
EVAL_EVERY=${EVAL_EVERY:-50}
EVAL_ITERS=${EVAL_ITERS:-10}
LOG_EVERY=${LOG_EVERY:-5}
SEED=${SEED:-0}
JOB_TIMEOUT=${JOB_TIMEOUT:-150}
DEADLINE=${DEADLINE:-560}  # whole script, seconds (0: none): no job starts or runs past it (a 10-min command cap)
JOBS_PER_GPU=${JOBS_PER_GPU:-1}
EXTRA=${EXTRA:-}  # more train.py flags for every run, e.g. EXTRA="--compile"
RECIPES=${RECIPES:-"bf16 nvfp4 nvfp4_46 lora_naive lora_svd fullstack naive_fp4"}
OPTIMIZERS=${OPTIMIZERS:-"adamw root"}
DRY_RUN=${DRY_RUN:-0}
FORCE=${FORCE:-0}
WARM=${WARM:-1}  # first: a 2-step run of each recipe (uncapped but within DEADLINE) so that Triton's disk cache holds
                 # every kernel before the timed runs; on a fresh machine fullstack compiles for 60-100 s
if [ -z "${GPUS:-}" ]; then  # GPU ids, e.g. GPUS="0 1"; default: every GPU nvidia-smi lists (none: one CPU "slot")
  n=$(nvidia-smi -L 2>/dev/null | wc -l)
  GPUS=$(seq -s " " 0 $((n > 0 ? n - 1 : 0)))
fi

# The queue: the bf16 baselines first (every gap needs them, and they are quick), then the slowest recipes
# first so that the GPUs finish at about the same time.
JOBS=()
for o in $OPTIMIZERS; do
  for r in $RECIPES; do [ "$r" = bf16 ] && JOBS+=("$r $o"); done
done
for r in fullstack naive_fp4 lora_svd lora_naive nvfp4_46 nvfp4; do
  case " $RECIPES " in *" $r "*) for o in $OPTIMIZERS; do JOBS+=("$r $o"); done ;; esac
done
for r in $RECIPES; do  # recipes this script does not know (new rows): last
  case " bf16 fullstack naive_fp4 lora_svd lora_naive nvfp4_46 nvfp4 " in *" $r "*) ;; *) for o in $OPTIMIZERS; do JOBS+=("$r $o"); done ;; esac
done

if [ "$WARM" = 1 ]; then  # compile warm-up jobs go first in the queue, into $RUNS/_warm (not in the report)
  WARM_JOBS=()
  for r in $RECIPES; do WARM_JOBS+=("$r adamw warm"); done
  case " $RECIPES " in *" fullstack "*) case " $OPTIMIZERS " in *" root "*) WARM_JOBS+=("fullstack root warm") ;; esac ;; esac
  JOBS=("${WARM_JOBS[@]}" "${JOBS[@]}")
fi

command_for() {  # recipe optimizer [warm] -> the train.py command line
  if [ "${3:-}" = warm ]; then
    echo "python train.py --config $CONFIG --recipe $1 --optimizer $2 --max_steps 2 --batch_size $BATCH" \
         "--seq_len $SEQ --lr $LR --warmup 1 --eval_every 2 --eval_iters 1 --log_every 1 --save_every -1" \
         "--seed $SEED --no_progress --out_dir $RUNS/_warm/${CONFIG}_$1_$2${EXTRA:+ $EXTRA}"
    return
  fi
  echo "python train.py --config $CONFIG --recipe $1 --optimizer $2 --max_steps $STEPS --batch_size $BATCH" \
       "--seq_len $SEQ --lr $LR --warmup $WARMUP --eval_every $EVAL_EVERY --eval_iters $EVAL_ITERS" \
       "--log_every $LOG_EVERY --save_every 0 --seed $SEED --no_progress --out_dir $RUNS/${CONFIG}_$1_$2${EXTRA:+ $EXTRA}"
}

if [ "$DRY_RUN" = 1 ]; then
  for job in "${JOBS[@]}"; do command_for $job; done
  exit 0
fi

START=$(date +%s)
mkdir -p "$RUNS"
export PYTHONUNBUFFERED=1
# train.py builds the default corpus on first use; build it once here so parallel jobs don't race on it
[ -f data_cache/default/train.bin ] || python data.py || exit 1

save_out() {  # run dir -> its small files (not the checkpoint) into $OUT/ablation/runs.tgz, right away: a killed
  # script keeps them (one archive: the device tool brings back at most 8 files)
  [ -n "${OUT:-}" ] || return 0
  local dest="$RUNS/_small/$(basename "$1")" f
  mkdir -p "$dest" "$OUT/ablation"
  for f in metrics.jsonl summary.json cmd.txt exit_code; do [ -f "$1/$f" ] && cp "$1/$f" "$dest/"; done
  tail -n 30 "$1/train.log" > "$dest/train.log" 2>/dev/null
  { flock 8; tar czf "$OUT/ablation/runs.tgz.tmp" -C "$RUNS/_small" . && mv "$OUT/ablation/runs.tgz.tmp" "$OUT/ablation/runs.tgz"; } 8> "$RUNS/.tar.lock"
  return 0
}

run_job() {  # gpu seconds recipe optimizer [warm]
  local gpu=$1 cap=$2 dir="$RUNS/${CONFIG}_$3_$4" cmd rc
  [ "${5:-}" = warm ] && dir="$RUNS/_warm/${CONFIG}_$3_$4"
  if [ -f "$dir/summary.json" ] && [ "$FORCE" != 1 ]; then echo "[gpu $gpu] skip $dir: finished earlier"; return; fi
  mkdir -p "$dir"
  cmd=$(command_for "$3" "$4" "${5:-}")
  echo "$cmd" > "$dir/cmd.txt"
  echo "[gpu $gpu] $(date +%T) start $dir (cap ${cap}s)"
  CUDA_VISIBLE_DEVICES=$gpu timeout "$cap" $cmd > "$dir/train.log" 2>&1
  rc=$?
  echo $rc > "$dir/exit_code"
  echo "[gpu $gpu] $(date +%T) exit $rc $dir: $(tail -n 1 "$dir/train.log")"
  [ "${5:-}" = warm ] || save_out "$dir"
}

QUEUE="$RUNS/.queue"
echo 0 > "$QUEUE"
next_job() {  # atomically take the next index of JOBS (flock: several workers share one counter)
  { flock 9; local i; i=$(cat "$QUEUE"); echo $((i + 1)) > "$QUEUE"; echo "$i"; } 9> "$QUEUE.lock"
}
worker() {  # gpu: run jobs from the queue until it is empty or the deadline is near
  local i left cap
  while i=$(next_job) && [ "$i" -lt "${#JOBS[@]}" ]; do
    cap=$JOB_TIMEOUT
    case "${JOBS[$i]}" in *warm) cap=100000 ;; esac  # warm-ups: bounded by the deadline only
    if [ "$DEADLINE" -gt 0 ]; then  # leave ~30 s for the report; a job with < 60 s left would say nothing
      left=$(( START + DEADLINE - 30 - $(date +%s) ))
      if [ "$left" -lt 60 ]; then echo "[gpu $1] deadline: not starting ${JOBS[$i]}"; continue; fi
      [ "$left" -lt "$cap" ] && cap=$left
    fi
    run_job "$1" "$cap" ${JOBS[$i]}
  done
}

echo "ablation: ${#JOBS[@]} runs on GPU(s) [$GPUS] x $JOBS_PER_GPU, $STEPS steps of $BATCH x $SEQ tokens," \
     "cap ${JOB_TIMEOUT}s each, deadline ${DEADLINE}s"
for gpu in $GPUS; do
  for _ in $(seq "$JOBS_PER_GPU"); do worker "$gpu" & done
done
wait
echo "ablation: done in $(( $(date +%s) - START ))s"
rm -f "$QUEUE" "$QUEUE.lock"

python report.py "$RUNS" --out "$RUNS/README_results.md" --plot "$RUNS/loss_curves.png" --json "$RUNS/results.json"
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT/ablation"
  cp "$RUNS/README_results.md" "$RUNS/loss_curves.png" "$RUNS/results.json" "$OUT/ablation/" 2>/dev/null
fi
