#!/usr/bin/env bash
# One GPU call at the session's last commit: the suite, then the tests that found races this
# session repeated (no_spurious_oom 10 times, multi_device 10 times, buffers 3 times).
set -u
R=$OUT/r; mkdir -p "$R"
trap 'tar czf "$OUT/final.tgz" -C "$OUT" r && rm -rf "$R"' EXIT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/gpu.txt"; date -u | tee -a "$R/gpu.txt"
start=$(date +%s)
bash .gpu/run > "$R/tests.log" 2>&1; echo "suite rc=$? in $(( $(date +%s) - start )) s"
grep -E "^(FAILED|[0-9]+ passed)|panicked" "$R/tests.log" | tail -8
export STREAMALLOC_REQUIRE_GPU=1
for t in no_spurious_oom:10 multi_device:10 buffers:3; do
  name=${t%%:*}; n=${t##*:}; B=$(ls .gpu/tests/$name-* | head -1); f=0
  for i in $(seq "$n"); do "$B" > "$R/$name-$i.txt" 2>&1 || { f=$((f+1)); grep -m3 -E "panicked|refused" "$R/$name-$i.txt"; }; done
  echo "$name: $f of $n failed"
done
