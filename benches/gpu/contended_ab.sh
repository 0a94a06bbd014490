#!/usr/bin/env bash
# One GPU call (issue 10, eighth session): the suite, then ROUNDS rounds of every workload from
# both starts for each of BUILDS, interleaved (the order rotating from round to round), pinned to
# the same four cores; RMM's whole harness every fourth round. BUILDS (default "cache prev"):
#   cache  this build's pool          prev  .gpu/bin/churn-prev's pool (packed by hand)
#   pre    .gpu/bin/churn-pre's pool  exp   this build's expandable pool
# env: ROUNDS=12, SUITE=1, RUNS=workloads. Results in $OUT/contended.tgz; summary:
# python3 benches/gpu/builds_summary.py DIR BUILDS... (ratios of the first build to the others).
set -u
. "$(dirname "$0")/common.sh"
results contended
if [ "${SUITE:-1}" = 1 ]; then suite; fi
W=${RUNS:-workloads}
run_cache() { $P "$C" --resource pool --run "$W" --initial 2048,256; }
run_prev() { $P .gpu/bin/churn-prev --resource pool --run "$W" --initial 2048,256; }
run_pre() { $P .gpu/bin/churn-pre --resource pool --run "$W" --initial 2048,256; }
run_exp() { $P "$C" --resource expandable --run "$W" --initial 2048,256; }
read -r -a builds <<< "${BUILDS:-cache prev}"
n=${#builds[@]}
for r in $(seq "${ROUNDS:-12}"); do
  for i in $(seq 0 $((n - 1))); do
    name=${builds[$(( (i + r) % n ))]}
    "run_$name" >> "$R/$name.txt" 2>&1
  done
  if [ $((r % 4)) = 1 ] && [ -d .rmm ]; then bash .rmm/run.sh >> "$R/rmm.txt" 2>&1; fi
done
python3 benches/gpu/builds_summary.py "$R" "${builds[@]}" | tee "$R/summary.txt"
