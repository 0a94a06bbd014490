# bash ab3.sh ROUNDS: churn-4t and churn-xs-4t from 256 MiB, three arms of one binary (moves off;
# moves; moves with the keep rule), and the default from 2 GiB; the order rotating.
arms=("base" "off" "moves" "keep"); n=4
for r in $(seq $1); do for w in churn-4t churn-xs-4t; do for i in 0 1 2 3; do
  a=${arms[$(( (i + r) % n ))]}
  case $a in
    base) taskset -c 2-5 ./churn --resource pool --run $w --initial 2048 ;;
    off) taskset -c 2-5 ./churn --resource pool --run $w --initial 256 --chunk-moves off ;;
    moves) taskset -c 2-5 ./churn --resource pool --run $w --initial 256 ;;
    keep) SA_KEEP=1 taskset -c 2-5 ./churn --resource pool --run $w --initial 256 ;;
  esac 2>&1 | grep "^pool" | sed "s/^/$a /"
done; done; done
