cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tar xJf .gpuz/gpu.tar.xz
export STREAMALLOC_REQUIRE_GPU=1
bash .gpu/run > $OUT/suite.txt 2>&1; echo "suite rc=$? $(tail -1 $OUT/suite.txt)"; grep -h "FAILED\|panicked" -A2 $OUT/suite.txt | head -12
for r in 1 2; do
  echo "===== event_latency round $r (default options)"
  ./.gpu/bin/event_latency-* --bench --strategies words --no-baseline > $OUT/el-$r.txt 2>&1
  grep -A3 "reactor CPU use" $OUT/el-$r.txt | tail -1; grep "met \|missed\|not met" $OUT/el-$r.txt | head -8
done
