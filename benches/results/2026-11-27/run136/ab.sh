#!/usr/bin/env bash
# Fifteenth session, issue 10's four threads grown from small: a home shard short of memory
# grows instead of spilling into other shards (grow-first.patch on 9a4e2a9, switched by
# SA_GROW_FIRST=cap: the shard grows while what it holds, with the request, stays within cap
# times its peak in use). One binary (.gpuz2/churn-grow), three arms interleaved round by round
# with the order rotating: off, 1.2, 1.3; every workload from 2 GiB and 256 MiB; pinned.
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/ab.tgz -C $OUT r" EXIT
B=.gpuz2/churn-grow
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
arms=(off 1.2 1.3)
for round in 1 2 3 4 5 6; do
  for k in 0 1 2; do
    g=${arms[$(( (round + k) % 3 ))]}
    if [ "$g" = off ]; then unset SA_GROW_FIRST; else export SA_GROW_FIRST=$g; fi
    echo "## round $round arm $g" >> $R/ab.txt
    taskset -c 2-5 $B --resource pool --run workloads --initial 2048,256 >> $R/ab.txt 2>&1
  done
done
unset SA_GROW_FIRST
grep -c '^pool' $R/ab.txt
