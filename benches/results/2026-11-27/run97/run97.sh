cd "$(dirname "$0")"
bash probe3.sh | tee $OUT/probe3.txt
export STREAMALLOC_REQUIRE_GPU=1
echo "== fixed: whole binary 20 times"; f=0; for i in $(seq 20); do ./br-fixed > $OUT/fixed-$i.txt 2>&1 && rm $OUT/fixed-$i.txt || { f=$((f+1)); grep -h "panicked" -A1 $OUT/fixed-$i.txt; }; done; echo "fixed failures: $f of 20"
echo "== planted (no guard): the new test alone 5 times"; for i in $(seq 5); do ./br-planted a_request_larger > $OUT/planted-$i.txt 2>&1; grep -h "panicked\|kept memory\|test result" -A1 $OUT/planted-$i.txt | head -4; done
echo "== planted: whole binary 20 times"; f=0; for i in $(seq 20); do ./br-planted > $OUT/pw-$i.txt 2>&1 && rm $OUT/pw-$i.txt || { f=$((f+1)); grep -h "panicked" -A1 $OUT/pw-$i.txt | grep -v "^--"; }; done; echo "planted failures: $f of 20"
