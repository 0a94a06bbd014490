#!/usr/bin/env bash
# Eighteenth session: a throwaway prototype (carve.patch on 12bed22, run164's counters
# included): a request its home shard cannot serve, instead of taking a block from another
# thread's shard, carves a range out of that shard's best fit (the whole block, or SA_CARVE MiB
# of it where it is more than twice that), orders its stream after the range's tag, moves the
# range into its home shard (the chunk table split) and is served there: memory that follows
# its thread. Trims and the expandable pool are not made right for it: a measurement.
# Rounds of: off, SA_CARVE=16, 64, 4, each a process of `--initial 2048,256 --repeat 2`, for
# churn-4t and churn-xs-4t (and churn-1t, churn-xs-1t once a round). Needs carry [".probe"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/carve.tgz -C $OUT r" EXIT
C=.probe/churn-carve P="taskset -c 2-5"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for r in $(seq ${ROUNDS:-6}); do
  for c in off 16 64 4; do
    if [ $c = off ]; then E="env -u SA_CARVE"; else E="env SA_CARVE=$c"; fi
    for run in churn-4t churn-xs-4t; do
      DIAG=1 $E $P $C --resource pool --run $run --initial 2048,256 --repeat 2 2>&1 | sed "s/^/carve=$c /" >> $R/carve.txt
    done
  done
done
for c in off 16; do
  if [ $c = off ]; then E="env -u SA_CARVE"; else E="env SA_CARVE=$c"; fi
  $E $P $C --resource pool --run churn-1t,churn-xs-1t --initial 2048,256 --repeat 3 2>&1 | sed "s/^/carve=$c /" >> $R/carve.txt
done
grep -c ' ok ' $R/carve.txt; grep -c -i panick $R/carve.txt
