"""When may a graph output be written straight into one of the graph's input arrays?

A training step returns ``W_new = W - lr * dW`` and the caller wants ``W`` updated: writing
``W_new`` into ``W``'s own array saves a full copy per parameter per step (and, for a BLAS
update ``W += alpha * A @ B``, the copy of ``W`` into a fresh output first).  It is safe when

* the output is written directly by one kernel or BLAS step (the runtime binds its buffer),
  has the input's shape and dtype, and is not also another output or an input;
* every other step reading the input runs in an earlier dispatch (layer 3 may run
  independent kernels of one dispatch concurrently);
* the writing step reads the input only where it writes the same element: a BLAS step whose
  accumulator is the input (and not an operand), or a kernel whose nodes are all elementwise or
  broadcast with outputs of the output's shape, in which every node reading the input is an
  ancestor of the output (so each element is read before it is overwritten).

:func:`inplace_reason` returns "" when these hold, else the first one that fails.
"""
from __future__ import annotations

from ..ops.classify import BROADCAST, ELEMENTWISE, classify
from .blas import BlasStep


def _writer_kernel_ok(step, output: str, source: str, types) -> str:
    nodes = [n for n in step.fused.nodes if n.op != "constant"]
    shape = types[output].shape
    for n in nodes:
        cls = classify(n.op, tuple(types[v] for v in n.inputs), tuple(types[v] for v in n.outputs), n.attrs)
        if cls not in (ELEMENTWISE, BROADCAST):
            return f"kernel {step.compiled.name} has a {cls} node ({n.op})"
        if any(types[v].shape != shape for v in n.outputs):
            return f"kernel {step.compiled.name} computes values of other shapes"
    import networkx as nx
    producer = {o: k for k, n in enumerate(nodes) for o in n.outputs}
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(nodes)))
    dag.add_edges_from((producer[v], k) for k, n in enumerate(nodes) for v in n.inputs if v in producer)
    writer = producer.get(output)
    upstream = nx.ancestors(dag, writer) | {writer} if writer is not None else set()
    if any(source in n.inputs and k not in upstream for k, n in enumerate(nodes)):
        return f"kernel {step.compiled.name} reads {source!r} for another output"
    return ""


def inplace_reason(exe, output: str, source: str) -> str:
    """Why ``exe`` (a CpuExecutable) cannot write graph output ``output`` into the array of
    graph input ``source`` ("" when it can)."""
    g = exe.graph
    types = g.types
    if source not in g.inputs or output not in g.outputs or source in g.outputs:
        return f"{output!r} is not a graph output or {source!r} not a graph input"
    if list(g.outputs).count(output) != 1 or output in g.inputs:
        return f"{output!r} is returned twice or is an input"
    if types[output].shape != types[source].shape or types[output].dtype != types[source].dtype:
        return f"{output!r} and {source!r} differ in shape or dtype"
    if output not in exe._fresh:
        return f"{output!r} is not written directly by a kernel or BLAS step"
    writer_at, writer = None, None
    for k, (kind, item) in enumerate(exe._schedule):
        for s in (item if kind == "kernels" else [item]):
            if output in s.outputs:
                writer_at, writer = k, s
    if writer is None:
        return f"no step writes {output!r}"
    views = {source} | {v for v, r in getattr(exe, "_root", {}).items() if r == source}   # reshapes of it
    for k, (kind, item) in enumerate(exe._schedule):
        for s in (item if kind == "kernels" else [item]):
            if s is not writer and views & set(s.inputs) and k >= writer_at:
                return f"{source!r} is read after (or alongside) the step writing {output!r}"
    if isinstance(writer, BlasStep):
        desc = writer.desc
        if desc.acc != source or views & {desc.a, desc.b}:
            return f"the BLAS step writing {output!r} reads {source!r} as an operand"
        return ""
    if getattr(writer, "fused", None) is not None:
        if (views - {source}) & set(writer.inputs):
            return f"the kernel writing {output!r} reads a reshape of {source!r}"
        return _writer_kernel_ok(writer, output, source, types)
    return f"the step writing {output!r} is not a kernel or a BLAS call"
