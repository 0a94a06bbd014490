# The self-hurry (a task on a stream of short work polls its event itself from its first wait)
# against none, the same binary switched by STREAMALLOC_EXP_SELF_HURRY, alternating.
set -uo pipefail
R=$OUT/r; mkdir -p $R; trap "tar czf $OUT/selfhurry_ab.tgz -C $OUT r" EXIT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for r in 1 2 3; do
  for h in 1 0; do
    hh=$h; [ $((r % 2)) = 0 ] && hh=$((1 - h))
    cpu=--no-cpu; [ "$r" = 3 ] && cpu=
    STREAMALLOC_EXP_SELF_HURRY=$hh timeout 200 .gpuz2/el --strategies words --cell-secs 6 --observer flag --no-baseline $cpu > $R/el-$hh-$r.txt 2>&1
    echo "== self-hurry=$hh round $r"; grep -E "^words +[0-9]+(µs|ms) +[0-9]+ |^words +0\.0 " $R/el-$hh-$r.txt
    grep -E "^words .*tail" $R/el-$hh-$r.txt | awk '{print "   ", $2, "lead", $(NF-5), "worker", $(NF-2), "tail", $NF}'
  done
done
