#!/usr/bin/env python3
"""Summary of benches/gpu/units.sh, expandable_ab.sh, cap_ab.sh, placement_ab.sh and initial_ab.sh: per run and start, each build's median
ns/op, its worst peak reserved / peak live, its median ms growing; RMM's pool if rmm.txt is there.
usage: python3 benches/gpu/units_summary.py DIR"""
import re, sys, glob, statistics as st, os
d = sys.argv[1]
rows = {}
for f in sorted(glob.glob(d + "/pool.txt") + glob.glob(d + "/exp-*.txt") + glob.glob(d + "/cap-*.txt")):
    name = os.path.basename(f)[:-4]
    for line in open(f):
        m = re.match(r"(\w+):(\d+)M\s+(\S+)\s+\d+\s+\S+\s+([\d.]+)\s.*= ([\d.]+) \((\d+) grows.*?([\d.]+) ms growing", line)
        if m:
            k = (m.group(3), m.group(2))
            rows.setdefault(k, {}).setdefault(name, []).append((float(m.group(4)), float(m.group(5)), float(m.group(7))))
found = {n for r in rows.values() for n in r}
first = ["pool", "exp-2", "exp-8", "exp-16"]
names = [n for n in first if n in found] + sorted(found - set(first))
print("run          start | " + " | ".join(f"{n:>22}" for n in names) + "   (median ns/op, ratio, ms growing)")
for k in sorted(rows):
    out = []
    for n in names:
        v = rows[k].get(n, [])
        if not v:
            out.append(" " * 22); continue
        out.append(f"{st.median(x[0] for x in v):7.1f} {max(x[1] for x in v):5.2f} {st.median(x[2] for x in v):6.1f}ms")
    print(f"{k[0]:<12} {k[1]:>5} | " + " | ".join(out))
print()
print("each / pool, the median (min..max) of the rounds' ratios (rounds paired in order):")
for k in sorted(rows):
    pool = [x[0] for x in rows[k].get("pool", [])]
    out = []
    for n in names:
        if n == "pool":
            continue
        v = [x[0] for x in rows[k].get(n, [])]
        r = [a / b for a, b in zip(v, pool)]
        if r:
            out.append(f"{n} {st.median(r):.2f} ({min(r):.2f}..{max(r):.2f})")
    print(f"{k[0]:<12} {k[1]:>5} | " + " | ".join(out))
rmm = os.path.join(d, "rmm.txt")
if os.path.exists(rmm):
    print()
    print("RMM's pool, every round (ns/op):")
    for line in open(rmm):
        m = re.match(r"(rmm_pool\([^)]*\))\s+(xs )?threads=(\d).*?([\d.]+) ns/op", line)
        if m:
            print(f"  {m.group(1)} {'churn-xs' if m.group(2) else 'churn'}-{m.group(3)}t {m.group(4)}")
