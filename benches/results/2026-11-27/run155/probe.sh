#!/bin/bash
# After run154: the driver pool's calls relaxed too, and graph_capture's tests taking turns.
# graph_capture three times as the suite runs it (tests side by side), and driver_pools.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for i in 1 2 3; do STREAMALLOC_REQUIRE_GPU=1 .probe/graph_capture --nocapture > $OUT/capture-$i.txt 2>&1; echo "graph_capture $i rc=$?"; grep -E "test result|panicked" $OUT/capture-$i.txt; done
STREAMALLOC_REQUIRE_GPU=1 .probe/driver_pools > $OUT/driver_pools.txt 2>&1; echo "driver_pools rc=$?"; grep -E "test result|panicked" $OUT/driver_pools.txt
