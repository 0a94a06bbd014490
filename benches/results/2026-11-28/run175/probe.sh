#!/usr/bin/env bash
# Twenty-first session: the two-context probe (tests/two_contexts.rs) alone with its output,
# then the packed suite once (the trims' one body for async and blocking). Needs carry [".gpuz"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/suite.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for t in .gpu/tests/two_contexts-*; do
  STREAMALLOC_REQUIRE_GPU=1 timeout 120 $t --nocapture --test-threads=1 2>&1 | tee $R/two_contexts.txt | tail -30
done
s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-1.txt 2>&1; echo "suite rc=$? in $(( $(date +%s) - s )) s"
grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-1.txt | tail -6
gzip $R/*.txt
