cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
tar xJf .gpuz/gpu.tar.xz
export STREAMALLOC_REQUIRE_GPU=1
bash .gpu/run > $OUT/suite.txt 2>&1; echo "suite rc=$? $(tail -1 $OUT/suite.txt)"; grep -h "FAILED\|panicked" -A2 $OUT/suite.txt | head -12
