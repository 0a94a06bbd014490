#!/usr/bin/env bash
# One GPU call (issue 10, eighth session: the look at every shard before the growth lock): the
# suite, then ROUNDS rounds of every workload from both starts for this build's churn and a
# previous build's (.gpu/bin/churn-prev, packed by hand), the order rotating, pinned to the same
# four cores; RMM's whole harness every fourth round. env: ROUNDS=12, SUITE=1, RUNS=workloads.
# Results in $OUT/contended.tgz; summary: python3 benches/gpu/cache_summary.py DIR ("cache" is
# this build there, with its default options; "nocache" is not run).
set -u
. "$(dirname "$0")/common.sh"
results contended
if [ "${SUITE:-1}" = 1 ]; then suite; fi
W=${RUNS:-workloads}
run_cache() { $P "$C" --resource pool --run "$W" --initial 2048,256; }
run_prev() { $P .gpu/bin/churn-prev --resource pool --run "$W" --initial 2048,256; }
for r in $(seq "${ROUNDS:-12}"); do
  if [ $((r % 2)) = 1 ]; then order="cache prev"; else order="prev cache"; fi
  for name in $order; do "run_$name" >> "$R/$name.txt" 2>&1; done
  if [ $((r % 4)) = 1 ] && [ -d .rmm ]; then bash .rmm/run.sh >> "$R/rmm.txt" 2>&1; fi
done
python3 benches/gpu/cache_summary.py "$R" | tee "$R/summary.txt"
