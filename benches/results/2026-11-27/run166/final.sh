#!/usr/bin/env bash
# Eighteenth session's end: the packed suite twice; the driver pool's free path before and
# after this session's shared waiters (`.probe/churn`, the churn bench at 12bed22, against the
# packed one), alternating, 5 rounds of `--resource cuda-async --run churn-1t,churn-4t`; and
# the scaling runs (1, 2, 4, 8 threads) of the pool and the arena from 2 GiB, twice (issue 10's
# "Also": the arena's churn-4t on eight threads). Ours on cores 2-9 (8 threads).
# Needs carry [".gpuz", ".probe"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/final.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
NEW=$(ls .gpu/bin/churn-* | head -1) OLD=.probe/churn P="taskset -c 2-9"
for r in 1 2 3 4 5; do
  $P $OLD --resource cuda-async --run churn-1t,churn-4t | sed 's/^/before /' >> $R/cuda_async.txt
  $P $NEW --resource cuda-async --run churn-1t,churn-4t | sed 's/^/after /' >> $R/cuda_async.txt
done
grep -E "^(before|after) cuda-async" $R/cuda_async.txt | awk '{print $1, $3, $6}' | sort | awk '{k=$1" "$2; a[k]=a[k]" "$3} END {for (k in a) print k": "a[k]}'
for r in 1 2; do
  for res in pool arena; do $P $NEW --resource $res --run scaling --initial 2048 >> $R/scaling.txt 2>&1; done
done
grep -E "^(pool|arena)" $R/scaling.txt | awk '{print $1, $2, $3, $5}'
