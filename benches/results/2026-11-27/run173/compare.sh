#!/usr/bin/env bash
# Twentieth session's last library code: churn beside RMM 26.10's harness, alternating, three
# rounds (RMM's whole harness; our pool on every workload from 2 GiB and 256 MiB, 3 adjacent
# pairs a round; our expandable pool once a round), ours pinned to cores 2-5. No suite (run172
# ran it on the same library). Needs carry [".gpuz", ".rmm"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/compare.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
date -u | tee -a $R/gpu.txt; lscpu | grep -E 'Model name|MHz' >> $R/gpu.txt
C=$(ls .gpu/bin/churn-* | head -1); P="taskset -c 2-5"
for r in $(seq ${ROUNDS:-3}); do
  bash .rmm/run.sh >> $R/rmm.txt 2>&1
  grep -E 'rmm_pool\(cuda\) *threads=1' $R/rmm.txt | tail -1
  $P $C --resource pool --run workloads --initial 2048,256 --repeat 3 >> $R/ours.txt 2>&1
  $P $C --resource expandable --run workloads --initial 2048,256 >> $R/expandable.txt 2>&1
  grep -E 'pairs|churn-1t' $R/ours.txt | tail -4
done
gzip $R/*.txt
