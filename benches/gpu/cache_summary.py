#!/usr/bin/env python3
"""Summary of benches/gpu/cache_ab.sh: per run and start, the median ns/op of this build with its
small-block cache (cache.txt), without (nocache.txt), a previous build (prev.txt) and RMM's pool
(rmm.txt); the median (min..max) of the rounds' ratios (round k of each against round k of the
other: they ran next to each other; against RMM also the ratio of the medians, where RMM ran
less often); the worst peak reserved / peak live and the cache hits.
usage: python3 benches/gpu/cache_summary.py DIR"""
import os, re, statistics as st, sys

d = sys.argv[1]
POOL = re.compile(r"pool:(\d+)M\s+(\S+)\s+\d+\s+\S+\s+([\d.]+)\s.*= ([\d.]+) \(.*?(?:(\d+) cache hits)?")


def ours(name):
    rows = {}
    path = os.path.join(d, name + ".txt")
    if not os.path.exists(path):
        return rows
    for line in open(path):
        m = POOL.match(line)
        if m:
            hits = re.search(r"(\d+) cache hits", line)
            rows.setdefault((m.group(2), m.group(1)), []).append(
                (float(m.group(3)), float(m.group(4)), int(hits.group(1)) if hits else 0))
    return rows


def rmm():
    rows = {}
    path = os.path.join(d, "rmm.txt")
    if not os.path.exists(path):
        return rows
    for line in open(path):
        m = re.match(r"rmm_pool\((cuda|grow from 256MiB)\)\s+(xs )?threads=(\d) .*?([\d.]+) ns/op", line)
        if m:
            run = "churn-" + ("xs-" if m.group(2) else "") + m.group(3) + "t"
            start = "2048" if m.group(1) == "cuda" else "256"
            rows.setdefault((run, start), []).append(float(m.group(4)))
    return rows


builds = {n: ours(n) for n in ("cache", "nocache", "prev")}
r = rmm()


def ratios(a, b):
    v = [x / y for x, y in zip(a, b)]
    return f"{st.median(v):.3f} ({min(v):.3f}..{max(v):.3f})" if v else "-"


print("run          start | median ns/op: cache nocache prev RMM-pool | cache/RMM: of medians; rounds | cache/prev | cache/nocache | worst ratio, hits")
for k in sorted(builds["cache"]):
    c = [x[0] for x in builds["cache"][k]]
    n = [x[0] for x in builds["nocache"].get(k, [])]
    p = [x[0] for x in builds["prev"].get(k, [])]
    m = r.get(k) or (r.get((k[0], "2048")) if k[1] == "256" and k[0].startswith("churn-xs") else None) or []
    med = lambda v: f"{st.median(v):7.1f}" if v else "      -"
    worst = max(x[1] for x in builds["cache"][k])
    hits = st.median(x[2] for x in builds["cache"][k])
    of = f"{st.median(c) / st.median(m):.3f}" if m else "-"
    print(f"{k[0]:<12} {k[1]:>5} | {med(c)} {med(n)} {med(p)} {med(m)} | {of}; {ratios(c, m)} | {ratios(c, p)} | "
          f"{ratios(c, n)} | {worst:.3f}, {hits:.0f}")
