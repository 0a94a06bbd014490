#!/usr/bin/env bash
# One GPU call (issue 11, sixth session): the suite, then the pool, this build's expandable pool
# (the initial size in unclaimed pieces) and a previous build's (.gpu/bin/churn-prev, packed by
# hand: the pieces given to their ranges' shards at construction) interleaved round by round,
# pinned; then expandable_phases. env: ROUNDS=6, SUITE=1; V1=1 adds .gpu/bin/churn-v1 (packed
# by hand: the first claim, which moved whole pieces).
# Results in $OUT/claim.tgz; summary: python3 benches/gpu/units_summary.py DIR.
set -u
. "$(dirname "$0")/common.sh"
results claim
if [ "${SUITE:-1}" = 1 ]; then suite; fi
run_pool() { $P $C --resource pool --run workloads --initial 2048,256; }
run_exp-claim() { $P $C --resource expandable --run workloads --initial 2048,256; }
run_exp-prev() { $P .gpu/bin/churn-prev --resource expandable --run workloads --initial 2048,256; }
run_exp-v1() { $P .gpu/bin/churn-v1 --resource expandable --run workloads --initial 2048,256; }
if [ "${V1:-0}" = 1 ]; then
  interleave "${ROUNDS:-6}" pool exp-claim exp-prev exp-v1
else
  interleave "${ROUNDS:-6}" pool exp-claim exp-prev
fi
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
.gpu/bin/expandable_phases > "$R/phases.txt" 2>&1; grep -E "^(expandable|pool|target)" "$R/phases.txt"
