"""Run one ONNX node through onnx.reference's op class; subgraphs (If/Loop/Scan) through apollo_py.

:func:`op_instance` builds (and caches) the onnx.reference ``OpRun`` of a node.  For a node with
graph attributes the op class is given :class:`SubgraphRunner` as its evaluator class, so the
op class keeps the control-flow semantics (which branch, how many iterations, how scan slices
and carried state move) while every body is compiled by apollo_py, recursively, with the same
Options as the enclosing model, specialised on the concrete shapes it is called with and cached
per shape (a Loop body compiles once and then runs compiled on every iteration).

Outer-scope values a body reads (lexical capture) are found by :func:`captured_names`
(recursively through nested bodies); the op class passes them in its ``context`` and the runner
feeds them to the compiled body as extra inputs.
"""
from __future__ import annotations

import dataclasses
import threading
from functools import lru_cache
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ApolloError, InputError, UnsupportedOpError

CONTROL_FLOW = ("If", "Loop", "Scan")


def options_key(options) -> tuple:
    """Options as a hashable tuple of (field, value) pairs (stored in ``onnx_op`` attributes)."""
    if options is None:
        return ()
    return tuple((f.name, getattr(options, f.name)) for f in dataclasses.fields(options))


def options_from_key(key: tuple):
    from ..options import Options
    return Options(**dict(key)) if key else Options()


def captured_names(graph) -> list[str]:
    """Names a GraphProto reads from its enclosing scopes (nested subgraphs included), in order."""
    import onnx

    known = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    known |= {t.name for t in graph.sparse_initializer}
    out: dict[str, None] = {}

    def need(name):
        if name and name not in known:
            out.setdefault(name)

    for node in graph.node:
        for i in node.input:
            need(i)
        for a in node.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                for c in captured_names(a.g):
                    need(c)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    for c in captured_names(g):
                        need(c)
        known.update(o for o in node.output if o)
    for o in graph.output:
        need(o.name)
    return list(out)


def node_captures(node) -> list[str]:
    """Outer-scope names read by the subgraphs of NodeProto ``node`` (empty for plain ops)."""
    import onnx

    out: dict[str, None] = {}
    for a in node.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for g in graphs:
            for c in captured_names(g):
                out.setdefault(c)
    return list(out)


#: outer constants up to this many elements are copied into the bodies that capture them
EMBED_LIMIT = 4096


def embed_constant_captures(node, lookup, limit: int = EMBED_LIMIT):
    """A copy of NodeProto ``node`` whose subgraphs hold, as initializers, the captured outer
    values that ``lookup(name)`` knows as constants (arrays of at most ``limit`` elements).

    A body then sees shape operands (axes, target shapes, indices) from the enclosing graph as
    constants and folds them, as the enclosing graph would; larger constants (weights) stay
    captures, passed in at run time.  Returns ``node`` itself when nothing is embedded."""
    import onnx
    from onnx import numpy_helper

    embed = {}
    for c in node_captures(node):
        arr = lookup(c)
        if arr is not None and np.asarray(arr).size <= limit:
            embed[c] = np.asarray(arr)
    if not embed:
        return node
    out = onnx.NodeProto()
    out.CopyFrom(node)
    for a in out.attribute:
        graphs = [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)
        for g in graphs:
            for c in captured_names(g):
                if c in embed:
                    g.initializer.append(numpy_helper.from_array(embed[c], c))
    return out


_MAX_BODY_SPECIALIZATIONS = 32


class SubgraphRunner:
    """Stands in for onnx.reference's evaluator of a subgraph; runs it compiled by apollo_py.

    Constructed by the op class like ``ReferenceEvaluator(graph, opsets=..., ...)``;
    ``run(None, feeds)`` takes the body inputs and the captured outer values from ``feeds`` and
    returns the body outputs as a list.  One compiled specialisation per input shapes/dtypes.
    """

    def __init__(self, graph, opsets=None, verbose=0, new_ops=None, functions=None, *,
                 options=None, opset: int = 0):
        from .onnx import onnx_nodes, _tensor_array

        self.graph = graph
        self.obj = SimpleNamespace(graph=graph)  # onnx.reference reads .obj.graph in error paths
        self.input_names = [i.name for i in graph.input]
        self.output_names = [o.name for o in graph.output]
        self.captures = [c for c in captured_names(graph) if c not in self.input_names]
        self.has_linked_attribute = False
        self.options = options
        self.opset = int(opset or (opsets or {}).get("", 0) or 0)
        self._nodes = onnx_nodes(graph)
        self._inits = {t.name: _tensor_array(t, f"subgraph {graph.name!r} initializer") for t in graph.initializer}
        from cachetools import LRUCache
        # bounded like CompiledGraph's: a loop body fed ever new shapes keeps the latest few
        self._cache: LRUCache = LRUCache(_MAX_BODY_SPECIALIZATIONS)
        self._lock = threading.Lock()
        self.last_plan = None

    def _executable(self, names: list[str], arrays: list[np.ndarray]):
        from .staged import compile_nodes_for

        key = tuple((a.shape, a.dtype.name) for a in arrays)
        with self._lock:        # LRUCache reorders on get: only under the lock
            exe = self._cache.get(key)
        if exe is None:
            with self._lock:
                exe = self._cache.get(key)
                if exe is None:
                    exe = compile_nodes_for(
                        self.graph.name or "body", names, arrays, self.output_names, self._nodes,
                        self._inits, self.opset, self.options, lambda n, dt: InputError(
                            f"subgraph {self.graph.name!r}: value {n!r} has dtype {dt}, which "
                            "apollo_py does not support"))
                    self._cache[key] = exe
        self.last_plan = exe.plan
        return exe

    def run(self, output_names, feeds: Mapping[str, Any], attributes=None, **_kw) -> list:
        names = self.input_names + self.captures
        missing = [n for n in names if n not in feeds or feeds[n] is None]
        if missing:
            raise InputError(f"subgraph {self.graph.name!r} needs {missing}, which the enclosing "
                             "graph does not provide")
        arrays = [np.asarray(feeds[n]) for n in names]
        exe = self._executable(names, arrays)
        outs = list(exe.run(dict(zip(names, arrays))))
        if output_names is not None:
            by_name = dict(zip(self.output_names, outs))
            return [by_name[n] for n in output_names]
        return outs


@lru_cache(maxsize=512)
def op_instance(node_hex: str, domain: str, opset: int, options: tuple = ()):
    """(OpRun instance, NodeProto) for a serialised node; bodies run through SubgraphRunner."""
    import onnx
    from onnx.reference.ops import load_op

    node = onnx.NodeProto()
    node.ParseFromString(bytes.fromhex(node_hex))
    try:
        cls = load_op(domain, node.op_type, opset)
    except (RuntimeError, ValueError, KeyError) as e:     # what load_op raises for "no such op"
        raise UnsupportedOpError(node.op_type, node.name, f"no lowering and no onnx.reference "
                                 f"implementation ({type(e).__name__})") from None
    opts = options_from_key(options)

    def evaluator(graph, opsets=None, verbose=0, new_ops=None, functions=None):
        return SubgraphRunner(graph, opsets, verbose, new_ops, functions, options=opts, opset=opset)

    if node.op_type == "Loop" and domain in ("", "ai.onnx"):
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        if body is None:
            raise UnsupportedOpError("Loop", node.name, "the Loop has no body attribute")
        return LoopOp(node, evaluator(body)), node

    if node.op_type == "Scan" and domain in ("", "ai.onnx") and opset < 9:
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        if body is None:
            raise UnsupportedOpError("Scan", node.name, "the Scan has no body attribute")
        return Scan8Op(node, evaluator(body)), node

    run_params = {"log": lambda *a: None, "opsets": {domain: opset, "": opset}, "verbose": 0,
                  "new_ops": None, "existing_functions": {}, "evaluator_cls": evaluator}
    return cls(node, run_params), node


def run_op(op, node, present: Sequence[np.ndarray], context: Mapping[str, np.ndarray]) -> list:
    """Run OpRun ``op`` of NodeProto ``node`` on its present inputs (absent ones become None).

    ``context`` holds the captured outer-scope values of a control-flow node.  An absent Loop
    condition means "true" (onnx.reference would treat None as false and never iterate).
    """
    it = iter(present)
    args = [next(it) if name else None for name in node.input]
    kw = {"context": dict(context)} if op.need_context() else {}
    try:
        outs = op.run(*args, **kw)
    except ApolloError:
        raise
    except Exception as e:
        root = e  # OpRun.run re-wraps errors from bodies as TypeError: report the original
        while root.__cause__ is not None and not isinstance(root, ApolloError):
            root = root.__cause__
        if isinstance(root, ApolloError):
            raise root from None
        text = str(root).strip().splitlines()[0] if str(root).strip() else ""
        raise UnsupportedOpError(node.op_type, node.name, f"onnx.reference failed: {type(root).__name__}: "
                                 f"{text}") from e
    for k, o in enumerate(outs):
        if not isinstance(o, np.ndarray) and not np.isscalar(o):
            raise UnsupportedOpError(node.op_type, node.name, f"output {k} is a {type(o).__name__} (an ONNX "
                                     "sequence, map or optional), which apollo_py does not support")
    return [np.asarray(o) for o in outs]


class LoopOp:
    """ONNX Loop with the spec's semantics, its body run by a :class:`SubgraphRunner`.

    Written here rather than taken from onnx.reference, whose Loop concatenates the scan outputs
    of each iteration (``np.vstack``) instead of stacking them along a new first axis.
    Absent ``M`` / ``cond`` mean "no trip limit" / "true"; a Loop that runs no iteration
    returns empty scan outputs when the body declares their shapes, and refuses otherwise.
    """

    def __init__(self, node, body: SubgraphRunner):
        self.onnx_node, self.body = node, body
        self.attributes_names_ = ("body",)

    def need_context(self) -> bool:
        return True

    def run(self, m, cond, *initial, context=None):
        body, node = self.body, self.onnx_node
        n_state = len(initial)
        n_scan = len(body.output_names) - 1 - n_state
        trips = None if m is None else int(np.asarray(m).reshape(-1)[0])
        keep = True if cond is None else bool(np.asarray(cond).reshape(-1)[0])
        feeds = dict(context or {})
        state, scans, it = list(initial), [[] for _ in range(n_scan)], 0
        names = body.input_names
        while keep and (trips is None or it < trips):
            feeds[names[0]] = np.array(it, np.int64)
            feeds[names[1]] = np.array(keep)
            feeds.update(zip(names[2:], state))
            outs = body.run(None, feeds)
            keep = bool(np.asarray(outs[0]).reshape(-1)[0])
            state = [np.asarray(o) for o in outs[1:1 + n_state]]
            for k in range(n_scan):
                scans[k].append(np.asarray(outs[1 + n_state + k]))
            it += 1
        stacked = []
        for k, parts in enumerate(scans):
            if parts:
                stacked.append(np.stack(parts))
                continue
            stacked.append(self._empty_scan(body.graph.output[1 + n_state + k]))
        return tuple(state + stacked)

    def _empty_scan(self, vi):
        from onnx import helper
        tt = vi.type.tensor_type
        if not tt.HasField("shape") or not all(d.HasField("dim_value") for d in tt.shape.dim):
            raise UnsupportedOpError("Loop", self.onnx_node.name, f"the Loop ran no iteration and its body "
                                     f"does not declare the shape of scan output {vi.name!r}")
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        return np.zeros((0,) + tuple(d.dim_value for d in tt.shape.dim), dtype)


class Scan8Op:
    """ONNX Scan of opsets 8 (batched: every input has a leading batch axis, scan inputs scan
    their axis 1, an optional ``sequence_lens`` gives each batch entry's length), its body run
    by a :class:`SubgraphRunner`.  onnx.reference implements only the opset-9 form.  Scan
    outputs past a batch entry's length are zero, as in onnxruntime."""

    def __init__(self, node, body: SubgraphRunner):
        self.onnx_node, self.body = node, body
        self.attributes_names_ = ("body",)
        attrs = {a.name: a for a in node.attribute}
        self.num_scan_inputs = int(attrs["num_scan_inputs"].i)
        self.directions = list(attrs["directions"].ints) if "directions" in attrs else []

    def need_context(self) -> bool:
        return True

    def run(self, sequence_lens, *inputs, context=None):
        body, node = self.body, self.onnx_node
        n_scan = self.num_scan_inputs
        states, xs = [np.asarray(a) for a in inputs[:len(inputs) - n_scan]], \
            [np.asarray(a) for a in inputs[len(inputs) - n_scan:]]
        if not xs:
            raise UnsupportedOpError("Scan", node.name, "a Scan needs at least one scan input")
        batch, max_len = xs[0].shape[0], xs[0].shape[1]
        lens = [max_len] * batch if sequence_lens is None else [int(v) for v in np.asarray(sequence_lens).reshape(-1)]
        if len(lens) != batch or any(not 0 <= n <= max_len for n in lens):
            raise UnsupportedOpError("Scan", node.name, f"sequence_lens {lens} do not fit batch {batch} "
                                     f"and length {max_len}")
        directions = self.directions or [0] * n_scan
        names, n_state = body.input_names, len(states)
        feeds = dict(context or {})
        finals, scans = [], []
        for b in range(batch):
            state = [s[b] for s in states]
            outs_b = []
            for t in range(lens[b]):
                feeds.update(zip(names[:n_state], state))
                for k, x in enumerate(xs):
                    feeds[names[n_state + k]] = x[b, lens[b] - 1 - t if directions[k] else t]
                outs = body.run(None, feeds)
                state = [np.asarray(o) for o in outs[:n_state]]
                outs_b.append([np.asarray(o) for o in outs[n_state:]])
            finals.append(state)
            scans.append(outs_b)
        n_out = len(body.output_names) - n_state
        final = [np.stack([finals[b][k] for b in range(batch)]) for k in range(n_state)]
        stacked = []
        for k in range(n_out):
            proto = next((scans[b][0][k] for b in range(batch) if scans[b]), None)
            if proto is None:
                raise UnsupportedOpError("Scan", node.name, "every sequence is empty: scan output shapes unknown")
            out = np.zeros((batch, max_len) + proto.shape, proto.dtype)
            for b in range(batch):
                for t, o in enumerate(scans[b]):
                    out[b, t] = o[k]
            stacked.append(out)
        return tuple(final + stacked)


def body_plans(op) -> list[tuple[str, Any]]:
    """(attribute name, plan of its latest compiled specialisation) per subgraph of OpRun ``op``;
    bodies not run yet are left out."""
    out = []
    for name in sorted(getattr(op, "attributes_names_", ())):
        runner = getattr(op, name, None)
        if isinstance(runner, SubgraphRunner) and runner.last_plan is not None:
            out.append((name, runner.last_plan))
    return out
