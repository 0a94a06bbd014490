#!/usr/bin/env bash
# Runs the main benchmarks (churn, event_latency, alloc_async, doorbell_probe; vmm_probe and
# snapshot run on their own) and ends with one summary table. Logs go to $LOGS (default
# target/bench-logs). On a machine with a GPU the benchmarks measure it; without one they run
# on the simulated device (figures that only check the plumbing: run them there with
# STREAMALLOC_RACE_DETECTION=off, or they measure the race detector).
#
#   bash benches/run-all.sh                 # builds with cargo, then runs
#   BIN_DIR=.gpu/bin bash benches/run-all.sh   # runs prebuilt binaries (e.g. on the GPU
#                                            # machine, packed by benches/gpu/pack.sh --bench ...)
# REPEAT (default 3) sets how many times each churn run repeats; the table shows medians.
set -euo pipefail
cd "$(dirname "$0")/.."
logs=${LOGS:-target/bench-logs}
repeat=${REPEAT:-3}
mkdir -p "$logs"

run() { # run NAME ARGS...: a bench, by prebuilt binary or through cargo
  local name=$1; shift
  if [ -n "${BIN_DIR:-}" ]; then
    "$(ls "$BIN_DIR"/"$name"-* | head -1)" "$@"
  else
    cargo bench -q --bench "$name" -- "$@"
  fi
}

echo "== churn (WORKLOADS.md), repeat $repeat"
run churn --run all --repeat "$repeat" | tee "$logs/churn.txt"
echo "== allocate_async"
run alloc_async | tee "$logs/alloc_async.txt"
echo "== event wake latency and reactor CPU"
run event_latency | tee "$logs/event_latency.txt"
echo "== doorbell probe (GPU only)"
run doorbell_probe | tee "$logs/doorbell_probe.txt"

echo
echo "================ summary ($(grep -m1 '^device:' "$logs/churn.txt" | cut -d' ' -f2-)) ================"
python3 - "$logs/churn.txt" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    f = line.split()
    if f and f[0] in ("pool", "cuda-async", "arena", "binning", "cuda"):
        key = f"{f[0]} {f[1]}" + (f" {f[2]}t" if f[1] == "scaling" else "")
        runs.setdefault(key, []).append(float(f[4]))
ref = {"pool churn-1t": "RMM pool 495, target <= 100", "pool churn-4t": "RMM pool 1141, target <= 40",
       "cuda-async churn-1t": "RMM cuda_async 726", "cuda-async churn-4t": "RMM cuda_async 2450",
       "arena churn-1t": "RMM arena 622", "arena churn-4t": "RMM arena 709",
       "binning churn-1t": "RMM binning 194", "binning churn-4t": "RMM binning 460",
       "cuda churn-1t": "raw cuMemAlloc ~8,700", "cuda churn-4t": "raw cuMemAlloc ~12,700"}
print(f"{'churn (ns/op)':<26} {'median':>8}   runs / reference")
for key in sorted(runs):
    note = f"   ({ref[key]})" if key in ref else ""
    print(f"{key:<26} {statistics.median(runs[key]):>8.1f}   {' '.join(f'{x:g}' for x in runs[key])}{note}")
PY
echo
grep -E "ratio" "$logs/alloc_async.txt" | sed 's/^ */allocate_async overhead: /'
grep -E "^   (default|low_latency) " "$logs/alloc_async.txt" | sed 's/^ */GPU free -> task holds memory: /'
grep -E "allocations in" "$logs/alloc_async.txt" | sed 's/^ */64 tasks: /'
grep -E "^(backoff|spin|predict|prewake) +[0-9]" "$logs/event_latency.txt" | sed 's/^/event_latency: /'
