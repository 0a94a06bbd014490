#!/usr/bin/env bash
# Fourteenth session, the second round of reviews' fixes (the engine's forget and chunk table,
# the pool's give-back when the upstream runs out, the arena's recall and small growth, the
# waiters' wake on a failed ordering, MemoryResource::footprint) on one GPU: the packed suite
# twice, then churn A/B against the build before the chunk table (08d4cd5, churn-old),
# alternating, ours pinned to cores 2-5.
set -u
R=$OUT/r; mkdir -p $R
trap "gzip -f $R/*.txt" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
new=$(ls .gpu/bin/churn-* | grep -v old); old=.gpu/bin/churn-old
for round in 1 2 3; do
  for b in new old; do
    bin=$new; [ $b = old ] && bin=$old
    taskset -c 2-5 $bin --resource pool --run churn-1t,churn-4t --initial 2048,256 2>&1 | grep -E "^pool" | sed "s/^/$b r$round /" | tee -a $R/churn.txt | cut -c1-120
  done
done
