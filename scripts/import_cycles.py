#!/usr/bin/env python3
"""The circles in autosessd's import graph: every strongly connected component of more than
one module, typing-only imports (`if TYPE_CHECKING:`) and imports inside functions included,
as grimp reads them, and then the same among the packages (each subpackage's modules taken as
one: a.x -> b.y and b.z -> a.w is a circle of packages a and b with no circle of modules).
Prints each circle and the imports that close it; exit 1 when there is one, 0 (and nothing
printed) when the graph has none.

    python scripts/import_cycles.py [package]

`lint-imports` (pyproject.toml's contracts, run by `make test`) fails on the same circles;
this says which arrows to cut."""

from __future__ import annotations

import sys

import grimp


def components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively (no recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def main(package: str = "autosessd") -> int:
    graph = grimp.build_graph(package)
    edges = {m: set(graph.find_modules_directly_imported_by(m)) & graph.modules for m in graph.modules}
    circles = components(edges)
    for comp in circles:
        print(f"a circle of {len(comp)} modules: {', '.join(comp)}")
        inside = set(comp)
        for m in comp:
            for d in sorted(edges[m] & inside):
                for detail in graph.get_import_details(importer=m, imported=d):
                    print(f"  {m} -> {d}  (line {detail['line_number']}: {detail['line_contents']})")
    top = {m: ".".join(m.split(".")[:2]) for m in graph.modules}
    packages = {top[m] for m in graph.modules if graph.find_children(top[m])}
    squashed: dict[str, set[str]] = {top[m]: set() for m in graph.modules}
    for m, ds in edges.items():
        squashed[top[m]] |= {top[d] for d in ds if top[d] != top[m]}
    rings = [c for c in components(squashed) if set(c) & packages]
    for comp in rings:
        print(f"a circle of {len(comp)} packages: {', '.join(comp)}")
        for m in sorted(edges):
            for d in sorted(edges[m]):
                if top[m] != top[d] and top[m] in comp and top[d] in comp:
                    for detail in graph.get_import_details(importer=m, imported=d):
                        print(f"  {m} -> {d}  (line {detail['line_number']}: {detail['line_contents']})")
    return 1 if circles or rings else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
