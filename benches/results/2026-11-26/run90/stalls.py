#!/usr/bin/env python3
"""Issue 18's p99 to the task against the host's stalls, over every `event_latency` cell of the
default (`words`) in run73 to run90 (tenth session, BENCHMARKS.md). Reads the logs where they lie
(tarballs and .gz files). usage: python3 run90/stalls.py [DIR of results/2026-11-26]"""
import glob, gzip, io, os, re, statistics, sys, tarfile

D = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAT = re.compile(r"^words\s+(\S+)\s+(\d+)\s+\S+\s+\S+\s+\S+\s+(\S+)\s")
ST = re.compile(r"^words\s+(\S+)\s+stalls >= 50µs [\d.]+/s, longest \S+, 50µs late at ([\d.]+)% of instants")


def us(x):
    m = re.match(r"([\d.]+)(ns|µs|ms|s)", x)
    return float(m.group(1)) * {"ns": 1e-3, "µs": 1, "ms": 1e3, "s": 1e6}[m.group(2)]


def logs():
    """(name, text) of every latency log of the default: run82 and run77 compared a patch (0:
    the default), run88 to run90 variants (w: the default)."""
    for run in sorted(os.listdir(D)):
        n = int(run[3:]) if run.startswith("run") and run[3:].isdigit() else 0
        if not 73 <= n <= 90:
            continue
        for path in glob.glob(os.path.join(D, run, "*")):
            if path.endswith(".tgz"):
                with tarfile.open(path) as t:
                    for m in t.getmembers():
                        name = os.path.basename(m.name)
                        if name.startswith("el-") and not (n in (77, 82) and not name.startswith("el-0-")):
                            yield f"{run}/{name}", t.extractfile(m).read().decode(errors="replace")
            elif path.endswith("/w.txt.gz"):
                yield f"{run}/w.txt", gzip.open(path, "rt", errors="replace").read()


rows = []
for name, text in logs():
    lat, st = {}, {}
    for line in text.splitlines():
        m = LAT.match(line)
        if m and m.group(2).isdigit():
            lat.setdefault(m.group(1), []).append(us(m.group(3)))
        m = ST.match(line)
        if m:
            st.setdefault(m.group(1), []).append(float(m.group(2)))
    for k in lat:
        rows += [(name, k, p99, late) for p99, late in zip(lat[k], st.get(k, []))]
print(len(rows), "cells")
for lo, hi in [(0, 0.05), (0.05, 0.2), (0.2, 100)]:
    sel = [r for r in rows if lo <= r[3] < hi]
    met = sum(r[2] < 50 for r in sel)
    print(f"50 µs late at {lo}-{hi}% of instants: {len(sel)} cells, p99 under 50 µs in {met} "
          f"({100 * met / len(sel):.0f}%), median p99 {statistics.median(r[2] for r in sel):.1f} µs")
print("missed at under 0.05%:", [r for r in rows if r[3] < 0.05 and r[2] >= 50])
