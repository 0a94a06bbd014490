cd "$(dirname "$0")/.."
bash .gpuz2/probe6.sh | tee $OUT/probe6.txt
export STREAMALLOC_REQUIRE_GPU=1
echo "== driver_pools without the arena's limit"; .gpuz2/dp-planted-arena > $OUT/dp-planted-arena.txt 2>&1; grep -h "panicked\|test result" -A1 $OUT/dp-planted-arena.txt | head -6
tar xJf .gpuz/gpu.tar.xz
echo "== driver_pools x5"; for i in 1 2 3 4 5; do ./.gpu/tests/driver_pools-* 2>&1 | grep "test result\|panicked" -A1; done
bash .gpu/run > $OUT/suite.txt 2>&1; echo "suite rc=$?"; tail -1 $OUT/suite.txt; grep "FAILED\|panicked" $OUT/suite.txt | head
