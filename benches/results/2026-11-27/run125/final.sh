#!/usr/bin/env bash
# The session's last build on the GPU: the packed suite twice, and cudarc_interop verbose (its
# new two-contexts test).
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/final.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
STREAMALLOC_REQUIRE_GPU=1 .gpu/tests/cudarc_interop-* --nocapture > $R/cudarc_interop.txt 2>&1; echo "cudarc_interop rc=$?"; grep -E '^test |test result' $R/cudarc_interop.txt
gzip $R/*.txt
