cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=index,name,driver_version --format=csv,noheader
tar xJf .gpuz/gpu.tar.xz
export STREAMALLOC_REQUIRE_GPU=1
bash .gpu/run > $OUT/suite.txt 2>&1; echo "suite rc=$? $(tail -1 $OUT/suite.txt)"; grep -h "FAILED\|panicked" -A2 $OUT/suite.txt | head -12
grep -A12 "=== ./multi_device" $OUT/suite.txt | head -14
f=0; for i in 1 2 3 4 5; do ./.gpu/tests/multi_device-* > $OUT/md-$i.txt 2>&1 && rm $OUT/md-$i.txt || f=$((f+1)); done; echo "multi_device failures: $f of 5"
