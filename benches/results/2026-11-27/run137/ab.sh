#!/usr/bin/env bash
# Fifteenth session, issue 10's four threads grown from small: growth ahead of need, on a thread
# of the pool's own that keeps the engine's reserve stocked (grow-ahead.patch on f66cfb7: the
# reserve topped up to SA_GROW_AHEAD x what the pool holds, within the cap and the maximum;
# the grower woken by every home miss). One binary (.gpuz2/churn-ahead), three arms interleaved
# round by round with the order rotating: off, 0.125, 0.25; every workload from 2 GiB and 256 MiB;
# pinned to cores 2 to 6 (one more than the threads, for the grower).
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/ab.tgz -C $OUT r" EXIT
B=.gpuz2/churn-ahead
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
arms=(off 0.125 0.25)
for round in 1 2 3 4 5 6; do
  for k in 0 1 2; do
    g=${arms[$(( (round + k) % 3 ))]}
    if [ "$g" = off ]; then unset SA_GROW_AHEAD; else export SA_GROW_AHEAD=$g; fi
    echo "## round $round arm $g" >> $R/ab.txt
    taskset -c 2-6 $B --resource pool --run workloads --initial 2048,256 >> $R/ab.txt 2>&1
  done
done
unset SA_GROW_AHEAD
grep -c '^pool' $R/ab.txt
