#!/usr/bin/env bash
# Packs .gpu/ for one device call within the 64 MiB a call carries (with the working tree):
# ../shared/tools/gpu-pack with the given --bench/--example arguments, symbols stripped (the
# release profile keeps line tables: 89 MiB with every example, 55 without), benches moved
# from tests/ to bin/ (gpu-pack files them as tests, and `.gpu/run` would run them as such),
# and the examples no test needs left out unless named. The tools' tests run the packed
# streamalloc-replay and streamalloc-picture: those always stay.
# usage (the project's root): bash benches/gpu/pack.sh [--bench NAME]... [--example NAME]...
set -euo pipefail
keep=(streamalloc-replay streamalloc-picture) benches=()
args=("$@")
while (($#)); do
  case $1 in
    --bench) benches+=("$2"); shift 2 ;;
    --example) keep+=("$2"); shift 2 ;;
    *) echo "pack.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
../shared/tools/gpu-pack "${args[@]}"
strip .gpu/tests/* .gpu/bin/* 2>/dev/null || true
for b in "${benches[@]}"; do
  for f in .gpu/tests/"$b"-*; do [ -e "$f" ] && mv "$f" .gpu/bin/; done
  keep+=("$b-*")
done
for f in .gpu/bin/*; do
  name=$(basename "$f") wanted=0
  for k in "${keep[@]}"; do
    # shellcheck disable=SC2053
    [[ $name == $k ]] && wanted=1
  done
  [ "$wanted" = 1 ] || rm -f "$f"
done
du -sh .gpu
ls .gpu/bin
