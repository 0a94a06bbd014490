set -uo pipefail
FINAL=${OUT:-/tmp/out}; OUT="$FINAL/run"; mkdir -p "$OUT"
trap 'tar czf "$FINAL/run.tgz" -C "$FINAL" run && rm -rf "$OUT"' EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"; date -u | tee -a "$OUT/gpu.txt"
bash .gpu/run > "$OUT/tests.log" 2>&1; echo "tests exit $?"
grep -E "^(=== |FAILED|test result)|passed|failed|panicked" "$OUT/tests.log" > "$OUT/tests-summary.txt"; tail -1 "$OUT/tests-summary.txt"; gzip -f "$OUT/tests.log"
el=$(ls .gpu/bin/event_latency-* | head -1)
for r in 1 2; do echo "===== event_latency round $r"; timeout 150 "$el" --strategies prewake --cell-secs 10 2>&1 | tee "$OUT/event_latency-$r.txt" | grep -E "^prewake|^ +delay|^strategy|idle|reactor  " ; done
