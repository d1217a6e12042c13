#!/usr/bin/env bash
# Our round benchmark and vLLM-CPU's on the same prompts, back to back per N, REPS times;
# then the joint table (medians over the passes). See bench/README.md.
#   bench/vllm_baseline.sh [OUT_DIR]
# Environment (defaults): AGENTS=2,4,8,10,16  REPS=3  DECODE=1 (max_tokens, comma list)
#   MODES=full,prefix,pic,collective  HISTORY=512  OUTPUT=150  DTYPE=float32 (both sides; or
#   bfloat16)  RATIO=0.15 (our recompute ratio)  VLLM_ARGS="" (more vllm_cpu.py flags)
#   ROUND=1 (or 2: a simulation's second round, `tokendance bench resume`, round 1 left in
#   both caches; ANSWER=32 tokens each agent answered in round 1; DECODE and MODES unused)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${TMPDIR:-/tmp}/tokendance-vllm-$(date +%Y%m%d-%H%M%S)}
AGENTS=${AGENTS:-2,4,8,10,16} REPS=${REPS:-3} DECODE=${DECODE:-1}
MODES=${MODES:-full,prefix,pic,collective} HISTORY=${HISTORY:-512} OUTPUT=${OUTPUT:-150}
DTYPE=${DTYPE:-float32} RATIO=${RATIO:-0.15} ROUND=${ROUND:-1} ANSWER=${ANSWER:-32}
case $ROUND in 1) ;; 2) DECODE=1 ;; *) echo "ROUND must be 1 or 2, got $ROUND" >&2; exit 2 ;; esac
mkdir -p "$OUT"
echo "results in $OUT"
for r in $(seq 1 "$REPS"); do
  for n in ${AGENTS//,/ }; do
    for d in ${DECODE//,/ }; do
      echo "pass $r N=$n decode $d ours   $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
      if [ "$ROUND" = 2 ]; then
        .venv/bin/tokendance bench resume --agents "$n" --dtype "$DTYPE" --repeats 1 --history "$HISTORY" \
          --output "$OUTPUT" --answer "$ANSWER" --ratio "$RATIO" --dump-prompts "$OUT/prompts-$n.json" \
          --json "$OUT/ours-d$d-n$n-r$r.json" >> "$OUT/ours.log" 2>&1
      else
        .venv/bin/tokendance bench reuse --agents "$n" --dtype "$DTYPE" --repeats 1 --history "$HISTORY" \
          --output "$OUTPUT" --ratio "$RATIO" --decode "$d" --modes "$MODES" --dump-prompts "$OUT/prompts-$n.json" \
          --json "$OUT/ours-d$d-n$n-r$r.json" >> "$OUT/ours.log" 2>&1
      fi
    done
    echo "pass $r N=$n decode $DECODE vllm $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
    # shellcheck disable=SC2086
    .venv-vllm/bin/python bench/vllm_cpu.py --prompts "$OUT/prompts-$n.json" --decode "$DECODE" --dtype "$DTYPE" --repeats 1 \
      --json "$OUT/vllm-n$n-r$r.json" ${VLLM_ARGS:-} >> "$OUT/vllm.log" 2>&1
  done
done
echo "done $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/load.txt"
python3 bench/vllm_table.py "$OUT" | tee "$OUT/table.md"
