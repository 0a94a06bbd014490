#!/usr/bin/env python3
"""Summarises one benches/gpu/compare.sh run: medians of our churn (this build and before) beside
RMM's pool from the same run, with ratios. usage: summary.py DIR (holding churn.txt, rmm.txt and,
if there, churn-before.txt). usage: summary.py DIR [NOW BEFORE]: other files for "now" and "before"
(e.g. churn-slack0.txt churn-slack0-off.txt, to set one build's two settings side by side)."""
import os, re, statistics, sys

d = sys.argv[1]


def ours(name):
    runs = {}
    path = os.path.join(d, name)
    if not os.path.exists(path):
        return runs
    for line in open(path):
        m = re.match(r"pool:(\d+)M\s+(\S+)\s+\d+\s+\S+\s+([\d.]+)\s.*= ([\d.]+) \(", line)
        if m:
            runs.setdefault((m.group(2), int(m.group(1))), []).append((float(m.group(3)), float(m.group(4))))
    return runs


rmm = {}
for line in open(os.path.join(d, "rmm.txt")):
    m = re.match(r"(rmm_\w+\([^)]*\)|rmm_\w+)\s+(xs )?threads=(\d).*?([\d.]+) ns/op", line)
    if m:
        run = f"churn-{'xs-' if m.group(2) else ''}{m.group(3)}t"
        rmm.setdefault((m.group(1), run), []).append(float(m.group(4)))
now = ours(sys.argv[2] if len(sys.argv) > 2 else "churn.txt")
before = ours(sys.argv[3] if len(sys.argv) > 3 else "churn-before.txt")
print(f"{'run':<12} {'start':>5} | {'now ns/op':>9} {'before':>7} {'RMM pool':>8} {'now/RMM':>7} | ratio now (all)      ratio before (all)")
for (run, start) in sorted(now, key=lambda k: (k[0], -k[1])):
    n = statistics.median(x[0] for x in now[(run, start)])
    b = [x[0] for x in before.get((run, start), [])]
    key = "rmm_pool(grow from 256MiB)" if start == 256 and "xs" not in run else "rmm_pool(cuda)"
    r = rmm.get((key, run), [])
    rm = statistics.median(r) if r else float("nan")
    print(f"{run:<12} {start:>5} | {n:>9.1f} {statistics.median(b) if b else float('nan'):>7.1f} {rm:>8.0f} {n / rm:>7.3f} |"
          f" {' '.join(f'{x[1]:.2f}' for x in now[(run, start)]):<20} {' '.join(f'{x[1]:.2f}' for x in before.get((run, start), []))}")
