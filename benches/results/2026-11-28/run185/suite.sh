#!/usr/bin/env bash
# Twenty-third session, the closing run: the packed suite twice after the last review's fix
# (what a growth held back is told by a guard, also on unwind). Needs carry [".gpuz"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/run.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
date -u | tee -a $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
gzip $R/*.txt
