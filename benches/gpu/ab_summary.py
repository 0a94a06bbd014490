#!/usr/bin/env python3
"""Summarises benches/gpu/ab.sh: per run and start, the medians of this build and before, and
the median (and spread) of the per-round ratios this / before (each round runs both, one after
the other, so a round's ratio cancels the host's drift). usage: ab_summary.py DIR"""
import os, re, statistics, sys

d = sys.argv[1]


def load(name):
    runs = {}
    for line in open(os.path.join(d, name)):
        m = re.match(r"pool:(\d+)M\s+(\S+)\s+\d+\s+\S+\s+([\d.]+)\s.*= ([\d.]+) \(", line)
        if m:
            runs.setdefault((m.group(2), int(m.group(1))), []).append((float(m.group(3)), float(m.group(4))))
    return runs


now, before = load("churn.txt"), load("churn-before.txt")
print(f"{'run':<12} {'start':>5} | {'this':>7} {'before':>7} {'ratio':>6} | round ratios: median (p25..p75), min..max | peak reserved / live, this")
for key in sorted(now, key=lambda k: (k[0], -k[1])):
    a, b = [x[0] for x in now[key]], [x[0] for x in before.get(key, [])]
    ratios = sorted(x / y for x, y in zip(a, b))
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    print(f"{key[0]:<12} {key[1]:>5} | {statistics.median(a):>7.1f} {statistics.median(b):>7.1f} "
          f"{statistics.median(a) / statistics.median(b):>6.2f} | {statistics.median(ratios):.2f} ({q[0]:.2f}..{q[2]:.2f}), "
          f"{ratios[0]:.2f}..{ratios[-1]:.2f} | {max(x[1] for x in now[key]):.2f} max")
