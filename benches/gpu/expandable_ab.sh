#!/usr/bin/env bash
# One GPU call: the suite, then RMM's pool, this build's pool and its expandable pool (default
# mapping unit, and one granule) interleaved round by round, pinned; then expandable_phases.
# env: ROUNDS=8, SUITE=1. Results in $OUT/exp.tgz.
set -u
. "$(dirname "$0")/common.sh"
results exp
if [ "${SUITE:-1}" = 1 ]; then suite; fi
for r in $(seq "${ROUNDS:-8}"); do
  if [ "$r" = 1 ] || [ "$r" = 5 ]; then bash .rmm/run.sh >> "$R/rmm.txt" 2>&1; fi
  order=("pool" "exp-8" "exp-2"); k=$((r % 3))
  for i in 0 1 2; do
    case ${order[$(( (i + k) % 3 ))]} in
      pool) $P $C --resource pool --run workloads --initial 2048,256 >> "$R/pool.txt" 2>&1 ;;
      exp-8) $P $C --resource expandable --run workloads --initial 2048,256 >> "$R/exp-8.txt" 2>&1 ;;
      exp-2) $P $C --resource expandable --run workloads --initial 2048,256 --map-unit 2 >> "$R/exp-2.txt" 2>&1 ;;
    esac
  done
done
.gpu/bin/expandable_phases > "$R/phases-8.txt" 2>&1; grep -E "^(expandable|pool|target)" "$R/phases-8.txt"
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
