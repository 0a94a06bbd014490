#!/usr/bin/env bash
# Twenty-third session, after its fixes (zero-byte requests on another device's stream, the race
# detector's refused frees, an upstream's panicking deallocate in the pool's and arena's
# releases): the packed suite twice, then a diagnostic for issue 10: the four-thread runs of the
# pool started at 2048, 1536, 1024, 768, 512 and 256 MiB (no growth needed from 1 GiB up on
# churn-4t), six sets (two a round, three rounds), pinned to cores 2-5: does a pool that does not grow but holds
# little slack run as slow as one grown from small? Then the pool and the expandable pool
# alternating on every workload (issue 11's ratio, nine runs of each). Needs carry [".gpuz"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/run.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
date -u | tee -a $R/gpu.txt; lscpu | grep -E 'Model name|MHz' >> $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
C=$(ls .gpu/bin/churn-* | head -1); P="taskset -c 2-5"
for r in 1 2 3; do
  $P $C --resource pool --run churn-4t,churn-xs-4t --initial 2048,1536,1024,768,512,256 --repeat 2 >> $R/sweep.txt 2>&1
done
grep -E 'pairs' $R/sweep.txt | tail -8
# Issue 11's "within 20% of the pool", with as many samples of each: the pool and the expandable
# pool alternating, every workload from 2 GiB and 256 MiB, 3 repeats a round, 3 rounds.
for r in 1 2 3; do
  $P $C --resource pool --run workloads --initial 2048,256 --repeat 3 >> $R/ours.txt 2>&1
  $P $C --resource expandable --run workloads --initial 2048,256 --repeat 3 >> $R/expandable.txt 2>&1
done
gzip $R/*.txt
