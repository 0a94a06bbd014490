#!/usr/bin/env bash
# A/B of the shard budget experiment, one binary, env-switched.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
C=.gpuz2/bin/churn; P=${P-"taskset -c 2-5"}
run_base() { $P $C --resource pool --run workloads --initial 2048,256; }
run_t115() { TOTAL_BUDGET=1.15 SHARD_BUDGET=1.2 SHARD_DIV=8 $P $C --resource pool --run workloads --initial 2048,256; }
run_t12() { TOTAL_BUDGET=1.2 SHARD_BUDGET=1.2 SHARD_DIV=8 $P $C --resource pool --run workloads --initial 2048,256; }
run_t125() { TOTAL_BUDGET=1.25 SHARD_BUDGET=1.2 SHARD_DIV=8 $P $C --resource pool --run workloads --initial 2048,256; }
names=(base t115 t12 t125); n=4
for r in $(seq ${ROUNDS:-6}); do
  for i in $(seq 0 $((n-1))); do name=${names[$(( (i + r) % n ))]}; "run_$name" >> $R/$name.txt 2>&1; done
done
python3 .gpuz2/builds_summary.py $R "${names[@]}" | tee $R/summary.txt
