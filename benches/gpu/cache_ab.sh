#!/usr/bin/env bash
# One GPU call (issue 10, seventh session: the small-block cache): the suite, then RMM's churn
# harness, this build's pool with its small-block cache (the default), the same build with the
# cache off (`--small-block-cache 0`), and a previous build's pool (.gpu/bin/churn-prev, packed
# by hand) interleaved round by round, the order rotating; our runs pinned to the same four
# cores. Then the expandable pool with and without the cache, once each, and expandable_phases
# if packed. env: ROUNDS=3, SUITE=1, RMM=1 (needs .rmm carried).
# Results in $OUT/cache.tgz; summary: python3 benches/gpu/units_summary.py DIR.
set -u
. "$(dirname "$0")/common.sh"
results cache
if [ "${SUITE:-1}" = 1 ]; then suite; fi
run_rmm() { bash .rmm/run.sh; }
run_cache() { $P $C --resource pool --run workloads --initial 2048,256; }
run_nocache() { $P $C --resource pool --run workloads --initial 2048,256 --small-block-cache 0; }
run_prev() { $P .gpu/bin/churn-prev --resource pool --run workloads --initial 2048,256; }
names=(cache nocache prev)
[ -x .gpu/bin/churn-prev ] || names=(cache nocache)
[ "${RMM:-1}" = 1 ] && [ -d .rmm ] && names+=(rmm)
interleave "${ROUNDS:-3}" "${names[@]}"
grep -hE "^pool" "$R/cache.txt" | head -16
for c in 4096 0; do
  $P $C --resource expandable --run workloads --initial 2048,256 --small-block-cache "$c" \
    > "$R/expandable-$c.txt" 2>&1
done
grep -hE "^expandable" "$R"/expandable-*.txt
[ -x .gpu/bin/expandable_phases ] && .gpu/bin/expandable_phases > "$R/phases.txt" 2>&1 \
  && grep -E "^(expandable|pool|target)" "$R/phases.txt"
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
