#!/usr/bin/env bash
# One GPU call (issue 10, seventh session: the small-block cache, measured on a noisy host):
# `churn-1t` from 2 GiB alone, this build with its cache, without it, and a previous build
# (.gpu/bin/churn-prev), ONE_T rounds interleaved (order rotating), RMM's whole harness every
# fourth round; then every workload from both starts, ROUNDS rounds of the three builds. Our
# runs pinned to the same four cores; the suite first. env: ONE_T=16, ROUNDS=4, SUITE=1.
# Results in $OUT/fastpath.tgz; summary: python3 benches/gpu/cache_summary.py DIR/one-t and DIR.
set -u
. "$(dirname "$0")/common.sh"
results fastpath
if [ "${SUITE:-1}" = 1 ]; then suite; fi
mkdir -p "$R/one-t"
one() { $P "$1" --resource pool --run churn-1t --initial 2048 "${@:2}" | grep -E "^pool"; }
for r in $(seq "${ONE_T:-16}"); do
  for k in 0 1 2; do
    case $(( (k + r) % 3 )) in
      0) one "$C" >> "$R/one-t/cache.txt" ;;
      1) one "$C" --small-block-cache 0 >> "$R/one-t/nocache.txt" ;;
      2) one .gpu/bin/churn-prev >> "$R/one-t/prev.txt" ;;
    esac
  done
  if [ $((r % 4)) = 1 ] && [ -d .rmm ]; then bash .rmm/run.sh >> "$R/one-t/rmm.txt" 2>&1; fi
done
python3 benches/gpu/cache_summary.py "$R/one-t" | tee "$R/one-t/summary.txt"
run_cache() { $P $C --resource pool --run workloads --initial 2048,256; }
run_nocache() { $P $C --resource pool --run workloads --initial 2048,256 --small-block-cache 0; }
run_prev() { $P .gpu/bin/churn-prev --resource pool --run workloads --initial 2048,256; }
interleave "${ROUNDS:-4}" cache nocache prev
python3 benches/gpu/cache_summary.py "$R" | tee "$R/summary.txt"
