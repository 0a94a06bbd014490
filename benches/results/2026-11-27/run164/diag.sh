#!/usr/bin/env bash
# Eighteenth session: a throwaway diagnostic build (diag.patch here, on 12bed22) that counts,
# per pool, the home shard's takes and their lock contention, misses at home and the time the
# rest of a request takes after a miss, the slow path's calls and time, frees into another
# thread's shard and their contention, orderings and idle queries. churn-4t and churn-xs-4t
# from 2 GiB and 256 MiB, 6 pairs each, on cores 2-5. Needs carry [".probe"] (churn-diag).
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/diag.tgz -C $OUT r" EXIT
C=.probe/churn-diag P="taskset -c 2-5"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for run in churn-4t churn-xs-4t churn-1t; do
  DIAG=1 $P $C --resource pool --run $run --initial 2048,256 --repeat 6 >> $R/diag.txt 2>&1
done
grep -c DIAG $R/diag.txt
