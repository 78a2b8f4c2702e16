"""MicroGraph: one unit of the partition, handed to layer 1 as one fusion group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..ir.graph import Graph, Node
from .signature import pattern_signature


@dataclass(frozen=True)
class MicroGraph:
    """An immutable set of primitives that layer 1 fuses into one loop nest.

    ``nodes`` are in topological (canonical) order and ``classes`` gives each one's primitive
    class; ``kind`` is the micro-graph's class (the result class of the last rule that merged
    it, or its single primitive's class); ``rules`` the ids of the rules applied, in order.
    ``inputs`` are values read but not produced inside (graph inputs, constants, other
    micro-graphs' outputs); ``outputs`` are values produced inside and used outside or returned
    by the graph.  ``cluster`` numbers the cluster it belongs to (-1 for a fallback op).
    """

    nodes: tuple[Node, ...]
    classes: tuple[str, ...]
    kind: str
    rules: tuple[str, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    cluster: int = 0
    signature: str = ""

    @staticmethod
    def build(graph: Graph, nodes: list[Node], classes: list[str], kind: str, rules: list[str],
              cluster: int) -> "MicroGraph":
        """The micro-graph of ``nodes`` (in topological order) inside ``graph``: computes its
        boundary values and signature."""
        produced = {o for n in nodes for o in n.outputs}
        members = {id(n) for n in nodes}
        inputs = list(dict.fromkeys(v for n in nodes for v in n.inputs if v not in produced))
        graph_outs = set(graph.outputs)
        cons = graph.consumers
        outputs = [o for n in nodes for o in n.outputs
                   if o in graph_outs or any(id(c) not in members for c in cons.get(o, ()))]
        return MicroGraph(tuple(nodes), tuple(classes), kind, tuple(rules), tuple(inputs), tuple(outputs),
                          cluster, pattern_signature(nodes, classes))

    @property
    def ops(self) -> tuple[str, ...]:
        """Op names of the nodes, in topological order."""
        return tuple(n.op for n in self.nodes)

    @property
    def source_nodes(self) -> tuple[str, ...]:
        """Sorted unique front-end (e.g. ONNX) node names the primitives came from."""
        return tuple(sorted({s for n in self.nodes for s in n.source}))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "rules": list(self.rules), "ops": list(self.ops),
                "classes": list(self.classes), "inputs": list(self.inputs), "outputs": list(self.outputs),
                "sources": list(self.source_nodes), "cluster": self.cluster, "signature": self.signature}

    def __repr__(self) -> str:
        return f"MicroGraph({self.kind}, rules={list(self.rules)}, ops={list(self.ops)})"
