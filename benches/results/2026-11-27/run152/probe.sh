#!/bin/bash
# tests/graph_capture.rs after the queries, syncs and frees went under the relaxed capture mode
# too (run151 showed cuStreamQuery and cuEventQuery of streams that are not captured spoiling
# a capture from the capturing thread).
set -u
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
STREAMALLOC_REQUIRE_GPU=1 RUST_LOG=warn .probe/graph_capture --test-threads=1 --nocapture 2>&1 | tee $OUT/probe.txt
