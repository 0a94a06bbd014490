set -x
cd "$(dirname "$0")"
nvidia-smi --query-gpu=name,driver_version --format=csv
gcc -O2 -o probe probe.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcuda -lpthread 2>&1 || gcc -O2 -o probe probe.c $(ls -d /usr/local/cuda*/include | head -1 | sed 's/^/-I/') -lcuda -lpthread
for m in none module ctxsync malloc stream pool; do ./probe $m 4; done
for m in module pool; do CUDA_CACHE_DISABLE=1 ./probe $m 4; done
