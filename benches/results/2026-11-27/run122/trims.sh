#!/usr/bin/env bash
# A request at the maximum takes back what a trim holds (thirteenth session): the packed suite
# twice, then the trim tests' binaries (trim_cancel, trim_recall) and the pool's tests in loops.
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/trims.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
cd .gpu/tests
loop() { # name binary count
  local fails=0; for i in $(seq $3); do STREAMALLOC_REQUIRE_GPU=1 $2 >> $R/$1.txt 2>&1 || fails=$((fails+1)); done; echo "$1: $fails of $3 failed"; }
loop trim_cancel ./trim_cancel-* 5
loop trim_recall ./trim_recall-* 10
loop pool ./pool-* 5
cd ../..
gzip $R/*.txt
