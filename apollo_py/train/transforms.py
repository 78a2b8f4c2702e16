"""``ap.grad`` / ``ap.value_and_grad`` over traced Python functions.

``value_and_grad(f, argnums)(*args)`` traces ``f`` into a child trace (its own graph; tracers of
the enclosing trace that ``f`` closes over become captured inputs), differentiates that graph
with the reverse-mode autodiff of :mod:`.autodiff`, and replays forward + backward into the
enclosing trace, so ``ap.jit(ap.value_and_grad(loss))`` compiles forward and backward as ONE
graph.  Called outside any trace, the transformed function jits itself (one compiled graph per
signature) and returns numpy arrays.

``ap.grad(graph, wrt)`` on a :class:`~apollo_py.ir.Graph` keeps its graph-level meaning
(:func:`apollo_py.train.autodiff.grad`).
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import numpy as np

from ..errors import InputError, TraceError
from ..ir.graph import Graph
from .autodiff import grad as graph_grad
from .graphs import replay


def _argnums(argnums, n: int) -> tuple[int, ...]:
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    for a in nums:
        if not -n <= a < n:
            raise InputError(f"argnums {a} is out of range for {n} positional arguments")
    return tuple(a % n for a in nums)


class ValueAndGrad:
    """``f`` transformed to return ``(value, grads)`` (or ``((value, aux), grads)``)."""

    def __init__(self, fn: Callable, argnums=0, has_aux: bool = False, value: bool = True):
        from ..frontend.jit import fn_name
        self.fn, self.argnums, self.has_aux, self.value = fn, argnums, has_aux, value
        self.name = fn_name(fn)
        self._jitted = None
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        from ..frontend.trace import current
        if current() is None:
            if self._jitted is None:
                from ..api import jit
                self._jitted = jit(self)
            return self._jitted(*args, **kwargs)
        return self._traced(args, kwargs)

    def _traced(self, args, kwargs):
        from ..frontend.jit import flatten, trace_to_graph, unflatten
        from ..frontend.trace import Tracer, current, to_value, user_frame

        outer = current()
        nums = _argnums(self.argnums, len(args))
        leaves, _, treedef = flatten((args, kwargs))
        # which leaves are differentiated: those inside the argnums arguments
        diff = []
        for k, a in enumerate(args):
            n = len(flatten(a)[0])
            diff.extend([k in nums] * n)
        diff.extend([False] * (len(leaves) - len(diff)))
        for leaf, d in zip(leaves, diff):
            if d and np.dtype(leaf.dtype).kind != "f":
                raise InputError(f"{self.name}: cannot differentiate with respect to an array "
                                 f"of dtype {np.dtype(leaf.dtype).name}; only float arrays")

        def body(*ls):
            a, kw = unflatten(treedef, ls)
            return self.fn(*a, **kw)

        from ..frontend.trace import TraceContext
        sub = TraceContext(f"{self.name}_vjp", parent=outer)
        graph, out_tree, names = _trace_child(sub, body, leaves)
        outs = graph.outputs
        if self.has_aux:
            if not (isinstance(out_tree, tuple) and out_tree[0] == "tuple" and len(out_tree[1]) == 2):
                raise TraceError(f"{self.name}: has_aux=True needs the function to return a "
                                 "(loss, aux) pair")
            loss_tree, aux_tree = out_tree[1]
        else:
            loss_tree, aux_tree = out_tree, None
        if loss_tree is not _leaf() or graph.types[outs[0]].shape != ():
            raise TraceError(f"{user_frame()}: grad of {self.name}: the function must return a "
                             "scalar (shape ()) float array" + (" as the first of (loss, aux)"
                                                                if self.has_aux else ""))
        if graph.types[outs[0]].dtype not in ("float16", "float32", "float64"):
            raise TraceError(f"grad of {self.name}: the loss has dtype "
                             f"{graph.types[outs[0]].dtype}, not a float")
        wrt = [n for n, d in zip(names, diff) if d]
        g = graph_grad(graph, wrt, loss=0)
        env = {}
        for n, leaf in zip(names, leaves):
            env[n] = to_value(outer, leaf)
        for (t, v) in sub.captures.values():
            env[v.name] = outer.value_of(t)
        vals = replay(outer.b, g, env, strip_stop_gradient=True)
        res = [outer.wrap(vals[o]) for o in g.outputs]
        n_out = len(outs)
        fwd, grads = res[:n_out], res[n_out:]
        value = unflatten(out_tree, fwd)
        grad_leaves = iter(grads)
        per_arg = []
        for k in nums:
            lv, _, td = flatten(args[k])
            per_arg.append(unflatten(td, [next(grad_leaves) for _ in lv]))
        g_out = per_arg[0] if isinstance(self.argnums, int) else tuple(per_arg)
        return (value, g_out) if self.value else (g_out if not self.has_aux else (g_out, value[1]))


def _leaf():
    from ..frontend.jit import LEAF
    return LEAF


def _trace_child(ctx, body, leaves):
    """Trace ``body`` on fresh inputs shaped like ``leaves`` in child context ``ctx``; the
    captures of ``ctx`` are the extra inputs.  Returns (graph, output tree, leaf input names)."""
    from ..frontend.jit import flatten, leaf_spec
    from ..frontend.trace import output_values
    with ctx:
        ins = [ctx.input(f"in{k}", *leaf_spec(x)) for k, x in enumerate(leaves)]
        out = body(*ins)
        out_leaves, _, out_tree = flatten(out, "out")
        graph = ctx.b.build(output_values(ctx, out_leaves, copy_constants=False), name=ctx.name)
    return graph, out_tree, [f"in{k}" for k in range(len(leaves))]


def value_and_grad(fn: Callable, argnums: int | Sequence[int] = 0, has_aux: bool = False):
    """``fn`` -> a function returning ``(fn(*args), d fn / d args[argnums])``.

    ``fn`` must return a float scalar (or ``(scalar, aux)`` with ``has_aux``); the gradient has
    the structure of the differentiated argument (a tuple of them for a sequence of argnums).
    """
    return ValueAndGrad(fn, argnums, has_aux, value=True)


def grad(fn, *args, argnums: int | Sequence[int] = 0, has_aux: bool = False, **kwargs):
    """``grad(fn)``: the gradient function of a traced scalar function (see value_and_grad);
    ``grad(graph, wrt, loss=None)``: the graph-level gradient of :func:`apollo_py.train.autodiff.grad`.
    """
    if isinstance(fn, Graph):
        return graph_grad(fn, *args, **kwargs)
    if args or kwargs:
        raise InputError("grad(fn, argnums=..., has_aux=...): other arguments are for grad(graph, wrt)")
    if not callable(fn):
        raise InputError(f"grad: expected a function or a Graph, got {type(fn).__name__}")
    return ValueAndGrad(fn, argnums, has_aux, value=False)
