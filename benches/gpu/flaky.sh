#!/usr/bin/env bash
# One GPU call: the suite once, then the tests that failed in run14, alone and repeated:
# buffers' a_drop_waits_for_every_recorded_stream (the host blocked for each spin) in its
# binary with the others, alone, with --test-threads=1 and with eager module loading; and
# multi_device (the reserve race) 20 times. Results in $OUT/flaky.tgz.
set -u
. "$(dirname "$0")/common.sh"
results flaky
suite
export STREAMALLOC_REQUIRE_GPU=1
B=$(ls .gpu/tests/buffers-* | head -1); M=$(ls .gpu/tests/multi_device-* | head -1)
one() { local name=$1; shift; if "$@" > "$R/$name.txt" 2>&1; then echo "$name ok"; else echo "$name FAILED"; grep -E "host took|panicked" "$R/$name.txt" | head -4; fi; }
for i in 1 2 3; do one "buffers-all-$i" $B --nocapture; done
for i in 1 2 3; do one "buffers-alone-$i" $B a_drop_waits --nocapture; done
one buffers-serial $B --test-threads=1 --nocapture
CUDA_MODULE_LOADING=EAGER one buffers-eager $B --nocapture
f=0; for i in $(seq 20); do $M > "$R/md-$i.txt" 2>&1 || f=$((f+1)); done; echo "multi_device: $f of 20 failed"
