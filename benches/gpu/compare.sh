#!/usr/bin/env bash
# One GPU session, in one command (run on the GPU machine from the repository root, with `.gpu`,
# `.rmm` and, if present, `.before` carried): the whole test suite with the GPU required, then
# RMM's churn harness and our churn benchmark alternating ROUNDS times (so that both see the same
# machine: only same-run ratios count), then the examples. Everything goes to $OUT/run.tgz.
#
# Here:  ../shared/tools/gpu-pack --bench churn --example pipeline --example inference_server \
#          --example expandable_phases
#        mv .gpu/tests/churn-* .gpu/bin/     # else the suite runs the benchmark on every resource
#        strip .gpu/tests/* .gpu/bin/*       # the carry is 64 MiB in all
#        bash ../shared/bench/rmm/run.sh fetch
#        (optional) a churn binary of an earlier commit in .before/churn, for before/after
# There: bash benches/gpu/compare.sh   (env: ROUNDS=3, SKIP_TESTS=0, SKIP_EXAMPLES=0)
set -uo pipefail
# Everything goes into $OUT/run and, at the end, into one archive $OUT/run.tgz (the device tool
# brings back only a few files per call).
FINAL=${OUT:-/tmp/out}; OUT="$FINAL/run"; mkdir -p "$OUT"
trap 'tar czf "$FINAL/run.tgz" -C "$FINAL" run && rm -rf "$OUT"' EXIT
ROUNDS=${ROUNDS:-3}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  echo "===== tests (STREAMALLOC_REQUIRE_GPU=1)"
  bash .gpu/run > "$OUT/tests.log" 2>&1
  echo "tests exit $?"
  grep -E "^(=== |FAILED|test result)|passed|failed|panicked" "$OUT/tests.log" > "$OUT/tests-summary.txt"
  tail -60 "$OUT/tests-summary.txt"
  gzip -f "$OUT/tests.log"
fi
churn=$(ls .gpu/bin/churn-* 2>/dev/null | head -1)
for r in $(seq "$ROUNDS"); do
  echo "===== round $r: RMM"
  bash .rmm/run.sh >> "$OUT/rmm.txt" 2>&1; tail -40 "$OUT/rmm.txt" | grep -E "ns/op|ratio" | tail -24
  echo "===== round $r: streamalloc (this build)"
  "$churn" --resource pool --run workloads --initial 2048,256 2>&1 | tee -a "$OUT/churn.txt" | grep -E "^pool"
  if [ -x .before/churn ]; then
    echo "===== round $r: streamalloc (before)"
    .before/churn --resource pool --run workloads --initial 2048,256 2>&1 | tee -a "$OUT/churn-before.txt" | grep -E "^pool"
  fi
done
echo "===== the expandable pool"
"$churn" --resource expandable --run workloads --initial 2048,256 2>&1 | tee "$OUT/expandable.txt" | grep -E "^expandable"
echo "===== arena: every workload and thread scaling, this build then before"
"$churn" --resource arena --run workloads,scaling --initial 2048 2>&1 | tee "$OUT/arena.txt" | grep -E "^arena"
[ -x .before/churn ] && .before/churn --resource arena --run workloads,scaling --initial 2048 2>&1 | tee "$OUT/arena-before.txt" | grep -E "^arena"
if [ "${SKIP_EXAMPLES:-0}" != 1 ]; then
  echo "===== examples"
  ex() { local b; b=$(ls .gpu/bin/"$1"* 2>/dev/null | head -1); shift; [ -n "$b" ] && timeout 120 "$b" "$@"; }
  ex pipeline 2>&1 | tee "$OUT/pipeline.txt" | tail -3
  ex inference_server --load 2>&1 | tee "$OUT/server.txt" | tail -3
  ex inference_server --load --resource expandable 2>&1 | tee "$OUT/server-expandable.txt" | tail -3
  ex expandable_phases 2>&1 | tee "$OUT/expandable-phases.txt" | tail -12
fi
