#!/usr/bin/env bash
# Twentieth session, after the first review round (the pool trim orders its chunks with the
# trims' lock let go, the capture path recalls trims, the sim detector reuses closed streams' slots,
# the arena lets go of dropped streams, a Device torn down off its reactor): the packed suite
# twice. Needs carry [".gpuz"].
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/suite.tgz -C $OUT r" EXIT
tar xJf .gpuz/gpu.tar.xz
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt
for i in 1 2; do s=$(date +%s); STREAMALLOC_REQUIRE_GPU=1 bash .gpu/run > $R/suite-$i.txt 2>&1; echo "suite $i rc=$? in $(( $(date +%s) - s )) s"; grep -E "^(FAILED|[0-9]+ passed)|panicked" $R/suite-$i.txt | tail -4; done
gzip $R/*.txt
