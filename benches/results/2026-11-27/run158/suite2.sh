#!/usr/bin/env bash
# Seventeenth session's last library code (5a243cb, run157's build) on two GPUs: the packed
# suite with both visible, then multi_device 3 more times.
set -u
R=$OUT/r; mkdir -p $R
trap "gzip -f $R/*.txt" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader | tee $R/gpu.txt
s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 STREAMALLOC_REQUIRE_GPUS=2 bash .gpu/run > $R/suite-1.txt 2>&1; echo "suite rc=$? in $(( $(date +%s) - s )) s"
grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-1.txt | tail -6
grep -A8 "=== ./multi_device" $R/suite-1.txt | grep -E "test result|skipped|GPU pair" | head -4
f=0; for i in 1 2 3; do ./.gpu/tests/multi_device-* > $R/md-$i.txt 2>&1 || f=$((f+1)); done; echo "multi_device failures: $f of 3"
grep -h "test result" $R/md-*.txt | head -3
