cd "$(dirname "$0")/.."
bash .gpuz2/probe5.sh | tee $OUT/probe5.txt
export STREAMALLOC_REQUIRE_GPU=1
echo "== driver_pools planted (no free-memory limit on the step)"; .gpuz2/dp-planted > $OUT/dp-planted.txt 2>&1; grep -h "panicked\|test result" -A1 $OUT/dp-planted.txt | head -6
echo "== driver_pools fixed x5"; for i in 1 2 3 4 5; do .gpuz2/dp-fixed 2>&1 | grep "test result\|panicked" -A1; done
tar xJf .gpuz/gpu.tar.xz
bash .gpu/run > $OUT/suite.txt 2>&1; echo "suite rc=$?"; tail -1 $OUT/suite.txt; grep "FAILED\|panicked" $OUT/suite.txt | head
fails=0; for i in $(seq 1 20); do ./.gpu/tests/base_resources-* > $OUT/br-$i.txt 2>&1 && rm $OUT/br-$i.txt || fails=$((fails+1)); done; echo "base_resources failures: $fails of 20"
