"""Count import cycles between apollo_py's modules (grimp's import graph, networkx SCCs).

    python tools/import_cycles.py [--top-level-only] [--show]

A cycle here is a strongly connected component of more than one module in the directed graph
"module A imports module B".  By default every import counts, including those inside functions
(lazy imports still tie the modules together: neither can be understood or tested without the
other); ``--top-level-only`` keeps only imports executed when the module is first imported.
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import grimp
import networkx as nx


def _function_lines(path: Path) -> set[int]:
    """Line numbers of import statements that sit inside a function body."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    lines.add(node.lineno)
    return lines


def import_graph(package: str = "apollo_py", top_level_only: bool = False) -> nx.DiGraph:
    """The directed graph importer -> imported over the modules of ``package``."""
    g = grimp.build_graph(package, cache_dir=None)
    root = Path(sys.modules[package].__file__).parent if package in sys.modules else None
    if root is None:
        root = Path(__import__(package).__file__).parent
    out = nx.DiGraph()
    out.add_nodes_from(g.modules)
    for m in g.modules:
        lazy: set[int] = set()
        if top_level_only:
            rel = m.split(".")[1:]
            p = root.joinpath(*rel)
            path = p / "__init__.py" if p.is_dir() else p.with_suffix(".py")
            lazy = _function_lines(path)
        for dep in g.find_modules_directly_imported_by(m):
            if top_level_only:
                details = g.get_import_details(importer=m, imported=dep)
                if details and all(d["line_number"] in lazy for d in details):
                    continue
            out.add_edge(m, dep)
    return out


def cycles(graph: nx.DiGraph) -> list[list[str]]:
    """The strongly connected components with more than one module, largest first."""
    return sorted((sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1),
                  key=len, reverse=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top-level-only", action="store_true")
    ap.add_argument("--show", action="store_true", help="list the modules of each cycle")
    args = ap.parse_args(argv)
    cs = cycles(import_graph(top_level_only=args.top_level_only))
    print(f"{len(cs)} import cycle(s) (strongly connected components), "
          f"{sum(map(len, cs))} modules in them")
    if args.show:
        for c in cs:
            print(f"  {len(c)}: " + " ".join(m.removeprefix("apollo_py.") for m in c))
    return 1 if cs else 0


if __name__ == "__main__":
    raise SystemExit(main())
