cd "$(dirname "$0")"
gcc -O2 -o probe probe.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcuda -lpthread 2>&1
for m in oom pooloom managed bigmalloc; do ./probe $m 4; done
