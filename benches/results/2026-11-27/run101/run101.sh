cd "$(dirname "$0")"
export STREAMALLOC_REQUIRE_GPU=1
echo "== device_open, the whole binary, 40 times"; f=0
for i in $(seq 40); do ./device_open > $OUT/do-$i.txt 2>&1 && rm $OUT/do-$i.txt || { f=$((f+1)); grep -h "panicked" -A1 $OUT/do-$i.txt; }; done; echo "failures: $f of 40"
echo "== the first test alone, 20 times"; f=0
for i in $(seq 20); do ./device_open opening_a_device > $OUT/alone-$i.txt 2>&1 && rm $OUT/alone-$i.txt || { f=$((f+1)); grep -h "panicked" -A1 $OUT/alone-$i.txt; }; done; echo "failures: $f of 20"
