#!/usr/bin/env python3
"""Finds import cycles between the modules of src/ (issue 17: a lower layer never names a higher
one; the crate root's docs, "Layers", say which may use which).

Reads every `crate::...`, `super::...` and `self::...` path in the code (comments left out, and
each file's `mod tests` under `#[cfg(test)]` or `#[cfg(all(test, ...))]`), maps it to the module
it names, and reports every cycle between sibling modules at each depth: a module and its own
submodules may name each other (a parent re-exports its children, a child uses its parent's
types), siblings may not both ways.

usage: python3 .ci/import_cycles.py [--allow A<->B]...   (exit 1 on a cycle not allowed)
"""
import os
import re
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def module_of(path):
    parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
    if parts[-1] in ("mod", "lib"):
        parts = parts[:-1]
    return "::".join(parts)


def code_of(path):
    text = open(path, encoding="utf-8").read()
    # `#[cfg(test)]` or `#[cfg(all(test, not(streamalloc_loom)))]`: tests only either way.
    cut = re.search(r"#\[cfg\((?:all\()?test\b[^\]]*\]\nmod tests\b", text)
    if cut:
        text = text[: cut.start()]
    return "\n".join(l for l in text.split("\n") if not l.strip().startswith("//"))


def main():
    allowed = set()
    args = sys.argv[1:]
    while args:
        if args[0] == "--allow" and len(args) > 1:
            a, b = args[1].split("<->")
            # The same cycle seen from higher up (`device <-> reactor` for
            # `device::cuda <-> reactor`) is allowed with it.
            for depth in range(1, 6):
                ca, cb = "::".join(a.split("::")[:depth]), "::".join(b.split("::")[:depth])
                if ca != cb:
                    allowed.add(frozenset((ca, cb)))
            args = args[2:]
        else:
            sys.exit(__doc__)
    files = {}
    for d, _, names in os.walk(ROOT):
        for n in names:
            if n.endswith(".rs"):
                p = os.path.join(d, n)
                files[module_of(p)] = code_of(p)
    modules = set(files)
    named = {m: set() for m in files}
    for m, code in files.items():
        here = m.split("::") if m else []
        for g in re.finditer(r"crate::([a-z_][a-z0-9_:]*)", code):
            named[m].add(g.group(1).rstrip(":"))
        for g in re.finditer(r"\b((?:super::)+)([a-z_][a-z0-9_:]*)?(\{[^}]*\})?", code):
            base = here[: len(here) - g.group(1).count("super::")]
            rest = (g.group(2) or "").rstrip(":")
            paths = [rest] if rest else []
            if g.group(3):
                paths = [
                    (rest + "::" if rest else "") + x.strip().split("::")[0]
                    for x in g.group(3)[1:-1].split(",")
                    if x.strip()
                ]
            for p in paths:
                named[m].add("::".join(base + [p]))
        for g in re.finditer(r"\bself::([a-z_][a-z0-9_:]*)", code):
            named[m].add("::".join(here + [g.group(1).rstrip(":")]))

    def resolve(path):
        parts = path.split("::")
        for i in range(len(parts), 0, -1):
            if "::".join(parts[:i]) in modules:
                return "::".join(parts[:i])
        return None

    found = []
    for depth in range(1, 6):
        cut = lambda m: "::".join(m.split("::")[:depth])
        graph = {}
        for a, paths in named.items():
            for p in paths:
                b = resolve(p)
                if b is None or not a:
                    continue
                ca, cb = cut(a), cut(b)
                if ca == cb or ca.startswith(cb + "::") or cb.startswith(ca + "::"):
                    continue
                graph.setdefault(ca, set()).add(cb)
        for a in sorted(graph):
            for b in sorted(graph[a]):
                if a < b and a in graph.get(b, ()):
                    pair = frozenset((a, b))
                    if (pair, depth) not in [(f[0], f[1]) for f in found]:
                        found.append((pair, depth, a, b))
    bad = 0
    seen = set()
    for pair, _, a, b in found:
        if pair in seen:
            continue
        seen.add(pair)
        if pair in allowed:
            print(f"allowed: {a} <-> {b}")
        else:
            print(f"import cycle: {a} <-> {b}")
            bad += 1
    # Longer cycles (a -> b -> c -> a) at the top level.
    top = {}
    for a, paths in named.items():
        for p in paths:
            b = resolve(p)
            if b and a:
                ta, tb = a.split("::")[0], b.split("::")[0]
                if ta != tb:
                    top.setdefault(ta, set()).add(tb)
    for pair in allowed:
        a, b = sorted(pair)
        for x, y in ((a.split("::")[0], b.split("::")[0]), (b.split("::")[0], a.split("::")[0])):
            top.get(x, set()).discard(y)
    state = {}

    def visit(v, stack):
        state[v] = 1
        for w in sorted(top.get(v, ())):
            if state.get(w) == 1:
                print("import cycle: " + " -> ".join(stack[stack.index(w):] + [w]))
                return True
            if not state.get(w) and visit(w, stack + [w]):
                return True
        state[v] = 2
        return False

    for v in sorted(top):
        if not state.get(v) and visit(v, [v]):
            bad += 1
            break
    print(f"{bad} import cycle(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
