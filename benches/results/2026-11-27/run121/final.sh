#!/usr/bin/env bash
# The final build on the GPU: the packed suite twice, the phase test, the server on both pools,
# and the phase example's refusals.
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/final.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
timeout 120 .gpu/bin/expandable_phases > $R/phases.txt 2>&1; echo "phases rc=$?"; tail -4 $R/phases.txt
timeout 60 .gpu/bin/expandable_phases --live-gib 200 > $R/phases-too-large.txt 2>&1; echo "phases --live-gib 200 rc=$? (1 expected)"; tail -1 $R/phases-too-large.txt
for res in pool expandable; do timeout 120 .gpu/bin/inference_server --load --resource $res > $R/server-$res.txt 2>&1; echo "server $res rc=$?"; tail -2 $R/server-$res.txt; done
gzip $R/suite-*.txt
