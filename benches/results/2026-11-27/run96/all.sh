# run96: the suite after the kernels accessor, the pool-release probe, base_resources looped
cd "$(dirname "$0")/.."
tar xJf .gpuz/gpu.tar.xz
STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $OUT/suite.txt 2>&1; echo "suite rc=$?" | tee -a $OUT/suite.txt
grep -E "passed|failed" $OUT/suite.txt | tail -3
bash .gpuz2/probe.sh > $OUT/probe.txt 2>&1; grep mode= $OUT/probe.txt
fails=0; for i in $(seq 1 30); do STREAMALLOC_REQUIRE_GPU=1 ./.gpu/tests/base_resources-* > $OUT/br-$i.txt 2>&1 || { fails=$((fails+1)); grep -h "panicked\|primed" $OUT/br-$i.txt; }; done; echo "base_resources failures: $fails of 30"
for i in $(seq 1 30); do grep -q "test result: ok" $OUT/br-$i.txt && rm $OUT/br-$i.txt; done
