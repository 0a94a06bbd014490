# Completion words against the default (issue 18), one call: the suite, then `event_latency`
# with `prewake` (the old default: no words) and `words` (`CudaOptions::completion_words`, the default) in ROUNDS rounds,
# the order alternating, flag observer, CELL-second cells; the reactor's CPU in the last round.
# STRATEGIES=a,b,... runs those instead, in that order; ALLOC_ASYNC=1 also runs alloc_async if packed.
# usage (after `bash benches/gpu/pack.sh --bench event_latency --bench doorbell_probe`): [ROUNDS=3 CELL=6 SUITE=1] bash benches/gpu/words_ab.sh
set -uo pipefail
. benches/gpu/common.sh
results words_ab
[ "${SUITE:-1}" = 1 ] && suite
# A build with the planted bug (a dropped stream's word handed out again at once), if packed:
# its data test must fail.
if [ -x .gpu/bin/planted-completion_words ]; then
  .gpu/bin/planted-completion_words --test-threads 1 > "$R/planted.txt" 2>&1
  echo "planted build: rc=$? (should fail)"; grep -E "panicked|test result|round" "$R/planted.txt" | head -5
fi
el=$(ls .gpu/bin/event_latency-* | head -1)
rounds=${ROUNDS:-3}
for r in $(seq 1 "$rounds"); do
  order=prewake,words; [ $((r % 2)) = 0 ] && order=words,prewake
  [ -n "${STRATEGIES:-}" ] && order=$STRATEGIES
  cpu=--no-cpu; [ "$r" = "$rounds" ] && cpu=
  echo "===== round $r: $order"
  timeout 400 "$el" --strategies "$order" --cell-secs "${CELL:-6}" --observer flag --no-baseline $cpu \
    > "$R/el-$r.txt" 2>&1
  grep -E "^(backoff|spin|predict|prewake|words) |a record|idle|reactor  |met|NOT" "$R/el-$r.txt"
done
aa=$(ls .gpu/bin/alloc_async-* 2>/dev/null | head -1)
if [ "${ALLOC_ASYNC:-0}" = 1 ] && [ -n "$aa" ]; then
  timeout 300 "$aa" > "$R/alloc_async.txt" 2>&1
  sed -n '/^2\./,/^3\./p' "$R/alloc_async.txt"
fi
# What queuing the word's write costs, each way (doorbell_probe's last section).
dp=$(ls .gpu/bin/doorbell_probe-* 2>/dev/null | head -1)
if [ -n "$dp" ]; then
  timeout 200 "$dp" --no-sleeps > "$R/doorbell_probe.txt" 2>&1
  sed -n '/queuing cost/,$p' "$R/doorbell_probe.txt"
fi
