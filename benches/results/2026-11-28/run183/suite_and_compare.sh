#!/usr/bin/env bash
# Twenty-third session, after its review round's fixes (growth halving down to the request,
# nothing given back for nothing, notifications a growth's upstream relays held back until the
# request holds no lock, the expandable pool's device numbers in whole units and its job for
# busy streams, events' withheld state looked at again, simulated blocks larger than the host):
# the packed suite twice, then churn beside RMM 26.10's harness, ROUNDS rounds: RMM's whole
# harness, our pool and our expandable pool on every workload from 2 GiB and 256 MiB, three
# repeats each a round; ours pinned to cores 2-5. Needs carry [".gpuz", ".rmm"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/run.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
date -u | tee -a $R/gpu.txt; lscpu | grep -E 'Model name|MHz' >> $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
C=$(ls .gpu/bin/churn-* | head -1); P="taskset -c 2-5"
for r in $(seq ${ROUNDS:-2}); do
  bash .rmm/run.sh >> $R/rmm.txt 2>&1
  grep -E 'rmm_pool\(cuda\) *threads=1' $R/rmm.txt | tail -1
  $P $C --resource pool --run workloads --initial 2048,256 --repeat 3 >> $R/ours.txt 2>&1
  $P $C --resource expandable --run workloads --initial 2048,256 --repeat 3 >> $R/expandable.txt 2>&1
  grep -E 'pairs|churn-1t' $R/ours.txt | tail -4
done
gzip $R/*.txt
