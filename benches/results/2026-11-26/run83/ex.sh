set -uo pipefail
R=$OUT/r; mkdir -p $R; trap "tar czf $OUT/examples.tgz -C $OUT r" EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
export STREAMALLOC_DEVICE=cuda
timeout 120 .gpu/bin/pipeline > $R/pipeline.txt 2>&1; echo "pipeline rc=$?"; tail -6 $R/pipeline.txt
timeout 200 .gpu/bin/inference_server --load > $R/server.txt 2>&1; echo "inference_server rc=$?"; tail -8 $R/server.txt
timeout 200 .gpu/bin/soak --seconds 60 > $R/soak.txt 2>&1; echo "soak rc=$?"; tail -14 $R/soak.txt
