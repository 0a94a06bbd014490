#!/usr/bin/env bash
# Eighteenth session's last code (the last review round: the pool's and the arena's growth
# give-backs with the growth lock let go, withheld events in the arena, managed footprints):
# the packed suite twice, then the pool's workloads from 2 GiB and 256 MiB in adjacent pairs,
# 5 repeats (churn's `pairs:` lines), ours on cores 2-5. Needs carry [".gpuz"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/final.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
C=$(ls .gpu/bin/churn-* | head -1)
taskset -c 2-5 $C --resource pool --run workloads --initial 2048,256 --repeat 5 > $R/pairs.txt 2>&1
grep -E "^pairs|MISMATCH" $R/pairs.txt
