# Completion words against the default (issue 18), one call: the suite, then `event_latency`
# with `prewake` (the old default: no words) and `words` (`CudaOptions::completion_words`, the default) in ROUNDS rounds,
# the order alternating, flag observer, CELL-second cells; the reactor's CPU in the last round.
# STRATEGIES=a,b,... runs those instead, in that order; ALLOC_ASYNC=1 also runs alloc_async if packed;
# CHURN_ARENA=1 the arena's churn with the words on and off (churn packed); CPU_REPEAT=N below.
# usage (after `bash benches/gpu/pack.sh --bench event_latency --bench doorbell_probe`): [ROUNDS=3 CELL=6 SUITE=1] bash benches/gpu/words_ab.sh
set -uo pipefail
. benches/gpu/common.sh
results words_ab
[ "${SUITE:-1}" = 1 ] && suite
# Builds of tests/completion_words.rs with a bug planted (.gpu/bin/planted-NAME, if packed):
# each must fail.
for p in .gpu/bin/planted-*; do
  [ -x "$p" ] || continue
  "$p" --test-threads 1 > "$R/$(basename "$p").txt" 2>&1; rc=$?
  echo "$(basename "$p"): rc=$rc (should fail)"; grep -E "panicked|test result|round" "$R/$(basename "$p").txt" | head -5
done
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
# CHURN_ARENA=1: the arena (whose guards are recorded and queried) with the words on and off,
# the same binary, alternating, pinned.
if [ "${CHURN_ARENA:-0}" = 1 ] && [ -n "${C:-}" ]; then
  for r in 1 2 3; do for w in on off; do
    $P "$C" --resource arena --run churn-1t,churn-4t --initial 2048 --completion-words $w > "$R/arena-$w-$r.txt" 2>&1
    echo "arena words=$w round $r: $(awk '/churn-(1|4)t/ {printf "%s %s ns/op  ", $2, $5}' "$R/arena-$w-$r.txt")"
  done; done
fi
# CPU_REPEAT=N: the reactor's and workers' CPU with 1,000 events pending, N more times (words,
# prewake, words; short latency cells).
for i in $(seq 1 "${CPU_REPEAT:-0}"); do
  timeout 120 "$el" --strategies words,prewake,words --kernels-us 20000 --cell-secs 0.5 --no-baseline > "$R/cpu-$i.txt" 2>&1
  echo "== cpu $i"; sed -n '/reactor CPU use/,/^$/p' "$R/cpu-$i.txt" | grep -E "^(words|prewake) "
done
# What queuing the word's write costs, each way (doorbell_probe's last section).
dp=$(ls .gpu/bin/doorbell_probe-* 2>/dev/null | head -1)
if [ -n "$dp" ]; then
  timeout 200 "$dp" --no-sleeps > "$R/doorbell_probe.txt" 2>&1
  sed -n '/queuing cost/,$p' "$R/doorbell_probe.txt"
fi
