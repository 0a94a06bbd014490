#!/usr/bin/env bash
# Second call of run161: is the bimodality the host's? hostprobe.rs (CPU only, no CUDA: an
# arithmetic chain, a pointer chase, a BTreeMap churn, in rounds) on core 2, alternating with
# churn-1t on core 2. Needs carry [".probe"] (churn and hostprobe).
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/host.tgz -C $OUT r" EXIT
H=.probe/hostprobe C=.probe/churn
for i in $(seq 8); do
  taskset -c 2 $H 3 | tee -a $R/host.txt
  taskset -c 2 $C --resource pool --run churn-1t --initial 2048 --repeat 5 | grep -E '^pool' | awk '{print "churn", $5}' | tee -a $R/host.txt
done
