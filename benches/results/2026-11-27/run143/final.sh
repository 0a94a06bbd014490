#!/usr/bin/env bash
# Sixteenth session's final code: the packed suite once, then churn beside RMM 26.10's harness,
# alternating, three rounds (RMM's whole harness; our pool and our expandable pool on every
# workload from 2 GiB and 256 MiB; churn-1t from 2 GiB three more times), ours pinned to
# cores 2-5. Needs carry [".gpuz", ".rmm"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/final.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
date -u | tee -a $R/gpu.txt; lscpu | grep -E 'Model name|MHz' >> $R/gpu.txt
s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite.txt 2>&1
echo "suite rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite.txt | tail -4
C=$(ls .gpu/bin/churn-* | head -1); P="taskset -c 2-5"
for r in $(seq ${ROUNDS:-3}); do
  bash .rmm/run.sh >> $R/rmm.txt 2>&1
  grep -E 'rmm_pool\(cuda\) *threads=1' $R/rmm.txt | tail -1
  $P $C --resource pool --run workloads --initial 2048,256 >> $R/ours.txt 2>&1
  $P $C --resource expandable --run workloads --initial 2048,256 >> $R/expandable.txt 2>&1
  for k in 1 2 3; do $P $C --resource pool --run churn-1t --initial 2048 | grep -E '^pool' >> $R/one.txt; done
  tail -3 $R/one.txt
done
gzip $R/*.txt
