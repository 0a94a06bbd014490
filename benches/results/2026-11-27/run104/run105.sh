cd "$(dirname "$0")/.."
tar xJf .gpuz/gpu.tar.xz
export STREAMALLOC_REQUIRE_GPU=1
for r in 1 2 3; do bash .gpu/run > $OUT/suite-$r.txt 2>&1; echo "round $r rc=$? $(tail -1 $OUT/suite-$r.txt)"; grep -h "FAILED\|panicked" -A2 $OUT/suite-$r.txt | head -12; done
for r in 1 2 3; do grep -q "33 passed, 0 failed" $OUT/suite-$r.txt && rm $OUT/suite-$r.txt; done; true
