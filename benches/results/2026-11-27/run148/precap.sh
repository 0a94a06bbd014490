#!/usr/bin/env bash
# The capture test at 41fbfc1 with src/device/cuda.rs as before that fix (cuStreamQuery asked of
# a stream under capture): it must fail there. Needs carry [".probe"].
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
STREAMALLOC_REQUIRE_GPU=1 .probe/cudarc_interop_prefix is_idle_during 2>&1 | tee $R/precap.txt | grep -E "^test |panicked|capture|is_idle" | head -8
