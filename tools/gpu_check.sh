#!/usr/bin/env bash
# The GPU check in one call (H200 through the device tool, from the repo root):
#   bash scripts/gpu_check.sh [stage ...]          (default: tests bench)
# Stages, run in the order given, each bounded so that the call ends before DEADLINE seconds (default 560):
#   tests       pytest -m gpu (full-size kernel checks against the CPU reference; TEST_ARGS: files / -k filter)
#   diag        scripts/gpu_diag.py: every NVFP4 primitive vs the CPU reference + timings + quantize tile sweep
#   lora_debug  scripts/debug_lora_fused.py: the Triton LoRA epilogue route per config at the toy shapes
#   smoke       toy fullstack (AdamW and Root), 30 steps each: the main recipe trains on this GPU
#   bench       bench_{optim,lora_svd,nvfp4,attention}.py (JSON into bench_json.tgz; BENCHES: a subset;
#               ATTN_BENCH_ARGS: extra flags for bench_attention.py, e.g. --no-sweep)
#   profile     scripts/profile_step.py for toy fullstack (AdamW, Root) and bf16: where a step's time goes
#               (PROFILE_RUNS: recipe:optimizer items; PROFILE_ARGS: e.g. "--config 1b --batch_size 8 --seq_len 2048";
#               PROFILE_CAP: seconds per run, default 200: a 1b fullstack profile needs more)
#   hostprof    scripts/host_profile.py: cProfile of the host enqueueing NVFP4Linear fwd+bwd (launch overhead)
#   sweep       scripts/sweep_cols.py: the 16x1 quantize kernel's (warps, register cap) against time
#   perf        toy fullstack/adamw 60 steps of 16 x 1024 without and with --compile (tokens/s, MFU, memory)
#   fsdp3b      3b fullstack/root, 4 steps with FSDP2 over every visible GPU (torchrun; the paper's main config)
#   onebee      the 1b config on one GPU, 10 steps of 8 x 2048 tokens per run in ONEBEE_RUNS (default: every recipe
#               with AdamW; items recipe:optimizer[:compile]), each capped at ONEBEE_CAP s: tokens/s, peak memory,
#               optimizer bytes/param into the log (compilation excluded: the first step is not timed)
#   fig7        figures.py --fig 7 --size full (Fig. 7 at the paper's hidden sizes) into $OUT/fig7/
# On a 2-GPU machine run two lists side by side:
#   CUDA_VISIBLE_DEVICES=0 STREAM=g0 bash scripts/gpu_check.sh tests diag & \
#   CUDA_VISIBLE_DEVICES=1 STREAM=g1 bash scripts/gpu_check.sh smoke bench & wait
# Results: $OUT (the device tool's folder, at most 8 files come back) or ./gpu_out: <stream>_<stage>.log.
# Training stages need the prepared corpus in data_cache/default (carry it: it is git-ignored).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
STREAM=${STREAM:-gpu}
DEADLINE=${DEADLINE:-560}
START=${START:-$(date +%s)}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
stages=${*:-tests bench}

left() {  # seconds until the deadline, capped at $1
  local l=$(( START + DEADLINE - $(date +%s) ))
  [ "$l" -gt "$1" ] && l=$1
  echo $(( l > 0 ? l : 1 ))
}

for stage in $stages; do
  log="$OUT/${STREAM}_$stage.log"
  echo "== $stage ($(date +%T), $(left 100000)s left)" | tee "$log"
  case $stage in
    tests) timeout "$(left 400)" python -m pytest -q -m gpu ${TEST_ARGS:-tests} -p no:cacheprovider 2>&1 | tail -60 >> "$log" ;;
    diag) timeout "$(left 200)" python scripts/gpu_diag.py --workers 8 --log "$OUT/${STREAM}_diag_full.log" >> "$log" 2>&1 ;;
    lora_debug) timeout "$(left 200)" python scripts/debug_lora_fused.py >> "$log" 2>&1 ;;
    smoke) for opt in adamw root; do
             timeout "$(left 150)" python train.py --config toy --recipe fullstack --optimizer $opt --max_steps 30 \
               --batch_size 16 --seq_len 512 --warmup 3 --eval_every 15 --eval_iters 2 --log_every 5 \
               --save_every -1 --no_progress --out_dir runs/smoke_fullstack_$opt 2>&1 | tail -25 >> "$log"
           done ;;
    bench) mkdir -p bench_json
           for b in ${BENCHES:-bench_optim bench_lora_svd bench_nvfp4 bench_attention}; do
             echo "== $b ($(date +%T))" >> "$log"
             extra=""; [ "$b" = bench_attention ] && extra=${ATTN_BENCH_ARGS:-}
             timeout "$(left 240)" python $b.py --out bench_json/$b.json $extra 2>&1 | tail -60 >> "$log"
           done
           tar czf "$OUT/${STREAM}_bench_json.tgz" bench_json ;;
    profile) for ro in ${PROFILE_RUNS:-fullstack:adamw fullstack:root bf16:adamw}; do
               IFS=: read -r recipe opt <<< "$ro"
               timeout "$(left ${PROFILE_CAP:-200})" python scripts/profile_step.py --recipe $recipe --optimizer $opt \
                 ${PROFILE_ARGS:-} >> "$log" 2>&1
             done ;;
    hostprof) timeout "$(left 120)" python scripts/host_profile.py >> "$log" 2>&1 ;;
    sweep) timeout "$(left 150)" python scripts/sweep_cols.py >> "$log" 2>&1 ;;
    perf) for c in "" "--compile"; do
            d=runs/perf_toy_fullstack${c:+_compile}; mkdir -p $d
            cmd="python train.py --config toy --recipe fullstack --optimizer adamw --max_steps 60 --batch_size 16 \
--seq_len 1024 --warmup 6 --eval_every 0 --log_every 10 --eval_iters 5 --save_every -1 --no_progress --seed 0 $c --out_dir $d"
            echo "$cmd" | tee $d/cmd.txt >> "$log"
            timeout "$(left 220)" $cmd 2>&1 | tail -4 >> "$log"
          done ;;
    fsdp3b) d=runs/3b_fsdp_fullstack_root; mkdir -p $d
            n=$(nvidia-smi -L | wc -l)
            cmd="torchrun --standalone --nproc_per_node=$n train.py --config 3b --recipe fullstack --optimizer root \
--fsdp --max_steps 4 --batch_size 2 --grad_accum 1 --seq_len 2048 --warmup 1 --eval_every 0 --log_every 1 \
--eval_iters 5 --save_every -1 --no_progress --seed 0 --out_dir $d"
            echo "$cmd" | tee $d/cmd.txt >> "$log"
            timeout "$(left 400)" $cmd > $d/train.log 2>&1; echo "exit $?" >> "$log"
            grep -vE "^\s*$" $d/train.log | tail -15 >> "$log" ;;
    onebee) for item in ${ONEBEE_RUNS:-bf16:adamw nvfp4:adamw nvfp4_46:adamw lora_naive:adamw lora_svd:adamw \
fullstack:adamw naive_fp4:adamw}; do
              IFS=: read -r recipe opt comp <<< "$item"
              d=runs/1b_${recipe}_${opt}${comp:+_compile}; mkdir -p $d
              cmd="python train.py --config 1b --recipe $recipe --optimizer $opt --max_steps 10 --batch_size 8 \
--grad_accum 1 --seq_len 2048 --warmup 1 --eval_every 0 --log_every 1 --save_every -1 --no_progress --seed 0 \
${comp:+--compile }--out_dir $d"
              echo "$cmd" | tee $d/cmd.txt >> "$log"
              timeout "$(left ${ONEBEE_CAP:-200})" $cmd > $d/train.log 2>&1; echo "exit $?" >> "$log"
              grep -E "^done|Error" $d/train.log | tail -2 >> "$log"
            done ;;
    fig7) timeout "$(left 200)" python figures.py --fig 7 --size full --device cuda --out_dir "$OUT/fig7" >> "$log" 2>&1 ;;
    *) echo "unknown stage $stage" >> "$log" ;;
  esac
done
