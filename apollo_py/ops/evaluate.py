"""Reference execution: run a graph node by node through the numpy references (the oracle)."""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ..errors import ApolloError, CompileError
from ..ir.graph import Graph, Node
from .registry import get_op


def _describe(n: Node) -> str:
    """"node 'gather_52' (gather, from ONNX node '/emb/Gather')": the primitive and the model's
    node it was lowered from (the name a user can find in the model)."""
    src = f", from ONNX node {n.source[0]!r}" if n.source and n.source[0] else ""
    return f"node {n.label!r} ({n.op}{src})"


def run_nodes(nodes: Sequence[Node], env: dict[str, np.ndarray], types) -> None:
    """Evaluate ``nodes`` in order, reading and writing values in ``env`` (mutated in place)."""
    for n in nodes:
        opdef = get_op(n.op, n.label)
        args = [env[v] for v in n.inputs]
        try:
            outs = opdef.reference(args, n.attrs)
        except ApolloError as e:
            raise type(e)(f"{_describe(n)}: {e}") from None
        except Exception as e:  # a reference that fails on valid input is a library bug
            raise CompileError(f"{_describe(n)}: reference failed: {type(e).__name__}: {e}") from e
        for o, r in zip(n.outputs, outs):
            t = types[o]
            r = np.asarray(r)
            if r.dtype != t.np_dtype:
                r = r.astype(t.np_dtype)
            if r.shape != t.shape:
                raise CompileError(f"{_describe(n)} produced shape {r.shape}, expected {t.shape}")
            env[o] = r


def evaluate(graph: Graph, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Outputs of ``graph`` for input arrays ``feeds`` (name -> array, already validated)."""
    env = dict(feeds)
    run_nodes(graph.nodes, env, graph.types)
    return [env[v] for v in graph.outputs]
