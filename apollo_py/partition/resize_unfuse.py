"""``resize2d`` back to separable matmuls, for targets without a resize2d kernel (CUDA).

The ONNX importer turns a linear / nearest Resize of NCHW's spatial axes into one ``resize2d``
node (ops/resize2d.py) whose direct kernel only the CPU target has (codegen/resize.py).  On
``cuda`` / ``cuda-emu`` such a node would run as a numpy reference step, so
:func:`unfuse_resize2d` writes it as the importer did before the kernel existed
(ops/compound_resize.py): per resized axis a product with the constant ``[in, out]`` weight
matrix (the axis moved last and back by transposes), or, for nearest, a gather of the tap's
indices.  The matrices are rebuilt from the node's constant tap tables, so the values are the
same weights the CPU kernel reads.
"""
from __future__ import annotations

import numpy as np

from ..ir.graph import Attrs, ConstArray, Graph, Node
from ..ir.optable import op_table


def unfuse_resize2d(graph: Graph) -> Graph:
    """``graph`` with every ``resize2d`` node whose tap tables are constants replaced by
    transposes, matmuls and gathers computing the same result; the graph itself when it has
    none.  Inputs, outputs and every other node stay as they are."""
    if not any(n.op == "resize2d" for n in graph.nodes):
        return graph
    consts = {n.outputs[0]: n.attrs["value"].array for n in graph.nodes if n.op == "constant"}
    types = dict(graph.types)
    table = op_table()
    nodes: list[Node] = []
    count = [0]

    def emit(op: str, inputs: tuple, attrs: dict, out: str | None = None) -> str:
        if out is None:
            count[0] += 1
            out = f"{node.outputs[0]}_sep{count[0]}"
            while out in types:
                count[0] += 1
                out = f"{node.outputs[0]}_sep{count[0]}"
        fattrs = Attrs(attrs)
        (t,) = table.infer_types(op, [types[v] for v in inputs], fattrs, node.name)
        types[out] = t
        nodes.append(Node(op, tuple(inputs), (out,), fattrs, name=node.name, source=node.source))
        return out

    def constant(arr: np.ndarray) -> str:
        return emit("constant", (), {"value": ConstArray(arr)})

    for node in graph.nodes:
        tables = node.inputs[1:]
        if node.op != "resize2d" or not all(v in consts for v in tables):
            nodes.append(node)
            continue
        x = node.inputs[0]
        taps = int(node.attrs["taps"])
        dtype = np.dtype(types[x].np_dtype)
        ty, wy, tx, wx = (consts[v] for v in tables)
        cur = x
        steps = [(2, ty, wy), (3, tx, wx)]
        for k, (axis, idx, wt) in enumerate(steps):
            n_in = types[cur].shape[axis]
            last = k == len(steps) - 1
            out = node.outputs[0] if last else None
            if taps == 1:
                cur = emit("gather", (cur, constant(np.ascontiguousarray(idx[0], np.int64))), {"axis": axis}, out)
                continue
            w = np.zeros((n_in, idx.shape[1]), dtype)       # [in, out]: the product's right operand
            for t in range(taps):
                np.add.at(w, (idx[t], np.arange(idx.shape[1])), wt[t].astype(dtype))
            if axis == 3:
                cur = emit("matmul", (cur, constant(w)), {}, out)
                continue
            perm = (0, 1, 3, 2)
            moved = emit("transpose", (cur,), {"perm": perm})
            prod = emit("matmul", (moved, constant(w)), {})
            cur = emit("transpose", (prod,), {"perm": perm}, out)
    return graph.replace(nodes=tuple(nodes), types=types)
