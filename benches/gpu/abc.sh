#!/usr/bin/env bash
# One GPU call: the suite (optional), then RMM's harness and several builds' churn interleaved
# run by run, pinned to the same cores, which one goes first rotating each round, so that the
# host's drift hits every build alike. Only same-run ratios count (BENCHMARKS.md).
# Here: ../shared/tools/gpu-pack --bench churn; `bash ../shared/bench/rmm/run.sh fetch`; the
# other builds' churn binaries in ignored folders (.prev/churn, .before/churn), carried.
# There: bash benches/gpu/abc.sh (env: ROUNDS=6, SUITE=1, RMM_ROUNDS="1 4" (the rounds that run
# RMM's harness first), BUILDS="this prev before" (this = .gpu/bin/churn-*, NAME = .NAME/churn),
# RUNS=workloads, INITIAL=2048,256, PIN="taskset -c 2-5", EXPANDABLE=0 (1: this build's
# expandable pool too, each round)). Results in $OUT/abc.tgz; summarize with
# python3 benches/gpu/abc_summary.py DIR.
set -uo pipefail
FINAL=${OUT:-/tmp/out}; OUT="$FINAL/abc"; mkdir -p "$OUT"
trap 'tar czf "$FINAL/abc.tgz" -C "$FINAL" abc && rm -rf "$OUT"' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
if [ "${SUITE:-1}" = 1 ]; then
  echo "===== tests (STREAMALLOC_REQUIRE_GPU=1)"
  start=$(date +%s)
  bash .gpu/run > "$OUT/tests.log" 2>&1; echo "tests exit $? in $(( $(date +%s) - start )) s"
  grep -E "^(=== |FAILED|test result)|passed|failed|panicked" "$OUT/tests.log" > "$OUT/tests-summary.txt"
  tail -3 "$OUT/tests-summary.txt"; gzip -f "$OUT/tests.log"
fi
PIN=${PIN:-taskset -c 2-5}
read -r -a builds <<< "${BUILDS:-this prev before}"
bin() { if [ "$1" = this ]; then ls .gpu/bin/churn-* | head -1; else echo ".$1/churn"; fi; }
one() { $PIN "$(bin "$1")" --resource pool --run "${RUNS:-workloads}" --initial "${INITIAL:-2048,256}" >> "$OUT/churn-$1.txt" 2>&1; }
n=${#builds[@]}
for r in $(seq "${ROUNDS:-6}"); do
  if [[ " ${RMM_ROUNDS:-1 4} " == *" $r "* ]]; then
    echo "===== round $r: RMM"; bash .rmm/run.sh >> "$OUT/rmm.txt" 2>&1
  fi
  echo "===== round $r ($(date -u +%T))"
  for k in $(seq 0 $((n - 1))); do one "${builds[$(( (r + k) % n ))]}"; done
  if [ "${EXPANDABLE:-0}" = 1 ]; then
    $PIN "$(bin this)" --resource expandable --run "${RUNS:-workloads}" --initial "${INITIAL:-2048,256}" >> "$OUT/expandable.txt" 2>&1
  fi
done
python3 benches/gpu/abc_summary.py "$OUT" | tee "$OUT/summary.txt"
