#!/usr/bin/env bash
# The suite once at this build, then completion_words and the trim cancel tests in loops, and
# the previous build's completion_words and pool_review in loops (the flakes of run119).
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/loop.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite.txt 2>&1; echo "suite rc=$? in $(( $(date +%s) - s )) s"
grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite.txt | tail -4; gzip $R/suite.txt
cd .gpu/tests
loop() { # name binary count
  local fails=0; for i in $(seq $3); do STREAMALLOC_REQUIRE_GPU=1 $2 >> $R/$1.txt 2>&1 || fails=$((fails+1)); done; echo "$1: $fails of $3 failed"; }
loop new-completion_words ./completion_words-* 15
loop new-trim_cancel ./trim_cancel-* 15
cd ../..
loop old-completion_words .gpuz2/old/completion_words-* 15
loop old-pool_review .gpuz2/old/pool_review-* 15
gzip $R/*.txt
