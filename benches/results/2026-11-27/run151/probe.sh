#!/bin/bash
# The graph-capture probe (tests/graph_capture.rs) after its fix (the crate refuses what a
# capture cannot take, and allocates with the capture mode relaxed).
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
STREAMALLOC_REQUIRE_GPU=1 RUST_LOG=warn .probe/graph_capture --test-threads=1 --nocapture 2>&1 | tee $OUT/probe.txt
