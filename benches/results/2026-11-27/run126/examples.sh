#!/usr/bin/env bash
# The examples that trim (thirteenth session's trims hold their memory in held_for_trim.rs):
# the expandable pool's phase test (issue 11: grow to 8 GiB live, keep 1 GiB, trim) and the
# inference server on both pools.
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/examples.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
timeout 120 .gpu/bin/expandable_phases > $R/phases.txt 2>&1; echo "phases rc=$?"; tail -4 $R/phases.txt
for res in pool expandable; do timeout 120 .gpu/bin/inference_server --load --resource $res > $R/server-$res.txt 2>&1; echo "server $res rc=$?"; tail -2 $R/server-$res.txt; done
gzip $R/*.txt
