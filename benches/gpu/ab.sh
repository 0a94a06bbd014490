#!/usr/bin/env bash
# An A/B of this build's pool against the build before the shared free list (.before/churn),
# interleaved run by run so that the host's drift hits both alike; then one test repeated on the
# fresh machine (a flaky one, to catch it again with its diagnostics).
# Here: ../shared/tools/gpu-pack --bench churn; move .gpu/tests/churn-* to .gpu/bin; strip.
# There: bash benches/gpu/ab.sh (env: ROUNDS=10, RUNS=churn-1t, INITIAL=2048,256,
# TEST="device_layer dropping_streams", TEST_REPEAT=0, PIN=""). Results in $OUT/ab.tgz; summarize
# with python3 benches/gpu/ab_summary.py DIR (medians, and the median of the rounds' ratios).
set -uo pipefail
FINAL=${OUT:-/tmp/out}; OUT="$FINAL/ab"; mkdir -p "$OUT"
trap 'tar czf "$FINAL/ab.tgz" -C "$FINAL" ab && rm -rf "$OUT"' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
date -u | tee -a "$OUT/gpu.txt"
if [ "${TEST_REPEAT:-0}" -gt 0 ]; then
  read -r bin filter <<< "${TEST:-device_layer dropping_streams}"
  t=$(ls .gpu/tests/"$bin"-* | head -1)
  for i in $(seq "$TEST_REPEAT"); do
    echo "===== $bin $filter, try $i" >> "$OUT/test.txt"
    STREAMALLOC_REQUIRE_GPU=1 "$t" "$filter" >> "$OUT/test.txt" 2>&1; echo "try $i exit $?"
  done
fi
churn=$(ls .gpu/bin/churn-* | head -1)
this() { $PIN "$churn" --resource pool --run "${RUNS:-churn-1t}" --initial "${INITIAL:-2048,256}" >> "$OUT/churn.txt" 2>&1; }
before() { $PIN .before/churn --resource pool --run "${RUNS:-churn-1t}" --initial "${INITIAL:-2048,256}" >> "$OUT/churn-before.txt" 2>&1; }
# PIN="taskset -c 2-5": both builds on the same cores (the one-thread runs then stay on one).
PIN=${PIN:-}
for r in $(seq "${ROUNDS:-10}"); do
  # Which goes first alternates, so that neither always runs on a machine warmed by the other.
  if [ $((r % 2)) = 1 ]; then this; before; else before; this; fi
done
grep -E "^pool" "$OUT/churn.txt" | awk '{k=$1" "$2; a[k]=a[k]" "$5} END{for(k in a) print "this   " k ":" a[k]}'
grep -E "^pool" "$OUT/churn-before.txt" | awk '{k=$1" "$2; a[k]=a[k]" "$5} END{for(k in a) print "before " k ":" a[k]}'
