#!/bin/bash
# A pool (and an expandable pool) dropped during a capture of a stream it served: before the
# fix (capture_before: the pools' Drops as at 2eff76a) and after (capture_fixed: they keep their
# memory when a stream cannot be waited for).
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for b in before fixed; do STREAMALLOC_REQUIRE_GPU=1 .probe/capture_$b --nocapture a_pool_dropped > $OUT/$b.txt 2>&1; echo "$b rc=$?"; grep -E "free memory|test result|panicked|freed its memory" $OUT/$b.txt; done
STREAMALLOC_REQUIRE_GPU=1 .probe/capture_fixed > $OUT/fixed-all.txt 2>&1; echo "fixed, all rc=$?"; grep -E "test result" $OUT/fixed-all.txt
