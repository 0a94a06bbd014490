cd "$(dirname "$0")"
export STREAMALLOC_REQUIRE_GPU=1 SA_DIAG=1
f=0
for i in $(seq 30); do ./device_open_diag > $OUT/diag-$i.txt 2>&1 && rm $OUT/diag-$i.txt || { f=$((f+1)); echo "== run $i"; grep -h "panicked" -A1 $OUT/diag-$i.txt; grep -h "DIAG spin\|DIAG Opened\|DIAG of_gpu" $OUT/diag-$i.txt | head -8; }; [ $f -ge 3 ] && break; done; echo "failures: $f"
for x in $OUT/diag-*.txt; do gzip $x; done
