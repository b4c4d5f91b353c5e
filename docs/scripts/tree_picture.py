"""Make a picture of the package's tree: rooms (subpackages), the modules in each, and the imports between rooms.

    python docs/scripts/tree_picture.py [--root .] [--out docs/img/tree.png] [--dot]

Reads the source of ``lightning_snapshot/`` and ``backends/`` (installed as ``lightning_snapshot.backends``) under
``--root``, with every import counted (at module level and inside functions; imports under ``if TYPE_CHECKING:`` are
not). A *room* is a subpackage of ``lightning_snapshot`` (``backends`` is one room); a module directly in
``lightning_snapshot/`` is a room of its own. Rooms are drawn as boxes holding their modules, one arrow per pair of
rooms that import each other (labelled with the number of imports), on *floors*: a room sits one floor above the
highest room it imports. An arrow that runs back up (between rooms that import each other through a cycle) is drawn
red, and the script prints the counts: rooms, modules, arrows, arrows in cycles, and imports of another module's
private names. Needs Graphviz's ``dot`` for the PNG (``apt-get install -y graphviz``); ``--dot`` prints the DOT text.
"""

from __future__ import annotations

import argparse
import ast
import collections
import shutil
import subprocess
import sys
from pathlib import Path


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[0] == "backends":
        parts = ["lightning_snapshot", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(root: Path) -> tuple[set[str], set[tuple[str, str]], int]:
    """The package's modules, the (importer, imported) pairs between them, and the imports of private names."""
    files = [p for d in ("lightning_snapshot", "backends") for p in sorted((root / d).rglob("*.py"))]
    modules = {module_name(root, p) for p in files}
    edges: set[tuple[str, str]] = set()
    private = 0
    for path in files:
        me = module_name(root, path)
        tree = ast.parse(path.read_text())
        skip = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_snapshot"):
                module = node.module or ""
                subs = [f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in modules]
                targets = subs or [module]
                private += sum(a.name.startswith("_") and not a.name.startswith("__") for a in node.names)
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("lightning_snapshot")]
            for target in targets:
                while target not in modules and "." in target:
                    target = target.rsplit(".", 1)[0]
                if target in modules and target != me:
                    edges.add((me, target))
    return modules, edges, private


def cycles(nodes: set[str], edges: set[tuple[str, str]]) -> list[set[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    out = collections.defaultdict(set)
    for a, b in edges:
        out[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in out[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(comp)

    sys.setrecursionlimit(10_000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", default=".", help="the checkout to draw (default: the current directory)")
    p.add_argument("--out", default="docs/img/tree.png", help="the PNG to write")
    p.add_argument("--dot", action="store_true", help="print the DOT text instead of drawing it")
    a = p.parse_args()
    root = Path(a.root)
    modules, edges, private = imports(root)
    rooms = collections.defaultdict(list)
    for m in sorted(modules):
        rooms[room_of(m)].append(m)
    arrows = collections.Counter((room_of(x), room_of(y)) for x, y in edges if room_of(x) != room_of(y))
    loops = cycles(set(rooms), set(arrows))
    in_loop = {(x, y) for x, y in arrows for c in loops if x in c and y in c}
    module_loops = cycles(modules, edges)
    floor: dict[str, int] = {}

    def height(r: str, seen: frozenset[str] = frozenset()) -> int:
        if r not in floor:
            below = [y for (x, y) in arrows if x == r and y not in seen and (x, y) not in in_loop]
            floor[r] = 1 + max((height(y, seen | {r}) for y in below), default=-1)
        return floor[r]

    for r in rooms:
        height(r)
    lines = [
        "digraph tree {",
        '  rankdir=BT; newrank=true; compound=true; node [shape=plaintext, fontsize=9, fontname="Helvetica"];',
        '  edge [color="#555555", arrowsize=0.6, fontsize=8, fontname="Helvetica"];',
    ]
    for r, members in sorted(rooms.items()):
        names = [m.split(".", 2)[-1] for m in members if m.count(".") >= 2]  # (the package's __init__ is its box)
        if len(members) > 1:
            listing = "<BR/>".join(sorted(names))
            label = f'<<B>{r}/</B><BR/><FONT POINT-SIZE="8">{listing}</FONT>>'
            lines.append(f'  "{r}" [shape=box, style="rounded,filled", fillcolor="#eef3fb", label={label}];')
        else:
            lines.append(f'  "{r}" [shape=box, style=rounded, label=<<B>{r}</B>>];')
    for f in sorted(set(floor.values())):
        same = " ".join(f'"{r}"' for r in rooms if floor[r] == f)
        lines.append(f"  {{ rank=same; {same} }}")
    for (x, y), n in sorted(arrows.items()):
        style = ', color="red", penwidth=2' if (x, y) in in_loop else ""
        if y == "errors" and not style:  # (every room raises the library's errors: drawn faint)
            style = ', color="#cccccc", fontcolor="#aaaaaa"'
        lines.append(f'  "{x}" -> "{y}" [label="{n}"{style}];')
    lines.append("}")
    dot = "\n".join(lines)
    print(
        f"rooms: {len(rooms)} ({sum(len(v) > 1 for v in rooms.values())} subpackages), modules: {len(modules)},"
        f" floors: {len(set(floor.values()))}, arrows between rooms: {len(arrows)}, arrows running back up (in a"
        f" cycle of rooms): {len(in_loop)}, module cycles: {len(module_loops)}, imports of private names: {private}",
        file=sys.stderr,
    )
    if a.dot:
        print(dot)
        return 0
    if shutil.which("dot") is None:
        print("Graphviz's dot is not on PATH (apt-get install -y graphviz); --dot prints the DOT text", file=sys.stderr)
        return 1
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dot", "-Tpng", "-Gdpi=110", "-o", a.out], input=dot, text=True, check=True)
    print(f"wrote {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
