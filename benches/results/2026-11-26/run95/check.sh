#!/usr/bin/env bash
R=$OUT/r; mkdir -p $R
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite.log 2>&1; echo "suite rc=$?"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite.log | tail -6
grep -A4 "=== ./device_open" $R/suite.log
echo "== planted (a module and a context handle per open; must fail)"
STREAMALLOC_REQUIRE_GPU=1 .gpuz/planted-device_open --test-threads 1 > $R/planted.txt 2>&1; echo "rc=$?"; grep -E "^test |waited" $R/planted.txt
gcc -shared -fPIC -o /tmp/segv.so .gpuz/segv.c || exit 1
B=$(ls .gpu/tests/base_resources-* | head -1); s=0; f=0
for i in $(seq ${N:-40}); do
  STREAMALLOC_REQUIRE_GPU=1 LD_PRELOAD=/tmp/segv.so "$B" > $R/b-$i.txt 2>&1; rc=$?
  if grep -q "=== SIGNAL" $R/b-$i.txt || [ $rc -ge 128 ]; then s=$((s+1)); echo "base_resources $i: rc=$rc"; grep -A12 "=== SIGNAL" $R/b-$i.txt | head -12
  elif [ $rc -ne 0 ]; then f=$((f+1)); grep -m1 "panicked at" -A1 $R/b-$i.txt; else rm $R/b-$i.txt; fi
done
echo "== base_resources: $s signals, $f other failures of ${N:-40}"
