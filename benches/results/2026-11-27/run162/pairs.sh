#!/usr/bin/env bash
# Eighteenth session: growth from small against the 2 GiB start, in adjacent pairs. run161 showed
# the host's modes are the host's (a CPU-only BTreeMap loop swings 100 to 220 ns/op between
# rounds) and sticky for a second or so, so a 256 MiB run is compared with the 2 GiB run just
# before it, in the same process (`--initial 2048,256 --repeat N` alternates the two starts).
# The pool, 15 pairs of each workload; the expandable pool, 8. Ours pinned to cores 2-5.
# Needs carry [".probe"] (the churn bench, release, stripped).
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/pairs.tgz -C $OUT r" EXIT
C=.probe/churn P="taskset -c 2-5"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; } | tee $R/gpu.txt
for run in churn-1t churn-4t churn-xs-1t churn-xs-4t; do
  $P $C --resource pool --run $run --initial 2048,256 --repeat 15 >> $R/pool.txt 2>&1
done
for run in churn-1t churn-4t churn-xs-1t churn-xs-4t; do
  $P $C --resource expandable --run $run --initial 2048,256 --repeat 8 >> $R/expandable.txt 2>&1
done
grep -c ' ok ' $R/pool.txt $R/expandable.txt
