#!/usr/bin/env bash
# One GPU call at the session's last commit: the suite, then the tests that found races this
# session repeated (no_spurious_oom 10 times, multi_device 10 times, buffers 3 times).
set -u
. "$(dirname "$0")/common.sh"
results final
suite
export STREAMALLOC_REQUIRE_GPU=1
for t in no_spurious_oom:10 multi_device:10 buffers:3; do
  name=${t%%:*}; n=${t##*:}; B=$(ls .gpu/tests/$name-* | head -1); f=0
  for i in $(seq "$n"); do "$B" > "$R/$name-$i.txt" 2>&1 || { f=$((f+1)); grep -m3 -E "panicked|refused" "$R/$name-$i.txt"; }; done
  echo "$name: $f of $n failed"
done
