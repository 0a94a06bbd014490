#!/usr/bin/env python3
"""Summary of the interleaved builds of one GPU call (contended_ab.sh): per run and start, each
build's median ns/op over the rounds, the median (min..max) of the rounds' ratios of the first
build to each other (round k against round k: they ran next to each other), and the worst peak
reserved / peak live of each. RMM's pool (rmm.txt) beside, if there.
usage: python3 benches/gpu/builds_summary.py DIR NAME... (NAME.txt in DIR; the first is the
build the ratios are of)"""
import os, re, statistics as st, sys

d, names = sys.argv[1], sys.argv[2:]
LINE = re.compile(r"(pool|expandable):(\d+)M\s+(\S+)\s+\d+\s+\S+\s+([\d.]+)\s.*= ([\d.]+) \(")


def rows(name):
    out = {}
    for line in open(os.path.join(d, name + ".txt")):
        m = LINE.match(line)
        if m:
            out.setdefault((m.group(3), m.group(2)), []).append((float(m.group(4)), float(m.group(5))))
    return out


def rmm():
    out = {}
    path = os.path.join(d, "rmm.txt")
    if os.path.exists(path):
        for line in open(path):
            m = re.match(r"rmm_pool\((cuda|grow from 256MiB)\)\s+(xs )?threads=(\d) .*?([\d.]+) ns/op", line)
            if m:
                run = "churn-" + ("xs-" if m.group(2) else "") + m.group(3) + "t"
                out.setdefault((run, "2048" if m.group(1) == "cuda" else "256"), []).append(float(m.group(4)))
    return out


builds = {n: rows(n) for n in names}
r = rmm()
head = "run          start | " + " ".join(f"{n:>8}" for n in names) + " |  RMM | " + " | ".join(
    f"{names[0]}/{n}" for n in names[1:]) + " | worst memory ratio: " + " ".join(names)
print(head)
for k in sorted(builds[names[0]]):
    meds = [st.median(x[0] for x in builds[n][k]) if k in builds[n] else float("nan") for n in names]
    m = r.get(k) or (r.get((k[0], "2048")) if k[1] == "256" and "xs" in k[0] else None)
    ratios = []
    for n in names[1:]:
        v = [a[0] / b[0] for a, b in zip(builds[names[0]][k], builds[n].get(k, []))]
        ratios.append(f"{st.median(v):.3f} ({min(v):.2f}..{max(v):.2f})" if v else "-")
    worst = " ".join(f"{max(x[1] for x in builds[n][k]):.3f}" if k in builds[n] else "-" for n in names)
    rmm_med = f"{st.median(m):5.0f}" if m else "    -"
    print(f"{k[0]:<12} {k[1]:>5} | " + " ".join(f"{x:8.1f}" for x in meds) + f" | {rmm_med} | "
          + " | ".join(ratios) + " | " + worst)
