"""The fusion plan: what the compiler made of a graph, for users and for tests.

``Plan.graph`` is the primitive graph after the front end; later stages fill ``micro_graphs``
and ``kernels``.  ``str(plan)`` is a readable table, ``plan.to_json()`` a JSON document.
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

    def __str__(self) -> str:
        lines = [f"plan for {self.graph.name!r}: {len(self.graph.nodes)} primitives"]
        for n in self.graph.nodes:
            src = f"  <- {', '.join(n.source)}" if n.source else ""
            lines.append(f"  {n.op:<14} {', '.join(n.outputs)}{src}")
        lines.extend(f"note: {s}" for s in self.notes)
        return "\n".join(lines)
