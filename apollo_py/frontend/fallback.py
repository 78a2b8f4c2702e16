"""Nodes without a lowering: run through onnx.reference, folded, or split off at run time.

Called by :meth:`apollo_py.frontend.onnx.Lowering.run` for a standard-domain node that has no
converter, or whose converter refused it (UnsupportedOpError, e.g. an operand that is not known
at compile time).  In order:

1. **If with a constant condition** is inlined: the taken branch's nodes are lowered in place
   (they see the enclosing values directly), so nothing of it remains at run time.
2. **All inputs constant** (including the outer values a subgraph captures) and the op is not
   a random generator (:data:`NOT_FOLDABLE`): the node is evaluated now through its
   onnx.reference op class and its outputs become constants (constant folding; NonZero, TopK,
   Unique of constants included).
3. **Static output types**: ONNX shape inference (with data propagation, given the concrete
   input shapes and the constant operands) fixes every output's shape and dtype; the node
   becomes one ``onnx_op`` primitive (FALLBACK kind): it splits clusters, runs as its own step
   between compiled pieces and is listed in the plan as ``fallback`` with ``reason``.
   For an If that inference cannot type, both branches are lowered (not compiled) for the
   concrete captured types; if they agree, those are the output types.
4. **Data-dependent output shape** (NonZero, TopK with a runtime k, Reshape to a runtime shape,
   If whose branches disagree, Loop with scan outputs, ...): :class:`DataDependent` is raised.
   The program lowering catches it and *splits* there: the nodes before it form a compiled
   head; at run time the node runs through onnx.reference on concrete values, and the nodes
   after it are lowered and compiled for the concrete shapes they then see, cached per shape
   (:mod:`.staged`).  A split tail may split again.

Only a node with neither a converter nor an onnx.reference implementation at the model's
opset is refused (UnsupportedOpError naming node and op, raised at load by
:func:`check_supported`).
"""
from __future__ import annotations

import numpy as np

from ..errors import ApolloError, ShapeError, UnsupportedOpError
from ..ir.types import TensorType
from .onnx_op import has_reference
from .control_flow import embed_constant_captures, node_captures, op_instance, options_key, run_op


#: ops whose outputs must not be computed once at compile time even when all inputs are constant
NOT_FOLDABLE = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                          "Bernoulli", "Multinomial"})


class DataDependent(Exception):
    """Internal signal: a node's output shape depends on input data (``reason`` says how)."""

    def __init__(self, node: str, reason: str):
        super().__init__(f"node {node!r}: {reason}")
        self.node, self.reason = node, reason


def check_supported(node, opset: int) -> None:
    """UnsupportedOpError unless ``node`` (and every node of its subgraphs) can run at all:
    standard domain, and a converter or an onnx.reference op class at ``opset``."""
    from .onnx_ops import CONVERTERS

    if node.domain not in ("", "ai.onnx"):
        raise UnsupportedOpError(node.op_type, node.name, f"domain {node.domain!r} is not supported")
    if node.op_type not in CONVERTERS and not has_reference(node.op_type, "", opset):
        raise UnsupportedOpError(node.op_type, node.name, "no apollo_py lowering and no onnx.reference "
                                 f"implementation at opset {opset}")
    for g in _subgraphs(node.proto):
        from .onnx import onnx_nodes
        for sub in onnx_nodes(g):
            check_supported(sub, opset)


def _subgraphs(proto) -> list:
    if proto is None:
        return []
    import onnx
    out = []
    for a in proto.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def _reason(err: UnsupportedOpError) -> str:
    text = str(err)
    marker = f"has unsupported op type {err.op_type!r}: "
    return text.split(marker, 1)[1] if marker in text else text


def lower_fallback(cx, err: UnsupportedOpError) -> list:
    """Outputs of ``cx.node`` by constant folding, an ``onnx_op`` node, or DataDependent."""
    node, lowering, b = cx.node, cx.lowering, cx.b
    reason = _reason(err)
    if not has_reference(node.op_type, "", lowering.opset):
        raise UnsupportedOpError(node.op_type, node.name, f"{reason}; onnx.reference has no implementation "
                                 f"at opset {lowering.opset} either")
    if node.op_type == "If":
        cond = b.const_value(cx.need(0))
        if cond is not None:
            return _inline_branch(cx, bool(np.asarray(cond).reshape(-1)[0]))
    proto = _named_outputs(node)
    if _subgraphs(proto):
        def lookup(name):
            return b.const_value(lowering.value(name, f"{node.describe()} (captured by a subgraph)"))
        proto = embed_constant_captures(proto, lookup)
    captures = node_captures(proto)
    present = [cx.need(i) for i in range(cx.n_in) if cx.has(i)]
    values = present + [lowering.value(c, f"{node.describe()} (captured by a subgraph)") for c in captures]
    opts = options_key(lowering.options) if _subgraphs(proto) else ()
    node_hex = proto.SerializeToString().hex()
    consts = [b.const_value(v) for v in values]
    if all(c is not None for c in consts) and node.op_type not in NOT_FOLDABLE:
        op, _ = op_instance(node_hex, "", lowering.opset, opts)
        outs = run_op(op, proto, consts[:len(present)], dict(zip(captures, consts[len(present):])))
        return [b.constant(_supported(np.asarray(o), node, k)) if k < len(outs) else None
                for k, o in enumerate(outs[:len(node.outputs)])]
    types = infer_output_types(proto, values, captures, present, consts, lowering.opset)
    if types is None and node.op_type == "If":
        types = _if_types(proto, node, dict(zip(captures, values[len(present):])), lowering)
    if types is None:
        raise DataDependent(node.name, f"the output shape of {node.op_type} depends on input data")
    outs = b.op("onnx_op", *values, node=node_hex, domain="", opset=lowering.opset, op_type=node.op_type,
                out_types=tuple((t.shape, t.dtype) for t in types), reason=reason,
                captures=tuple(captures), options=opts)
    outs = outs if isinstance(outs, (list, tuple)) else [outs]
    return [v if name else None for v, name in zip(outs, node.outputs)]


def _supported(arr: np.ndarray, node, k: int) -> np.ndarray:
    from .onnx import onnx_dtype_of_array
    try:
        onnx_dtype_of_array(arr, f"{node.describe()} output {k}")
    except ShapeError as e:
        raise UnsupportedOpError(node.op_type, node.name, str(e)) from None
    return arr


def _named_outputs(node):
    """The node's proto with unnamed optional outputs before the last named one given names."""
    import onnx

    proto = onnx.NodeProto()
    proto.CopyFrom(node.proto)
    last = max((k for k, o in enumerate(proto.output) if o), default=-1)
    del proto.output[last + 1:]
    for k in range(last):
        if not proto.output[k]:
            proto.output[k] = f"{node.name}__unused_output_{k}"
    if not proto.name:
        proto.name = node.name
    return proto


def infer_output_types(proto, values, captures, present, consts, opset: int) -> list[TensorType] | None:
    """Static output types of NodeProto ``proto`` by ONNX shape inference, or None when some
    output dim is not known (data dependent).  ``values`` are the node's present inputs then
    its captures (apollo Values); ``consts`` their arrays where known at compile time."""
    import onnx
    from onnx import helper, numpy_helper

    from .onnx import onnx_dtype

    names = [n for n in proto.input if n] + list(captures)
    inputs, inits, seen = [], [], set()
    for name, v, c in zip(names, values, consts):
        if name in seen:
            continue
        seen.add(name)
        if c is not None:
            inits.append(numpy_helper.from_array(np.asarray(c), name))
        else:
            elem = helper.np_dtype_to_tensor_dtype(np.dtype(v.type.dtype))
            inputs.append(helper.make_tensor_value_info(name, elem, list(v.type.shape)))
    graph = helper.make_graph([proto], "fallback", inputs, [], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False,
                                                     data_prop=True)
    except Exception:  # inference gives up on some valid graphs: treat the shape as unknown
        return None
    known = {vi.name: vi for vi in inferred.graph.value_info}
    out = []
    for k, name in enumerate(proto.output):
        vi = known.get(name)
        if vi is None or not vi.type.HasField("tensor_type"):
            return None
        tt = vi.type.tensor_type
        if not tt.HasField("shape") or not all(d.HasField("dim_value") for d in tt.shape.dim):
            return None
        try:
            dtype = onnx_dtype(tt.elem_type, f"node {proto.name!r} output {k}")
        except ApolloError as e:
            raise UnsupportedOpError(proto.op_type, proto.name, str(e)) from None
        out.append(TensorType(tuple(int(d.dim_value) for d in tt.shape.dim), dtype))
    return out


def _if_types(proto, node, captured: dict, lowering) -> list[TensorType] | None:
    """Output types of an If whose condition is known only at run time, when ONNX shape
    inference could not tell: lower both branches for the captured values' concrete types
    (lowering only, nothing is compiled) and keep the types if the branches agree."""
    from .program import InputSpec
    from .control_flow import captured_names
    from .onnx import OnnxProgram, _tensor_array, onnx_nodes

    found = []
    branches = {a.name: a.g for a in proto.attribute}
    for attr in ("then_branch", "else_branch"):
        g = branches[attr]
        names = captured_names(g)
        specs = tuple(InputSpec(n, tuple(captured[n].type.shape), captured[n].type.dtype) for n in names)
        inits = {t.name: _tensor_array(t, f"{node.describe()} {attr} initializer") for t in g.initializer}
        prog = OnnxProgram.from_parts(g.name or attr, specs, tuple(o.name for o in g.output), onnx_nodes(g),
                                      inits, lowering.opset)
        try:
            lowered = prog.lower({s.name: s.dims for s in specs}, lowering.options)
        except ApolloError:
            return None
        if lowered.split is not None:
            return None
        found.append([lowered.graph.types[o] for o in lowered.graph.outputs])
    return found[0] if found[0] == found[1] else None


def _inline_branch(cx, cond: bool) -> list:
    """Lower the taken branch of an If whose condition is constant, in place."""
    from .onnx import _tensor_array, onnx_nodes

    node, lowering = cx.node, cx.lowering
    branch = node.attrs["then_branch" if cond else "else_branch"]
    if branch.initializer:
        lowering.initializers = {**lowering.initializers,
                                 **{t.name: _tensor_array(t, f"{node.describe()} branch initializer")
                                    for t in branch.initializer}}
    for sub in onnx_nodes(branch):
        lowering.run(sub)
    lowering.b.set_source(node.name)
    return [lowering.value(o.name, f"{node.describe()} branch output") for o in branch.output]
