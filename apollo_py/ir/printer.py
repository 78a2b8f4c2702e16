"""Text form of a graph, for debugging and ``str(graph)``."""
from __future__ import annotations


def format_graph(graph) -> str:
    """Render ``graph`` as one line per node: ``outs = op[attrs](ins)  : types``."""
    lines = [f"graph {graph.name}(" + ", ".join(f"{v}: {graph.types[v]}" for v in graph.inputs) + ")"]
    for n in graph.nodes:
        attrs = ", ".join(f"{k}={v!r}" for k, v in n.attrs.items())
        outs = ", ".join(n.outputs)
        types = ", ".join(str(graph.types.get(o)) for o in n.outputs)
        lines.append(f"  {outs} = {n.op}[{attrs}]({', '.join(n.inputs)})  : {types}")
    lines.append("  return " + ", ".join(graph.outputs))
    return "\n".join(lines)
