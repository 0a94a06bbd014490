# The reactor's and workers' CPU with 1,000 events pending, several times (short latency cells).
set -uo pipefail
R=$OUT/r; mkdir -p $R; trap "tar czf $OUT/cpu.tgz -C $OUT r" EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for i in 1 2 3; do
  timeout 120 .gpuz2/el --strategies words,prewake,words --kernels-us 20000 --cell-secs 0.5 --no-baseline > $R/cpu-$i.txt 2>&1
  echo "== $i"; sed -n '/reactor CPU use/,/^$/p' $R/cpu-$i.txt
done
