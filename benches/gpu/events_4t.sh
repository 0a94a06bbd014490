#!/usr/bin/env bash
# One GPU call: event_latency with the default options three times (issue 18's targets, 10 s
# cells), then churn's four-thread runs with the pool's defaults from 2 GiB and 256 MiB
# (pool.txt) beside growth in few large chunks from 256 MiB (--growth-divisor 1 --growth-cap
# none: cap-g1.txt), interleaved and pinned, ROUNDS times (default 6): does growth in many
# chunks make the 256 MiB start slower? Results in $OUT/ev.tgz.
set -u
. "$(dirname "$0")/common.sh"
results ev
EL=$(ls .gpu/bin/event_latency-* | head -1)
for i in 1 2 3; do
  timeout 200 "$EL" --strategies prewake --cell-secs 10 > "$R/event_latency-$i.txt" 2>&1
  sed -n '/issue 18/,$p' "$R/event_latency-$i.txt"
done
for r in $(seq "${ROUNDS:-6}"); do
  $P $C --resource pool --run churn-4t,churn-xs-4t --initial 2048,256 >> "$R/pool.txt" 2>&1
  $P $C --resource pool --run churn-4t,churn-xs-4t --initial 256 --growth-divisor 1 --growth-cap none >> "$R/cap-g1.txt" 2>&1
done
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
grep -h "256M" "$R/pool.txt" "$R/cap-g1.txt" | sed -E 's/^(\S+)\s+(\S+).*\s([0-9.]+)\s+[0-9]+\s+[0-9]+\s+ok\s+(.*)$/\1 \2 \3 \4/' | cut -c1-170
