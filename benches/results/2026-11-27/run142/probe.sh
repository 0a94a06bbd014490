#!/usr/bin/env bash
# Sixteenth session, issue 10: does the driver serialize cuMemAlloc of different threads?
# (vmm_probe section 5), and churn's four-thread runs from 2 GiB and 256 MiB on the same host.
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/probe.tgz -C $OUT r" EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
nproc | tee -a $R/gpu.txt
.probe/vmm_probe --bench 2>&1 | tee $R/vmm_probe.txt
for i in 1 2 3; do
  taskset -c 2-5 .probe/churn --resource pool --run churn-4t,churn-xs-4t --initial 2048,256 2>&1 | tee -a $R/churn.txt
done
