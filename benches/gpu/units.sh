#!/usr/bin/env bash
# One GPU call: the suite, then the expandable pool's churn with mapping units of 2, 8 and 16 MiB
# beside the pool (interleaved, pinned), then expandable_phases with each unit.
set -u
. "$(dirname "$0")/common.sh"
results units
suite
for r in 1 2 3 4; do
  $P $C --resource pool --run workloads --initial 2048,256 >> "$R/pool.txt" 2>&1
  for u in 2 8 16; do $P $C --resource expandable --run workloads --initial 2048,256 --map-unit $u >> "$R/exp-$u.txt" 2>&1; done
done
PH=.gpu/bin/expandable_phases
for u in 2 8 16; do $PH --map-unit $u > "$R/phases-$u.txt" 2>&1; grep -E "expandable|pool|target" "$R/phases-$u.txt" | tail -4; done
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
