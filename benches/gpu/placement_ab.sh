#!/usr/bin/env bash
# One GPU call (issue 11, fifth session): the suite, then this build's pool and its expandable
# pool with each placement (`--placement low`, the default, and `closest`, the old one)
# interleaved round by round, pinned; then expandable_phases. env: ROUNDS=8, SUITE=1.
# Results in $OUT/placement.tgz; summary: python3 benches/gpu/units_summary.py DIR.
set -u
. "$(dirname "$0")/common.sh"
results placement
if [ "${SUITE:-1}" = 1 ]; then suite; fi
run_pool() { $P $C --resource pool --run workloads --initial 2048,256; }
run_exp-low() { $P $C --resource expandable --run workloads --initial 2048,256; }
run_exp-closest() { $P $C --resource expandable --run workloads --initial 2048,256 --placement closest; }
interleave "${ROUNDS:-8}" pool exp-low exp-closest
.gpu/bin/expandable_phases > "$R/phases.txt" 2>&1; grep -E "^(expandable|pool|target)" "$R/phases.txt"
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
