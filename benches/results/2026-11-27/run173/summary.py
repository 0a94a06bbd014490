#!/usr/bin/env python3
"""run173's figures: medians of our pool's and the expandable pool's ns/op by run and start,
RMM's pool by run (median of the rounds), ours / RMM, the adjacent pairs (each 256 MiB run over
the 2 GiB run just before it) and the worst peak reserved / peak live.
usage: python3 summary.py DIR   (DIR holds ours.txt[.gz], expandable.txt[.gz], rmm.txt[.gz])"""
import gzip, os, re, statistics, sys

def lines(d, name):
    for n in (name, name + ".gz"):
        p = os.path.join(d, n)
        if os.path.exists(p):
            return (gzip.open(p, "rt") if n.endswith(".gz") else open(p)).read().splitlines()
    return []

def ours(rows):
    ns, mem, pairs, prev = {}, {}, {}, {}
    for l in rows:
        m = re.match(r"(\w+):(\d+)M\s+(churn[-\w]*)\s+\d+\s+\S+\s+([\d.]+)\s.*= ([\d.]+) \(", l)
        if not m:
            continue
        _, start, run, v, ratio = m.groups()
        ns.setdefault((run, start), []).append(float(v))
        if start == "2048":
            prev[run] = float(v)
        elif run in prev:
            pairs.setdefault(run, []).append(float(v) / prev.pop(run))
            mem[run] = max(mem.get(run, 0), float(ratio))
    return ns, mem, pairs

def rmm(rows):
    out = {}
    for l in rows:
        m = re.match(r"rmm_pool\(cuda\)\s+(xs )?threads=(\d) .* ([\d.]+) ns/op", l)
        if m:
            run = "churn-%s%st" % ("xs-" if m.group(1) else "", m.group(2))
            out.setdefault(run, []).append(float(m.group(3)))
    return out

d = sys.argv[1]
med = statistics.median
ns, mem, pairs = ours(lines(d, "ours.txt"))
ens, emem, _ = ours(lines(d, "expandable.txt"))
r = rmm(lines(d, "rmm.txt"))
print("run | start | pool ns/op median (min..max, n) | RMM pool median (n) | ours/RMM | pairs median (min..max, n) | worst mem | expandable ns/op median, worst mem")
for run in ("churn-1t", "churn-4t", "churn-xs-1t", "churn-xs-4t"):
    for start in ("2048", "256"):
        v = ns.get((run, start), [])
        if not v:
            continue
        row = [run, start, "%.1f (%.1f..%.1f, %d)" % (med(v), min(v), max(v), len(v))]
        if start == "2048" and r.get(run):
            row += ["%.1f (%d)" % (med(r[run]), len(r[run])), "%.3f" % (med(v) / med(r[run]))]
        else:
            row += ["", ""]
        p = pairs.get(run, [])
        row += ["%.3f (%.2f..%.2f, %d)" % (med(p), min(p), max(p), len(p)) if start == "256" and p else ""]
        row += ["%.3f" % mem[run] if start == "256" and run in mem else ""]
        e = ens.get((run, start), [])
        row += ["%.1f%s" % (med(e), ", %.3f" % emem[run] if start == "256" and run in emem else "") if e else ""]
        print(" | ".join(row))
