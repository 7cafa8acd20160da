#!/usr/bin/env bash
# The GPU check in one script, from the repo root on a CUDA machine:
#   bash tools/gpu_check.sh OUT_DIR [stage ...]          (stages default: tests bench)
#   tests     python -m pytest -q -m gpu: every kernel against the reference at full size, three processes side
#             by side (TEST_ARGS: files, -k ...: one process)
#   bench     python bench/run.py: the speed table into results/speed/ (BENCH_ARGS: e.g. "--only attention,linear")
#   profile   python bench/profile_step.py: one micro-step's kernels per recipe into OUT_DIR/profile.json
#             (PROFILE_ARGS: default the 1b config, bf16 and fullstack, 8 x 2048 tokens; PROFILE_BASE: the
#             roots of other trees, space-separated, e.g. carried worktrees of earlier commits, each
#             profiled the same way into OUT_DIR/profile_base_<its folder name>.json: an A/B of two
#             trees, or a bisection of several, in one call; PROFILE_ROUNDS=N: N rounds of this tree
#             then each base, rounds after the first into *_r<round>.json: the host's speed wanders
#             between runs, so an A/B of eager host time wants its trees interleaved)
#   fingerprint  python tools/fingerprint.py: a hash of each FP4 part's bits into OUT_DIR/fingerprint.txt, and
#             the same in each tree of PROFILE_BASE into fingerprint_base_<its folder name>.txt, diffed
#             against this tree's in the log (a refactor that should move no bit, checked on the GPU)
#   ablation  python tools/ablation.py over every visible GPU into results/ablation/ (ABLATION_ARGS: its flags)
# Each stage writes OUT_DIR/<stage>.log; the bench packs results/speed/ into OUT_DIR/speed.tgz, the ablation
# its records and finished runs (results/ablation/, results/scale/, runs/ablation*/, runs/scale/, without
# checkpoints) into OUT_DIR/ablation.tgz: one file each, as at most 8 come back from a call. On a copy of the tree
# without .git, set NANOFP4_COMMIT=<commit> so the records name their code. DEADLINE (seconds, default 560) bounds
# the whole call: every stage gets what is left, and the bench and the ablation start no run they cannot finish
# before it (the ablation judges by the runs it finished). The training stages build the offline corpus first if
# data_cache/default does not hold it.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: bash tools/gpu_check.sh OUT_DIR [tests] [bench] [profile] [fingerprint] [ablation]" >&2
  exit 2
fi
OUT_DIR=$1; shift
mkdir -p "$OUT_DIR"
DEADLINE=${DEADLINE:-560}
START=$(date +%s)
export PYTHONUNBUFFERED=1

left() {  # seconds until the deadline (at least 1)
  local l=$(( START + DEADLINE - $(date +%s) ))
  echo $(( l > 0 ? l : 1 ))
}

case " ${*:-tests bench} " in
  *" bench "*|*" ablation "*) [ -f data_cache/default/train.bin ] || python data.py > "$OUT_DIR/data.log" 2>&1 ;;
esac

for stage in ${*:-tests bench}; do
  log="$OUT_DIR/$stage.log"
  echo "== $stage ($(date -u +%FT%TZ), $(left)s left)" | tee "$log"
  case $stage in
    tests) if [ -n "${TEST_ARGS:-}" ]; then
             timeout "$(left)" python -m pytest -q -m gpu $TEST_ARGS -p no:cacheprovider \
               --durations=15 >> "$log" 2>&1; rc=$?
           else  # three pytest processes (test files a-f, g-m, n-z: attention and compile, graphs and
             # the kernels, the train runs): a fresh machine spends much of the check compiling kernels
             # on the host's cores, which one process leaves idle (--durations: where the time goes)
             pids=(); rc=0
             for files in "tests/test_[a-f]*.py" "tests/test_[g-m]*.py" "tests/test_[n-z]*.py"; do
               part="$OUT_DIR/tests.${#pids[@]}"
               timeout "$(left)" python -m pytest -q -m gpu $files -p no:cacheprovider \
                 --durations=10 > "$part" 2>&1 & pids+=($!)
             done
             for i in "${!pids[@]}"; do
               wait "${pids[$i]}" || rc=1
               cat "$OUT_DIR/tests.$i" >> "$log"; rm -f "$OUT_DIR/tests.$i"
             done
           fi ;;
    bench) timeout "$(left)" python bench/run.py --deadline $(( $(left) - 120 )) ${BENCH_ARGS:-} >> "$log" 2>&1; rc=$?
           tar czf "$OUT_DIR/speed.tgz" results/speed ;;
    ablation) timeout "$(left)" python tools/ablation.py --deadline "$(left)" ${ABLATION_ARGS:-} >> "$log" 2>&1; rc=$?
              tar czf "$OUT_DIR/ablation.tgz" --exclude='*.pt' $(ls -d results/ablation results/scale \
                  runs/ablation* runs/scale 2>/dev/null) ;;
    profile) rc=0
             for round in $(seq 1 "${PROFILE_ROUNDS:-1}"); do
               sfx=$([ "$round" -gt 1 ] && echo "_r$round")
               timeout "$(left)" python bench/profile_step.py ${PROFILE_ARGS:-} \
                 --out "$OUT_DIR/profile$sfx.json" >> "$log" 2>&1; rc=$(( rc || $? ))
               for base in ${PROFILE_BASE:-}; do
                 out=$(cd "$OUT_DIR" && pwd)/profile_base_$(basename "$base")$sfx.json
                 echo "== profile of $base" >> "$log"
                 (cd "$base" && timeout "$(left)" python bench/profile_step.py ${PROFILE_ARGS:-} \
                    --out "$out") >> "$log" 2>&1; rc=$(( rc || $? ))
               done
             done ;;
    fingerprint) timeout "$(left)" python tools/fingerprint.py > "$OUT_DIR/fingerprint.txt" 2>> "$log"; rc=$?
                 for base in ${PROFILE_BASE:-}; do
                   out=$(cd "$OUT_DIR" && pwd)/fingerprint_base_$(basename "$base").txt
                   (cd "$base" && timeout "$(left)" python tools/fingerprint.py > "$out" 2>> "$log")
                   # the header line names the tree's torch and route: compare the hashes
                   if diff <(tail -n +2 "$out") <(tail -n +2 "$OUT_DIR/fingerprint.txt") >> "$log"; then
                     echo "fingerprints equal to $base's" >> "$log"
                   else
                     echo "fingerprints DIFFER from $base's" >> "$log"; rc=1
                   fi
                 done ;;
    *) echo "unknown stage $stage (expected tests, bench, profile, fingerprint or ablation)" | tee -a "$log" >&2
       exit 2 ;;
  esac
  echo "== $stage exit $rc ($(left)s left)" | tee -a "$log"
done
