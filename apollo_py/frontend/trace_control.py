"""Traced control flow: ``ap.cond`` and ``ap.fori_loop`` as ONNX If / Loop nodes.

A branch or loop body is traced into its own graph (a child :class:`~.trace.TraceContext`;
outer tracers it reads become captures), written as an ONNX subgraph (:mod:`.export`), and the
node is recorded as an ``onnx_op`` primitive, the path ONNX models' If and Loop already take:
at run time onnx.reference's control-flow semantics drive bodies that apollo_py compiles and
caches per shape (:mod:`.control_flow`).  With a concrete predicate or outside a trace, ``cond``
simply calls the chosen branch and ``fori_loop`` runs a Python loop.
"""
from __future__ import annotations

import numpy as np

from ..errors import TraceError
from . import trace_numpy  # noqa: F401  (fills trace.RULES)
from .trace import TraceContext, Tracer, current, output_values, to_value, user_frame

OPSET = 17


def where(condition, x, y):
    """``np.where(condition, x, y)`` (traced or eager)."""
    return np.where(condition, x, y)


def stop_gradient(x):
    """``x``, through which ``ap.grad`` passes no gradient."""
    if not isinstance(x, Tracer):
        return x
    ctx = current()
    return ctx.wrap(ctx.b.op("stop_gradient", ctx.value_of(x))[0])


def _child_graph(ctx, name, fn, in_specs):
    """Trace ``fn(*inputs)`` (inputs of ``in_specs``: (name, shape, dtype)) in a child of ``ctx``.
    Returns (graph, output tree, child context)."""
    from .jit import flatten
    sub = TraceContext(name, parent=ctx)
    with sub:
        ins = [sub.input(n, s, d) for n, s, d in in_specs]
        out = fn(*ins)
        leaves, _, tree = flatten(out, "out")
        graph = sub.b.build(output_values(sub, leaves), name=name)
    return graph, tree, sub


def _record(ctx, proto, present, captures, out_types, reason):
    from ..options import Options
    from .control_flow import options_key
    names = tuple(n for n, _ in captures)
    vals = list(present) + [v for _, v in captures]
    outs = ctx.b.op("onnx_op", *vals, node=proto.SerializeToString().hex(), domain="", opset=OPSET,
                    op_type=proto.op_type, out_types=tuple(out_types), reason=reason, captures=names,
                    options=options_key(ctx.options or Options()))
    return [ctx.wrap(v) for v in outs]


def cond(pred, true_fn, false_fn, *operands):
    """``true_fn(*operands)`` if ``pred`` else ``false_fn(*operands)``.

    With a traced ``pred`` (a scalar that depends on the inputs) both branches are traced and
    must return the same structure of arrays with equal shapes and dtypes; the choice is made at
    run time (an ONNX If).  Otherwise the chosen branch is simply called.
    """
    if not isinstance(pred, Tracer):
        return true_fn(*operands) if bool(np.asarray(pred)) else false_fn(*operands)
    from onnx import helper
    from .export import graph_proto
    from .jit import flatten, leaf_spec, unflatten
    ctx = current()
    if pred.size != 1:
        raise TraceError(f"{user_frame()}: ap.cond needs a scalar predicate, got shape {pred.shape}")
    leaves, _, td = flatten(operands)
    tag = ctx.b.fresh("cond")
    specs = [(f"{tag}.op{j}", *leaf_spec(x)) for j, x in enumerate(leaves)]
    branches = []
    for side, fn in (("then", true_fn), ("else", false_fn)):
        g, tree, sub = _child_graph(ctx, f"{tag}_{side}", lambda *ls, fn=fn: fn(*unflatten(td, ls)), specs)
        branches.append((g, tree, sub))
    (gt, tt, st), (gf, tf, sf) = branches
    sig_t = [(gt.types[o].shape, gt.types[o].dtype) for o in gt.outputs]
    sig_f = [(gf.types[o].shape, gf.types[o].dtype) for o in gf.outputs]
    if tt != tf or sig_t != sig_f:
        raise TraceError(f"{user_frame()}: ap.cond branches must return the same structure, shapes "
                         f"and dtypes; true_fn gives {sig_t}, false_fn {sig_f}")
    captures = [(s[0], to_value(ctx, x)) for s, x in zip(specs, leaves)]
    protos = []
    for side, (g, _, sub) in zip(("then", "else"), branches):
        ren = {s[0]: s[0] for s in specs}
        for k, (t, v) in enumerate(sub.captures.values()):
            outer_name = f"{tag}.{side}.cap{k}"
            ren[v.name] = outer_name
            captures.append((outer_name, ctx.value_of(t)))
        protos.append(graph_proto(g, prefix=f"{tag}.{side}/", input_names=ren, name=f"{tag}_{side}"))
    p = ctx.value_of(pred)
    if p.dtype != "bool":
        p = ctx.b.ne(p, ctx.b.constant(np.zeros((), np.dtype(p.dtype))))
    if p.shape != ():
        p = ctx.b.reshape(p, shape=())
    node = helper.make_node("If", ["cond"], [f"out{k}" for k in range(len(gt.outputs))],
                            then_branch=protos[0], else_branch=protos[1])
    outs = _record(ctx, node, [p], captures, sig_t, "ap.cond on a traced predicate")
    return unflatten(tt, outs)


def fori_loop(lower, upper, body_fun, init_val):
    """``val = body_fun(i, val)`` for ``i`` in ``range(lower, upper)``; returns the final ``val``.

    Inside a trace the body is traced once and runs as an ONNX Loop (bounds may be traced
    scalars); ``body_fun`` must return the structure, shapes and dtypes of ``init_val``.
    Outside a trace it is a plain Python loop.
    """
    if current() is None:
        val = init_val
        for i in range(int(lower), int(upper)):
            val = body_fun(i, val)
        return val
    from onnx import helper
    from .export import graph_proto
    from .jit import flatten, leaf_spec, unflatten
    ctx = current()
    leaves, _, td = flatten(init_val)
    tag = ctx.b.fresh("loop")
    specs = [(f"{tag}.i", (), "int64"), (f"{tag}.c", (), "bool")]
    specs += [(f"{tag}.s{j}", *leaf_spec(x)) for j, x in enumerate(leaves)]

    def body(it, c, *state):
        i = it + lower if not isinstance(lower, Tracer) else it + lower.astype(np.int64)
        new = body_fun(i, unflatten(td, state))
        new_leaves, _, new_td = flatten(new)
        if new_td != td:
            raise TraceError(f"{user_frame()}: ap.fori_loop's body must return the structure of "
                             "init_val")
        # i is an int64 array, so numpy promotes float32 state + i to float64: cast back
        # where numpy's same_kind rule allows it (jax's weakly typed loop index has the same effect)
        fixed = []
        for v, x in zip(new_leaves, state):
            if isinstance(v, Tracer) and v.dtype != x.dtype and np.can_cast(v.dtype, x.dtype, "same_kind"):
                v = v.astype(x.dtype)
            fixed.append(v)
        return (c, *fixed)

    g, _, sub = _child_graph(ctx, f"{tag}_body", body, specs)
    want = [(s[1], s[2]) for s in specs[2:]]
    got = [(g.types[o].shape, g.types[o].dtype) for o in g.outputs[1:]]
    if got != [(tuple(s), d) for s, d in want]:
        raise TraceError(f"{user_frame()}: ap.fori_loop's body returns {got}, init_val is {want}: "
                         "the loop state must keep its shapes and dtypes")
    ren, captures = {}, []
    for k, (t, v) in enumerate(sub.captures.values()):
        ren[v.name] = f"{tag}.cap{k}"
        captures.append((f"{tag}.cap{k}", ctx.value_of(t)))
    proto = graph_proto(g, prefix=f"{tag}/", input_names=ren, name=f"{tag}_body")
    trips = np.subtract(upper, lower)
    m = to_value(ctx, trips.astype(np.int64) if isinstance(trips, Tracer) else np.asarray(max(int(trips), 0), np.int64))
    if m.dtype != "int64":
        m = ctx.b.cast(m, to="int64")
    init = [to_value(ctx, x) for x in leaves]
    node = helper.make_node("Loop", ["m", ""] + [f"s{j}" for j in range(len(init))],
                            [f"o{j}" for j in range(len(init))], body=proto)
    outs = _record(ctx, node, [m] + init, captures, [(tuple(s), d) for s, d in want],
                   "ap.fori_loop")
    return unflatten(td, outs)

