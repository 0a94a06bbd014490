#!/usr/bin/env bash
# churn of this build against 37cdfac's, alternating with the order rotating, ROUNDS rounds of
# every workload from both starts; pinned to cores 2-5.
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/ab.tgz -C $OUT r" EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $R/gpu.txt
date -u | tee -a $R/gpu.txt
for r in $(seq ${ROUNDS:-8}); do
  if [ $((r % 2)) = 1 ]; then order="new old"; else order="old new"; fi
  for b in $order; do taskset -c 2-5 .gpuz2/churn-$b --resource pool --run workloads --initial 2048,256 >> $R/$b.txt 2>&1; done
done
for b in new old; do echo "== $b"; grep -E '^pool' $R/$b.txt | awk '{k=$1" "$2; a[k]=a[k]" "$5} END{for(k in a) print k": "a[k]}' | sort; done
