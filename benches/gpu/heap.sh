#!/usr/bin/env bash
# One GPU call for the shared free list (issue 10) and the reactor (issue 18): the suite, then
# RMM's churn harness, this build's churn (reuse_slack 0, 0.25, 1) and the churn of the build
# before the shared free list (.before/churn) alternating, then event_latency.
# Here: ../shared/tools/gpu-pack --bench churn --bench event_latency; move the bench binaries
# to .gpu/bin; strip; `bash ../shared/bench/rmm/run.sh fetch`. There: bash benches/gpu/heap.sh
# (env: ROUNDS=2, SLACKS="0 0.25 1", OPPORTUNISTIC="on" (or "on off": this build both ways, the
# off runs in churn-slackX-off.txt), EL=1 (0: no event_latency), EL_ARGS=extra event_latency
# flags, EXPANDABLE=0 (1: the expandable pool too, in every round, after this build))
set -uo pipefail
FINAL=${OUT:-/tmp/out}; OUT="$FINAL/run"; mkdir -p "$OUT"
trap 'tar czf "$FINAL/run.tgz" -C "$FINAL" run && rm -rf "$OUT"' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
echo "===== tests (STREAMALLOC_REQUIRE_GPU=1)"
bash .gpu/run > "$OUT/tests.log" 2>&1; echo "tests exit $?"
grep -E "^(=== |FAILED|test result)|passed|failed|panicked" "$OUT/tests.log" > "$OUT/tests-summary.txt"
tail -3 "$OUT/tests-summary.txt"; gzip -f "$OUT/tests.log"
churn=$(ls .gpu/bin/churn-* | head -1)
for r in $(seq "${ROUNDS:-2}"); do
  echo "===== round $r: RMM"
  bash .rmm/run.sh >> "$OUT/rmm.txt" 2>&1; tail -40 "$OUT/rmm.txt" | grep -E "rmm_pool" | tail -8
  for slack in ${SLACKS:-0 0.25 1}; do
    for opp in ${OPPORTUNISTIC:-on}; do
      suffix=""; [ "$opp" = off ] && suffix="-off"
      echo "===== round $r: this build, reuse_slack $slack, opportunistic reuse $opp"
      "$churn" --resource pool --run workloads --initial 2048,256 --reuse-slack $slack --opportunistic $opp 2>&1 | tee -a "$OUT/churn-slack$slack$suffix.txt" | grep -E "^pool"
    done
  done
  if [ "${EXPANDABLE:-0}" = 1 ]; then
    echo "===== round $r: the expandable pool"
    "$churn" --resource expandable --run workloads --initial 2048,256 2>&1 | tee -a "$OUT/expandable.txt" | grep -E "^expandable"
  fi
  echo "===== round $r: before (per-stream lists, 43f6cc1)"
  .before/churn --resource pool --run workloads --initial 2048,256 2>&1 | tee -a "$OUT/churn-before.txt" | grep -E "^pool"
done
if [ "${EL:-1}" = 1 ]; then
  echo "===== event_latency (prewake, 10 s cells)"
  el=$(ls .gpu/bin/event_latency-* | head -1)
  timeout 200 "$el" --strategies prewake --cell-secs 10 ${EL_ARGS:-} 2>&1 | tee "$OUT/event_latency.txt" | tail -40
fi
