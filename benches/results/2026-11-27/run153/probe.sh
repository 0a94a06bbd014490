#!/bin/bash
# tests/graph_capture.rs with its last tests: an awaited event beside a global capture, the cost
# of relaxing the capture mode, and a pool of the capture's own.
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
STREAMALLOC_REQUIRE_GPU=1 RUST_LOG=warn .probe/graph_capture --test-threads=1 --nocapture 2>&1 | tee $OUT/probe.txt
