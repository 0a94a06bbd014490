cd "$(dirname "$0")"; gcc -O2 -o waits waits.c -I/usr/local/cuda/include -L/usr/local/cuda/lib64 -lcuda && ./waits
