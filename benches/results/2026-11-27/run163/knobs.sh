#!/usr/bin/env bash
# Eighteenth session: what makes the four-thread runs grown from 256 MiB slower than from 2 GiB
# (run162, adjacent pairs: churn-4t 1.64, churn-xs-4t 1.29)? The same pairs with the growth
# cap off, a coarser growth step, and larger starts. 10 pairs a setting. Ours on cores 2-5.
# Needs carry [".probe"] (the churn bench, release, stripped).
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/knobs.tgz -C $OUT r" EXIT
C=.probe/churn P="taskset -c 2-5"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for run in churn-4t churn-xs-4t; do
  for k in "default:" "cap-none:--growth-cap none" "cap-2:--growth-cap 2" "div-2:--growth-divisor 2" "div-2-cap-none:--growth-divisor 2 --growth-cap none"; do
    name=${k%%:*} opts=${k#*:}
    $P $C --resource pool --run $run --initial 2048,256 --repeat 10 $opts | sed "s/^pool/$name pool/" >> $R/knobs.txt 2>&1
  done
  $P $C --resource pool --run $run --initial 2048,512 --repeat 10 | sed "s/^pool/start512 pool/" >> $R/knobs.txt 2>&1
  $P $C --resource pool --run $run --initial 2048,1024 --repeat 10 | sed "s/^pool/start1024 pool/" >> $R/knobs.txt 2>&1
done
grep -c ' ok ' $R/knobs.txt
