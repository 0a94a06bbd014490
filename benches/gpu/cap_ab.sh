#!/usr/bin/env bash
# One GPU call: the suite, then the pool with its growth cap (the default, 1.3: pool.txt) and
# without it (--growth-cap none: cap-none.txt), every run from 2 GiB and from 256 MiB,
# interleaved round by round and pinned, with RMM's pool in rounds 1 and 4.
# env: ROUNDS=6, SUITE=1. Results in $OUT/cap.tgz.
set -u
. "$(dirname "$0")/common.sh"
results cap
if [ "${SUITE:-1}" = 1 ]; then suite; fi
for r in $(seq "${ROUNDS:-6}"); do
  if [ "$r" = 1 ] || [ "$r" = 4 ]; then bash .rmm/run.sh >> "$R/rmm.txt" 2>&1; fi
  if [ $((r % 2)) = 1 ]; then order="cap none"; else order="none cap"; fi
  for o in $order; do
    case $o in
      cap) $P $C --resource pool --run workloads --initial 2048,256 >> "$R/pool.txt" 2>&1 ;;
      none) $P $C --resource pool --run workloads --initial 2048,256 --growth-cap none >> "$R/cap-none.txt" 2>&1 ;;
    esac
  done
done
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
