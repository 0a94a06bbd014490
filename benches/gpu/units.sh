#!/usr/bin/env bash
# One GPU call: the suite, then the expandable pool's churn with mapping units of 2, 8 and 16 MiB
# beside the pool (interleaved, pinned), then expandable_phases with each unit.
set -u
R=$OUT/r; mkdir -p "$R"
trap 'tar czf "$OUT/units.tgz" -C "$OUT" r && rm -rf "$R"' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/gpu.txt"; date -u | tee -a "$R/gpu.txt"
start=$(date +%s)
bash .gpu/run > "$R/tests.log" 2>&1; echo "suite rc=$? in $(( $(date +%s) - start )) s"
grep -E "^(FAILED|[0-9]+ passed)|panicked" "$R/tests.log" | tail -8
P="taskset -c 2-5"
C=$(ls .gpu/bin/churn-* | head -1)
for r in 1 2 3 4; do
  $P $C --resource pool --run workloads --initial 2048,256 >> "$R/pool.txt" 2>&1
  for u in 2 8 16; do $P $C --resource expandable --run workloads --initial 2048,256 --map-unit $u >> "$R/exp-$u.txt" 2>&1; done
done
PH=.gpu/bin/expandable_phases
for u in 2 8 16; do $PH --map-unit $u > "$R/phases-$u.txt" 2>&1; grep -E "expandable|pool|target" "$R/phases-$u.txt" | tail -4; done
python3 benches/gpu/units_summary.py "$R" | tee "$R/summary.txt"
