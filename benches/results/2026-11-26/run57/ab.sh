# usage: bash ab.sh ROUNDS SPEC... ; SPEC is a comma-separated env list (or "-"), run from 256 MiB;
# base: the default build from 2 GiB. Order rotates each round.
rounds=$1; shift
specs=("base" "$@"); n=${#specs[@]}
for r in $(seq $rounds); do for w in churn-4t churn-xs-4t; do for i in $(seq 0 $((n-1))); do
  s=${specs[$(( (i + r) % n ))]}
  if [ "$s" = base ]; then taskset -c 2-5 ./churn --resource pool --run $w --initial 2048 2>&1 | grep -E "^pool" | sed "s/^/base /"
  else env $(echo "$s" | tr , ' ' | sed 's/^-$//') taskset -c 2-5 ./churn --resource pool --run $w --initial 256 2>&1 | grep -E "PROBE|^pool" | sed "s/^/$s /"; fi
done; done; done
