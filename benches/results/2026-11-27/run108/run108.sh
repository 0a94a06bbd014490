cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
for r in 1 2 3; do
  echo "===== round $r (default options)"
  ./event_latency --bench --strategies words --no-baseline > $OUT/el-$r.txt 2>&1
  grep -A3 "reactor CPU use" $OUT/el-$r.txt | tail -1; grep "met \|missed\|not met" $OUT/el-$r.txt | head -8
done
