#!/bin/bash
# completion_words with its capture test expecting the refusal (the one failure of run157 and
# run158), three times as the suite runs it.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for i in 1 2 3; do STREAMALLOC_REQUIRE_GPU=1 .probe/completion_words > $OUT/cw-$i.txt 2>&1; echo "completion_words $i rc=$?"; grep -E "test result|panicked" $OUT/cw-$i.txt; done
