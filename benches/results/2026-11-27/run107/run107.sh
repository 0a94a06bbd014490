cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for r in 1 2; do
  for v in new old; do
    echo "===== round $r, $v"
    if [ $v = old ]; then export SA_OLD_BACKOFF=1; else unset SA_OLD_BACKOFF; fi
    ./event_latency --bench --strategies words --kernels-us 20,2000,20000 --samples 2000 --cell-secs 3 --no-baseline > $OUT/el-$r-$v.txt 2>&1
    grep -A4 "reactor CPU use" $OUT/el-$r-$v.txt; grep -i "target\|median\|p99" $OUT/el-$r-$v.txt | head -12
  done
done
