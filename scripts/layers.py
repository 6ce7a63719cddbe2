#!/usr/bin/env python3
"""Checks that the crate's modules import downward: every `crate::x` a file names must be in its
own layer or one below (modules of one layer may use each other, without a loop). Prints the module graph's arrows that break that, and
any loop; exits 1 if there is one.

The layers, bottom first, are the map in CONTRIBUTING.md ("Layers"); a module not listed fails.
Doc comments are skipped (a doc link may point anywhere); tests (`#[cfg(test)]` modules and
`tests.rs` files) may use any module.
"""
import os
import re
import sys

LAYERS = [
    ["error", "sys"],
    ["topology", "config", "setup", "stats", "guard", "fork"],
    ["cuda"],
    ["chunk"],
    ["arena"],
    ["process"],
    ["blocks"],
    ["runtime"],
    ["stats_exit"],
    ["alloc", "api2", "global", "pinned", "reservation", "unstable"],
]
LAYER_OF = {m: i for i, layer in enumerate(LAYERS) for m in layer}
# Re-exported at the root: `crate::pci` is `topology::pci`.
ALIASES = {"pci": "topology", "sysfs": "topology"}

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src")


def top_module(path):
    rel = os.path.relpath(path, root)
    first = rel.split(os.sep)[0]
    return first[:-3] if first.endswith(".rs") else first


def code_lines(text):
    """The file's code with comments removed and `#[cfg(test)]` modules cut off."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for line in text.splitlines():
        if re.match(r"\s*#\[cfg\(test\)\]", line):
            break
        out.append(line.split("//")[0])
    return "\n".join(out)


def names(code):
    found = set(re.findall(r"\bcrate::([a-z_][a-z0-9_]*)", code))
    for group in re.findall(r"\bcrate::\{([^}]*)\}", code, flags=re.S):
        found |= set(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group))
    return found


edges = {}
for dirpath, _, files in os.walk(root):
    for name in files:
        if not name.endswith(".rs") or name == "lib.rs" or name == "tests.rs":
            continue
        if os.sep + "tests" + os.sep in os.path.join(dirpath, name):
            continue
        path = os.path.join(dirpath, name)
        module = top_module(path)
        code = code_lines(open(path).read())
        for target in names(code):
            if target in ("Error", "Result", "self") or target[0].isupper():
                target = "error" if target in ("Error", "Result") else None
            target = ALIASES.get(target, target)
            if target and target != module:
                edges.setdefault((module, target), set()).add(os.path.relpath(path, root))

bad = False
unknown = sorted({m for pair in edges for m in pair if m not in LAYER_OF})
if unknown:
    print("modules missing from the layer map:", ", ".join(unknown))
    bad = True
for (src, dst), files in sorted(edges.items()):
    if src in LAYER_OF and dst in LAYER_OF and LAYER_OF[dst] > LAYER_OF[src]:
        print(f"upward: {src} (layer {LAYER_OF[src] + 1}) -> {dst} (layer {LAYER_OF[dst] + 1}) in {', '.join(sorted(files))}")
        bad = True

# Loops, whatever the layers say (Tarjan's strongly connected components).
graph = {}
for src, dst in edges:
    graph.setdefault(src, set()).add(dst)
index, low, stack, on, loops, counter = {}, {}, [], set(), [], [0]


def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in graph.get(v, ()):
        if w not in index:
            visit(w)
            low[v] = min(low[v], low[w])
        elif w in on:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        component = []
        while True:
            w = stack.pop()
            on.discard(w)
            component.append(w)
            if w == v:
                break
        if len(component) > 1:
            loops.append(sorted(component))


for v in list(graph):
    if v not in index:
        visit(v)
for loop in loops:
    print("loop:", " <-> ".join(loop))
    bad = True
arrows = len(edges)
print(f"{arrows} arrows between {len({m for pair in edges for m in pair})} modules; "
      f"{'problems above' if bad else 'all point down, no loop'}")
sys.exit(1 if bad else 0)
