#!/usr/bin/env bash
# A/B of the self-hurry and the adaptive lead (env-switched, one binary): words strategy only.
set -u
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
EL=.gpuz2/bin/el
run() { # name, env...
  local name=$1; shift
  echo "== $name round $r" >> $R/$name.txt
  env "$@" timeout 200 $EL --strategies words --cell-secs ${CELL:-4} --observer flag --no-baseline $cpu >> $R/$name.txt 2>&1
  echo "$name r$r: $(grep -E '^words ' $R/$name.txt | tail -4 | awk '{printf "%s p99task %s | ", $2, $7}')"
  grep -E "^  (met|NOT)" $R/$name.txt | tail -4 | awk '{printf "%s ", $1}'; echo
}
names=(${NAMES:-w sh ad both}); n=${#names[@]}
for r in $(seq ${ROUNDS:-3}); do
  cpu=--no-cpu; [ "$r" = "${ROUNDS:-3}" ] && cpu=
  for i in $(seq 0 $((n-1))); do
    v=${names[$(( (i + r) % n ))]}
    case $v in
      w) run w STREAMALLOC_EXP_SELF_HURRY=0 ;;
      sh) run sh STREAMALLOC_EXP_SELF_HURRY=1 ;;
      ad) run ad STREAMALLOC_EXP_SELF_HURRY=0 STREAMALLOC_EXP_ADAPT=1 ;;
      both) run both STREAMALLOC_EXP_SELF_HURRY=1 STREAMALLOC_EXP_ADAPT=1 ;;
    esac
  done
done
