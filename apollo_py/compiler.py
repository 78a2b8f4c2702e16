"""The pipeline (DESIGN §3): one short function listing the passes in order.

Graph --preprocess--> Graph --partition--> [MicroGraph] --layer1/2/3--> [Kernel]
      --codegen--> Executable
Each pass is a pure function from one immutable value to the next.
"""
from __future__ import annotations

from .ir.graph import Graph
from .options import Options
from .plan import Plan


def compile_graph(graph: Graph, options: Options):
    """Compile a static-shape primitive graph into an executable with ``.run(feeds)`` and ``.plan``."""
    from .partition import partition, preprocess
    from .partition.execute import MicroGraphExecutable

    graph = preprocess(graph, options)
    plan = Plan(graph=graph, micro_graphs=partition(graph, options))
    if options.target != "reference":
        from .errors import CompileError
        raise CompileError(f"target {options.target!r} is not available yet (available: 'reference')")
    return MicroGraphExecutable(graph, plan)
