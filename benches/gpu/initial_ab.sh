#!/usr/bin/env bash
# One GPU call (issue 11, fifth session): the suite, then the pool, this build's expandable
# pool and a previous build's (.gpu/bin/churn-prev, packed by hand: the initial size spread in
# 32 MiB pieces) interleaved round by round, pinned. env: ROUNDS=6, SUITE=1.
# Results in $OUT/initial.tgz; summary: python3 benches/gpu/units_summary.py DIR.
set -u
. "$(dirname "$0")/common.sh"
results initial
if [ "${SUITE:-1}" = 1 ]; then suite; fi
for r in $(seq "${ROUNDS:-6}"); do
  order=("pool" "exp-low" "exp-prev"); k=$((r % 3))
  for i in 0 1 2; do
    case ${order[$(( (i + k) % 3 ))]} in
      pool) $P $C --resource pool --run workloads --initial 2048,256 >> "$R/pool.txt" 2>&1 ;;
      exp-low) $P $C --resource expandable --run workloads --initial 2048,256 >> "$R/exp-low.txt" 2>&1 ;;
      exp-prev) $P .gpu/bin/churn-prev --resource expandable --run workloads --initial 2048,256 >> "$R/exp-prev.txt" 2>&1 ;;
    esac
  done
done
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
