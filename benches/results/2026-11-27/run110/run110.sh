cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tar xJf .gpuz/gpu.tar.xz
for r in 1 2 3; do
  echo "===== event_latency round $r (default options)"
  ./.gpu/bin/event_latency-* --bench --strategies words --no-baseline > $OUT/el-$r.txt 2>&1
  grep -A3 "reactor CPU use" $OUT/el-$r.txt | tail -1; grep "met \|MET" $OUT/el-$r.txt | head -8
done
