#!/usr/bin/env bash
# One GPU call (issue 11, fifth session): the suite, then the pool, this build's expandable
# pool and a previous build's (.gpu/bin/churn-prev, packed by hand: the initial size spread in
# 32 MiB pieces) interleaved round by round, pinned. env: ROUNDS=6, SUITE=1.
# Results in $OUT/initial.tgz; summary: python3 benches/gpu/units_summary.py DIR.
set -u
. "$(dirname "$0")/common.sh"
results initial
if [ "${SUITE:-1}" = 1 ]; then suite; fi
run_pool() { $P $C --resource pool --run workloads --initial 2048,256; }
run_exp-low() { $P $C --resource expandable --run workloads --initial 2048,256; }
run_exp-prev() { $P .gpu/bin/churn-prev --resource expandable --run workloads --initial 2048,256; }
interleave "${ROUNDS:-6}" pool exp-low exp-prev
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
