#!/usr/bin/env bash
# This session's fixes on the GPU: the packed suite, the expandable pool's phases, the server on
# the expandable pool, and churn (this build against 37cdfac's) alternating.
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/verify.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
date -u | tee -a $R/gpu.txt
s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite.txt 2>&1; echo "suite rc=$? in $(( $(date +%s) - s )) s"
grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite.txt | tail -8; gzip $R/suite.txt
timeout 120 .gpu/bin/expandable_phases > $R/phases.txt 2>&1; echo "phases rc=$?"; tail -6 $R/phases.txt
timeout 120 .gpu/bin/inference_server --load --resource expandable > $R/server-expandable.txt 2>&1; echo "server rc=$?"; tail -3 $R/server-expandable.txt
for f in .gpu/tests/churn-*; do [ -e "$f" ] && mv "$f" .gpu/bin/; done
C=$(ls .gpu/bin/churn-* | head -1)
for r in 1 2 3; do
  taskset -c 2-5 $C --resource pool --run workloads --initial 2048,256 >> $R/new.txt 2>&1
  taskset -c 2-5 .gpuz2/churn-old --resource pool --run workloads --initial 2048,256 >> $R/old.txt 2>&1
done
grep -E '^pool' $R/new.txt | awk '{print "new",$1,$2,$5}' | tail -8
grep -E '^pool' $R/old.txt | awk '{print "old",$1,$2,$5}' | tail -8
