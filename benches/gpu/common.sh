# Sourced by the one-call GPU scripts (units.sh, expandable_ab.sh, cap_ab.sh, events_4t.sh,
# flaky.sh, final.sh, placement_ab.sh, initial_ab.sh, claim_ab.sh, cache_ab.sh, fastpath_ab.sh,
# contended_ab.sh).

# results NAME: logs go to $R ($OUT/r), tarred into $OUT/NAME.tgz when the script exits (the
# device returns at most 8 files); the GPU and the date first.
results() {
  R=$OUT/r; mkdir -p "$R"
  trap "tar czf '$OUT/$1.tgz' -C '$OUT' r && rm -rf '$R'" EXIT
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$R/gpu.txt"
  date -u | tee -a "$R/gpu.txt"
}

# suite: every packed test binary (`bash .gpu/run`), its log in $R/tests.log, and a summary.
suite() {
  local start; start=$(date +%s)
  bash .gpu/run > "$R/tests.log" 2>&1; echo "suite rc=$? in $(( $(date +%s) - start )) s"
  grep -E "^(FAILED|[0-9]+ passed)|panicked" "$R/tests.log" | tail -8
}

# The packed churn binary in $C, and $P to pin a run to four cores (the same cores for every
# build and setting a script compares). gpu-pack files a bench with the tests (cargo builds
# benches with the test profile), where `.gpu/run` would run it as one: moved to bin/ first.
for f in .gpu/tests/churn-*; do [ -e "$f" ] && mv "$f" .gpu/bin/; done
C=$(ls .gpu/bin/churn-* 2>/dev/null | head -1)
P="taskset -c 2-5"

# interleave ROUNDS NAME...: ROUNDS rounds in which each NAME runs once, its order rotating
# from round to round, its output appended to $R/NAME.txt. The calling script defines a
# function run_NAME for each.
interleave() {
  local rounds=$1 r i name; shift
  local names=("$@") n=$#
  for r in $(seq "$rounds"); do
    for i in $(seq 0 $((n - 1))); do
      name=${names[$(( (i + r) % n ))]}
      "run_$name" >> "$R/$name.txt" 2>&1
    done
  done
}
