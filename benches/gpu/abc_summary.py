#!/usr/bin/env python3
"""Summarises benches/gpu/abc.sh: per run and start, each build's median ns/op, RMM's pool from
the same call, the ratio to RMM, and the median of the per-round ratios of the first build to
each other one (each round runs every build, so a round's ratio cancels the host's drift); and
the peak reserved / peak live of every repeat. usage: abc_summary.py DIR [BUILD ...]
(default: the churn-*.txt files found, `this` first)."""
import os, re, statistics, sys

d = sys.argv[1]


def ours(path):
    runs = {}
    for line in open(path):
        m = re.match(r"(?:pool|expandable):(\d+)M\s+(\S+)\s+\d+\s+\S+\s+([\d.]+)\s.*= ([\d.]+) \(", line)
        if m:
            runs.setdefault((m.group(2), int(m.group(1))), []).append((float(m.group(3)), float(m.group(4))))
    return runs


names = sys.argv[2:] or sorted(
    (f[6:-4] for f in os.listdir(d) if f.startswith("churn-") and f.endswith(".txt")),
    key=lambda n: (n != "this", n))
builds = {n: ours(os.path.join(d, f"churn-{n}.txt")) for n in names}
if os.path.exists(os.path.join(d, "expandable.txt")):
    builds["expandable"] = ours(os.path.join(d, "expandable.txt"))
rmm = {}
if os.path.exists(os.path.join(d, "rmm.txt")):
    for line in open(os.path.join(d, "rmm.txt")):
        m = re.match(r"(rmm_\w+\([^)]*\)|rmm_\w+)\s+(xs )?threads=(\d).*?([\d.]+) ns/op", line)
        if m:
            run = f"churn-{'xs-' if m.group(2) else ''}{m.group(3)}t"
            rmm.setdefault((m.group(1), run), []).append(float(m.group(4)))
first, others = names[0], [n for n in builds if n != names[0]]
head = f"{'run':<12} {'start':>5} |" + "".join(f" {n:>10}" for n in builds) + f" {'RMM pool':>9} {first + '/RMM':>9} |"
head += "".join(f" {first}/{n} rounds: median (min..max) |" for n in others)
print(head)
for key in sorted(builds[first], key=lambda k: (k[0], -k[1])):
    run, start = key
    med = {n: statistics.median(x[0] for x in b[key]) if b.get(key) else float("nan") for n, b in builds.items()}
    rk = "rmm_pool(grow from 256MiB)" if start == 256 and "xs" not in run else "rmm_pool(cuda)"
    r = rmm.get((rk, run), [])
    rm = statistics.median(r) if r else float("nan")
    line = f"{run:<12} {start:>5} |" + "".join(f" {med[n]:>10.1f}" for n in builds) + f" {rm:>9.0f} {med[first] / rm:>9.3f} |"
    for n in others:
        pairs = sorted(a[0] / b[0] for a, b in zip(builds[first][key], builds[n].get(key, [])))
        line += f" {statistics.median(pairs):.2f} ({pairs[0]:.2f}..{pairs[-1]:.2f}) |" if pairs else " - |"
    print(line)
print("\npeak reserved / peak live from 256 MiB, every repeat:")
for key in sorted(builds[first], key=lambda k: k[0]):
    if key[1] != 256:
        continue
    print(f"{key[0]:<12} " + " | ".join(f"{n}: {' '.join(f'{x[1]:.2f}' for x in b.get(key, []))}" for n, b in builds.items()))
print("\nRMM's pool, every round (ns/op):")
for (name, run), v in sorted(rmm.items()):
    if name.startswith("rmm_pool"):
        print(f"{name:<28} {run:<12} {' '.join(f'{x:.0f}' for x in v)}")
