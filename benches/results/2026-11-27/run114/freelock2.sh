cd "$(dirname "$0")"; gcc -O2 -o freelock freelock.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcuda -lpthread 2>/dev/null && ./freelock freehost
