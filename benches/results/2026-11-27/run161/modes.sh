#!/usr/bin/env bash
# Eighteenth session: where do the host's two modes of churn-1t (80 or 140 ns/op from process
# to process) come from? Per process: its repeats, its user/sys CPU time against wall time, and
# which CPU each of its threads runs on and how busy it is, under taskset -c 2-5, -c 2, and none.
# Needs carry [".probe"] (the churn bench, release, stripped).
set -u
R=$OUT/r; mkdir -p $R
trap "tar czf $OUT/modes.tgz -C $OUT r" EXIT
C=.probe/churn
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u; lscpu; lscpu -e;
  for c in 2 3 4 5; do echo "cpu$c siblings: $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list)"; done
  cat /sys/kernel/mm/transparent_hugepage/enabled; nproc; uptime; } > $R/host.txt 2>&1
TIMEFORMAT='time real %R user %U sys %S'
one() { # $1 label, rest: prefix command
  local label=$1; shift
  { echo "=== $label"; time { "$@" $C --resource pool --run churn-1t --initial 2048 --repeat 15 > $R/cur.txt 2>&1 & p=$!;
    sleep 1.2; ps -L -o tid,psr,pcpu,stat,comm -p $p; sleep 0.6; ps -L -o tid,psr,pcpu,stat,comm -p $p; wait $p; };
    grep -E '^pool' $R/cur.txt | awk '{print $5}' | tr '\n' ' '; echo; } >> $R/modes.txt 2>&1
}
for i in $(seq 8); do
  one "2-5 #$i" taskset -c 2-5
  one "2 #$i" taskset -c 2
  one "none #$i" env
done
grep -A0 -E '^(===|[0-9. ]+$)' $R/modes.txt | paste - - | awk '{n=0;s="";for(i=3;i<=NF;i++){s=s" "$i}; print $2, $3, s}'
