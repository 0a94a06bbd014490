#!/usr/bin/env bash
# churn-1t (and every workload) beside RMM's harness, alternating, in one call.
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/ratio.tgz -C $OUT r" EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
date -u | tee -a $R/gpu.txt; lscpu | grep -E 'Model name|MHz' >> $R/gpu.txt
C=.gpuz2/churn; P="taskset -c 2-5"
for r in $(seq ${ROUNDS:-5}); do
  bash .gpuz2/rmm/run.sh >> $R/rmm.txt 2>&1
  grep 'rmm_pool(cuda) *threads=1' $R/rmm.txt | tail -1
  $P $C --resource pool --run workloads --initial 2048,256 >> $R/ours.txt 2>&1
  for k in 1 2 3; do $P $C --resource pool --run churn-1t --initial 2048 | grep -E '^pool' >> $R/one.txt; done
  tail -3 $R/one.txt
done
