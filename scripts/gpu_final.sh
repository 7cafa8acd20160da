#!/usr/bin/env bash
# One-GPU training check (the device lent only one H200 for this session's last call): the issue-7 toy ablation
# rows run CONCURRENTLY on the one GPU (losses are valid; tokens/s and peak memory are not comparable: shared GPU),
# plus a 1b fullstack smoke run that shows the 1B config fits one H200. Results: $OUT/results.md, loss_curves.png,
# runs.tgz (every run's command, log, metrics.jsonl, summary.json).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT" runs
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEPS=${STEPS:-120}; LIMIT=${LIMIT:-300}
COMMON="--config toy --max_steps $STEPS --batch_size 16 --seq_len 512 --lr 1e-3 --warmup 12 --eval_every 40 --eval_iters 5 --log_every 5 --save_every 0 --seed 0 --no_progress"
launch() {  # recipe optimizer
  d=runs/toy_$1_$2; mkdir -p $d
  echo "python train.py $COMMON --recipe $1 --optimizer $2 --out_dir $d" > $d/cmd.txt
  timeout $LIMIT python train.py $COMMON --recipe $1 --optimizer $2 --out_dir $d > $d/train.log 2>&1; echo $? > $d/exit_code
}
for r in bf16 nvfp4 nvfp4_46 lora_naive lora_svd fullstack naive_fp4; do launch $r adamw & done
for r in bf16 fullstack naive_fp4; do launch $r root & done
( d=runs/1b_fullstack_root; mkdir -p $d
  c="python train.py --config 1b --recipe fullstack --optimizer root --max_steps 4 --batch_size 4 --grad_accum 1 --seq_len 2048 --eval_every 1000 --log_every 1 --save_every 0 --no_progress --out_dir $d"
  echo "$c" > $d/cmd.txt; timeout $LIMIT $c > $d/train.log 2>&1; echo $? > $d/exit_code ) &
wait
python report.py runs --out "$OUT/results.md" --plot "$OUT/loss_curves.png" --json "$OUT/results.json" 2>&1 | tail -30
for d in runs/*; do echo "== $d exit $(cat $d/exit_code)"; tail -3 $d/train.log; done
tar czf "$OUT/runs.tgz" runs/*/cmd.txt runs/*/train.log runs/*/metrics.jsonl runs/*/summary.json runs/*/exit_code runs/*/loss.png 2>/dev/null
