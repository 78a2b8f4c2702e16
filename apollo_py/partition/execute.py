"""Reference execution micro-graph by micro-graph (``target="reference"``).

Each micro-graph runs through the numpy references in its own environment that holds only its
declared ``inputs``; only its declared ``outputs`` are passed on.  A partition bug — a node in
no micro-graph, a missing boundary value, micro-graphs out of order — therefore shows up as an
error or a wrong number instead of being hidden by whole-graph evaluation.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import CompileError
from ..ir.graph import Graph
from ..ops.evaluate import run_nodes
from .micrograph import MicroGraph


def run_micro_graphs(graph: Graph, micro_graphs: Sequence[MicroGraph], feeds: Mapping[str, np.ndarray],
                     constants: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
    """Outputs of ``graph`` computed micro-graph by micro-graph (in the given order)."""
    env: dict[str, np.ndarray] = dict(constants if constants is not None else _constants(graph))
    env.update(feeds)
    for k, m in enumerate(micro_graphs):
        missing = [v for v in m.inputs if v not in env]
        if missing:
            raise CompileError(f"micro-graph #{k} ({m.kind}: {' '.join(m.ops)}) reads {missing}, "
                               "which no earlier micro-graph produced")
        local = {v: env[v] for v in m.inputs}
        run_nodes(m.nodes, local, graph.types)
        for o in m.outputs:
            env[o] = local[o]
    try:
        return [env[v] for v in graph.outputs]
    except KeyError as e:
        raise CompileError(f"graph output {e.args[0]!r} is produced by no micro-graph") from None


def _constants(graph: Graph) -> dict[str, np.ndarray]:
    return {n.outputs[0]: n.attrs["value"].array for n in graph.nodes if n.op == "constant"}


class MicroGraphExecutable:
    """Runs a partitioned graph micro-graph by micro-graph with the numpy references."""

    def __init__(self, graph: Graph, plan):
        self.graph = graph
        self.plan = plan
        self._constants = _constants(graph)

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return run_micro_graphs(self.graph, self.plan.micro_graphs, feeds, self._constants)
