"""The fusion plan: what the compiler made of a graph, for users and for tests.

``Plan.graph`` is the primitive graph after preprocessing; the partition stage fills
``micro_graphs`` and later stages ``kernels``.  ``str(plan)`` is a readable table,
``plan.to_json()`` a JSON document.  :func:`explain` returns the plan of a model without
running it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .ir.graph import Graph


@dataclass(frozen=True)
class Plan:
    """Compile result summary: primitive graph, micro-graphs and kernels (as they exist)."""

    graph: Graph
    micro_graphs: tuple = ()
    kernels: tuple = ()
    notes: tuple[str, ...] = field(default=())

    @property
    def primitives(self) -> list[dict[str, Any]]:
        """One entry per primitive node: op, outputs, and the source nodes it came from."""
        return [{"op": n.op, "outputs": list(n.outputs), "source": list(n.source)} for n in self.graph.nodes]

    def to_json(self) -> str:
        doc = {"graph": self.graph.name, "primitives": self.primitives,
               "micro_graphs": [m.to_dict() for m in self.micro_graphs],
               "kernels": [k.to_dict() for k in self.kernels], "notes": list(self.notes)}
        return json.dumps(doc, indent=1)

    def micro_graph_table(self) -> str:
        """One row per micro-graph: index, kind, rules applied, ops, ``<- source nodes``."""
        rows = [("#", "kind", "rules", "ops <- sources")]
        for k, m in enumerate(self.micro_graphs):
            src = f"  <- {', '.join(m.source_nodes)}" if m.source_nodes else ""
            rows.append((str(k), m.kind, ",".join(m.rules) or "-", " ".join(m.ops) + src))
        w = [max(len(r[c]) for r in rows) for c in range(3)]
        return "\n".join(f"  {r[0]:>{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows)

    def __str__(self) -> str:
        lines = [f"plan for {self.graph.name!r}: {len(self.graph.nodes)} primitives"]
        if self.micro_graphs:
            lines.append(f"{len(self.micro_graphs)} micro-graphs:")
            lines.append(self.micro_graph_table())
        else:
            for n in self.graph.nodes:
                src = f"  <- {', '.join(n.source)}" if n.source else ""
                lines.append(f"  {n.op:<14} {', '.join(n.outputs)}{src}")
        if self.kernels:
            n_gen = sum(1 for k in self.kernels if getattr(k, "fused", None) is not None)
            lines.append(f"{len(self.kernels)} steps ({n_gen} generated kernels, "
                         f"{len(self.kernels) - n_gen} numpy steps):")
            lines.extend(f"  {k:>2}  {step.describe()}" for k, step in enumerate(self.kernels))
        lines.extend(f"note: {s}" for s in self.notes)
        return "\n".join(lines)


def explain(model: Any, options: Any = None, input_shapes: Any = None) -> Plan:
    """The fusion plan of ``model`` (ONNX path/bytes/ModelProto, Graph) without running it.

    Symbolic input dims need ``input_shapes``; the plan carries ``micro_graphs``."""
    from .api import jit
    return jit(model, options=options, input_shapes=input_shapes).plan
