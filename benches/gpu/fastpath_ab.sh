#!/usr/bin/env bash
# One GPU call (issue 10, seventh session: the small-block cache, measured on a noisy host):
# `churn-1t` from 2 GiB alone, this build with its cache, without it, and a previous build
# (.gpu/bin/churn-prev), ONE_T rounds interleaved (order rotating), RMM's whole harness every
# fourth round; then every workload from both starts, ROUNDS rounds of the three builds. Our
# runs pinned to the same four cores; the suite first. env: ONE_T=16, ROUNDS=4, SUITE=1,
# NOASLR=0, EXAMPLES=0 (1: pipeline and inference_server --load, if packed), RUNS=workloads
# (the churn runs of the interleaved rounds, comma-separated).
# Results in $OUT/fastpath.tgz; summary: python3 benches/gpu/cache_summary.py DIR/one-t and DIR.
set -u
. "$(dirname "$0")/common.sh"
results fastpath
if [ "${SUITE:-1}" = 1 ]; then suite; fi
# NOASLR=1: every run of ours with address-space randomization off (`setarch -R`): run49 saw
# this build's ns/op bimodal from process to process (70 or 107 ns/op on churn-1t), as if the
# layout of its stack and heap decided it.
if [ "${NOASLR:-0}" = 1 ] && setarch "$(uname -m)" -R true 2>/dev/null; then
  P="setarch $(uname -m) -R $P"; echo "ASLR off: $P"
fi
[ "${EXAMPLES:-0}" = 1 ] && for e in pipeline inference_server; do
  b=$(ls .gpu/bin/"$e"* 2>/dev/null | head -1)
  [ -n "$b" ] && timeout 120 "$b" $([ "$e" = inference_server ] && echo --load) > "$R/$e.txt" 2>&1
  tail -3 "$R/$e.txt"
done
mkdir -p "$R/one-t"
one() { $P "$1" --resource pool --run churn-1t --initial 2048 "${@:2}" | grep -E "^pool"; }
for r in $(seq 1 "${ONE_T:-16}"); do
  for k in 0 1 2; do
    case $(( (k + r) % 3 )) in
      0) one "$C" >> "$R/one-t/cache.txt" ;;
      1) one "$C" --small-block-cache 0 >> "$R/one-t/nocache.txt" ;;
      2) one .gpu/bin/churn-prev >> "$R/one-t/prev.txt" ;;
    esac
  done
  if [ $((r % 4)) = 1 ] && [ -d .rmm ]; then bash .rmm/run.sh >> "$R/one-t/rmm.txt" 2>&1; fi
done
[ "${ONE_T:-16}" -gt 0 ] && python3 benches/gpu/cache_summary.py "$R/one-t" | tee "$R/one-t/summary.txt"
W=${RUNS:-workloads}
run_cache() { $P $C --resource pool --run "$W" --initial 2048,256; }
run_nocache() { $P $C --resource pool --run "$W" --initial 2048,256 --small-block-cache 0; }
run_prev() { $P .gpu/bin/churn-prev --resource pool --run "$W" --initial 2048,256; }
interleave "${ROUNDS:-4}" cache nocache prev
python3 benches/gpu/cache_summary.py "$R" | tee "$R/summary.txt"
