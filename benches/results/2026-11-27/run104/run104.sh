cd "$(dirname "$0")/.."
tar xJf .gpuz/gpu.tar.xz
export STREAMALLOC_REQUIRE_GPU=1
bash .gpu/run > $OUT/suite.txt 2>&1; echo "suite rc=$?"; tail -1 $OUT/suite.txt; grep "FAILED\|panicked" $OUT/suite.txt | head
f=0; for i in $(seq 20); do ./.gpu/tests/device_open-* > $OUT/do-$i.txt 2>&1 && rm $OUT/do-$i.txt || f=$((f+1)); done; echo "device_open failures: $f of 20"
f=0; for i in $(seq 20); do ./.gpu/tests/base_resources-* > $OUT/br-$i.txt 2>&1 && rm $OUT/br-$i.txt || f=$((f+1)); done; echo "base_resources failures: $f of 20"
