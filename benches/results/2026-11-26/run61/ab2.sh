# usage: bash ab2.sh ROUNDS SPEC... ; SPEC: churn arguments with _ for spaces ("-" for none), run from
# 256 MiB; "base": the defaults from 2 GiB. W: the runs (default churn-4t churn-xs-4t). Order rotates.
rounds=$1; shift
specs=("base" "$@"); n=${#specs[@]}
for r in $(seq $rounds); do for w in ${W:-churn-4t churn-xs-4t}; do for i in $(seq 0 $((n-1))); do
  s=${specs[$(( (i + r) % n ))]}
  if [ "$s" = base ]; then taskset -c 2-5 ./churn --resource pool --run $w --initial 2048 2>&1 | grep -E "^pool" | sed "s/^/base /"
  else a=$(echo "$s" | tr _ ' ' | sed 's/^-$//'); taskset -c 2-5 ./churn --resource pool --run $w --initial 256 $a 2>&1 | grep -E "^pool" | sed "s/^/$s /"; fi
done; done; done
