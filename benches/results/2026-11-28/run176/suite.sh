#!/usr/bin/env bash
# Twenty-first session, the last library change (the arena's trim on a failed guard, every
# give-back under way waited for, the trims' one body): the packed suite twice, and the
# two-context test's output. Needs carry [".gpuz"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/suite.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for t in .gpu/tests/two_contexts-*; do
  STREAMALLOC_REQUIRE_GPU=1 timeout 120 $t --nocapture --test-threads=1 > $R/two_contexts.txt 2>&1
  echo "two_contexts rc=$?"; grep -E "cuDevice|cuCtx|can_access|first word|test result" $R/two_contexts.txt
done
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
gzip $R/*.txt
