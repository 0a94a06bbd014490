#!/usr/bin/env bash
# One GPU call: the suite, then RMM's pool, this build's pool and its expandable pool (default
# mapping unit, and one granule) interleaved round by round, pinned; then expandable_phases.
# env: ROUNDS=8, SUITE=1. Results in $OUT/exp.tgz.
set -u
R=$OUT/r; mkdir -p "$R"
trap 'tar czf "$OUT/exp.tgz" -C "$OUT" r && rm -rf "$R"' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/gpu.txt"; date -u | tee -a "$R/gpu.txt"
if [ "${SUITE:-1}" = 1 ]; then
  start=$(date +%s)
  bash .gpu/run > "$R/tests.log" 2>&1; echo "suite rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^(FAILED|[0-9]+ passed)|panicked" "$R/tests.log" | tail -8
fi
P="taskset -c 2-5"
C=$(ls .gpu/bin/churn-* | head -1)
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
