#!/usr/bin/env bash
# Compiles streamalloc.cu to streamalloc.ptx. Run on a machine with nvcc (the GPU machine);
# commit the .ptx. The PTX targets compute_75 (Turing and newer: CUDA 13 dropped Volta; __nanosleep needs sm_70), and its
# ISA version line is lowered to 7.0 so that drivers from CUDA 11.0 on can JIT it: these kernels
# use nothing newer (check the diff of the .version line when the kernels change).
set -euo pipefail
cd "$(dirname "$0")"
nvcc --version | tail -2
nvcc -ptx -arch=compute_75 -O3 -o streamalloc.ptx.tmp streamalloc.cu
grep -m1 '^\.version' streamalloc.ptx.tmp | sed 's/^/nvcc emitted: /'
sed -e 's/^\.version .*/.version 7.0/' streamalloc.ptx.tmp > streamalloc.ptx
rm streamalloc.ptx.tmp
echo "wrote $(pwd)/streamalloc.ptx ($(wc -c < streamalloc.ptx) bytes)"
