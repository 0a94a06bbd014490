# memset-written words against write-value words: the data tests under each, then
# event_latency `words` alternating, 3 rounds each.
set -uo pipefail
R=$OUT/r; mkdir -p $R; trap "tar czf $OUT/memset_ab.tgz -C $OUT r" EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for m in 0 1; do for i in 1 2 3; do STREAMALLOC_EXP_WORD_MEMSET=$m STREAMALLOC_REQUIRE_GPU=1 .gpuz2/cw --nocapture > $R/cw-$m-$i.txt 2>&1; echo "memset=$m tests rc=$?: $(grep -E 'read complete early|test result' $R/cw-$m-$i.txt | tr '\n' ' ')"; done; done
for r in 1 2 3; do
  for m in 0 1; do
    mm=$m; [ $((r % 2)) = 0 ] && mm=$((1 - m))
    STREAMALLOC_EXP_WORD_MEMSET=$mm timeout 200 .gpuz2/el --strategies words --cell-secs 6 --observer flag --no-baseline --no-cpu > $R/el-$mm-$r.txt 2>&1
    echo "== memset=$mm round $r"; grep -E "^words |a record" $R/el-$mm-$r.txt
  done
done
