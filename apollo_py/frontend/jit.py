"""``ap.jit`` on Python functions: trace once per signature, compile, run.

:class:`JittedFunction` binds a call's arguments, flattens them as pytrees (tuples, lists,
dicts, None; arrays are leaves), and keys its cache on the *signature*: the tree structure, each
array leaf's shape and dtype, the static arguments (``static_argnames`` / ``static_argnums``) and
any Python scalars (which are baked into the trace as constants, like static arguments).  A new
signature traces the function with :class:`~.trace.Tracer` leaves into a primitive graph and
compiles it as a :class:`~apollo_py.api.CompiledGraph` (so the piecewise memory and disk cache
serve it: a second process compiles from the disk cache); a known one goes straight to the
compiled graph.  ``trace_count`` counts traces.

Numpy arrays a function closes over are recorded as constants at trace time (as jax.jit does):
changing such an array later does not retrace.
"""
from __future__ import annotations

import functools
import inspect
import threading
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import InputError, TraceError
from ..ir.graph import Graph
from ..ir.types import DTYPES
from . import trace_numpy  # noqa: F401  (fills trace.RULES: tracers follow numpy)
from .trace import TraceContext, Tracer, current, output_values


# -- pytrees --------------------------------------------------------------------------------------

class _Leaf:
    """Marker of an array leaf in a tree definition."""

    __slots__ = ()

    def __repr__(self):
        return "*"


LEAF = _Leaf()


def is_array_leaf(x) -> bool:
    return isinstance(x, (np.ndarray, np.generic, Tracer))


def flatten(tree, path: str = "") -> tuple[list, list[str], Any]:
    """(array leaves, their paths, hashable tree definition).  Python scalars, None and strings
    are part of the definition (static), not leaves."""
    leaves: list = []
    paths: list[str] = []
    treedef = _flatten(tree, path, leaves, paths)
    return leaves, paths, treedef


# module-level recursion, not a nested self-referencing closure: such a closure is a reference
# cycle that kept a call's output arrays alive until the cyclic GC ran, so the runtime's
# output pool could not reuse them (softmax [768,128,128]: 82 ms a call against 6 ms)
def _flatten(x, p, leaves, paths):
    if is_array_leaf(x):
        leaves.append(x)
        paths.append(p or "arg")
        return LEAF
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return ("namedtuple", type(x), tuple(_flatten(v, f"{p}.{f}", leaves, paths) for f, v in zip(x._fields, x)))
    if isinstance(x, (tuple, list)):
        return (type(x).__name__, tuple(_flatten(v, f"{p}[{k}]", leaves, paths) for k, v in enumerate(x)))
    if isinstance(x, dict):
        keys = sorted(x, key=repr)
        return ("dict", tuple(keys), tuple(_flatten(x[k], f"{p}.{k}" if p else str(k), leaves, paths)
                                           for k in keys))
    if x is None or isinstance(x, (bool, int, float, str, np.dtype, type)):
        return ("static", type(x).__name__, x)
    raise InputError(f"argument {p or 'arg'!r}: a {type(x).__name__} is neither an array nor a "
                     "tuple/list/dict of arrays; mark the argument static (static_argnames) "
                     "if it is a setting")


def unflatten(treedef, leaves) -> Any:
    """The tree of ``treedef`` with its array leaves taken from ``leaves`` in order."""
    return _unflatten(treedef, iter(leaves))


def _unflatten(d, it):
    if d is LEAF:
        return next(it)
    kind = d[0]
    if kind == "static":
        return d[2]
    if kind == "namedtuple":
        return d[1](*(_unflatten(c, it) for c in d[2]))
    if kind == "dict":
        return {k: _unflatten(c, it) for k, c in zip(d[1], d[2])}
    items = [_unflatten(c, it) for c in d[1]]
    return tuple(items) if kind == "tuple" else items


def leaf_spec(x) -> tuple:
    if isinstance(x, Tracer):
        return (x.shape, x.dtype.name)
    a = np.asarray(x)
    if a.dtype.name not in DTYPES:
        raise InputError(f"array of dtype {a.dtype} is not supported (supported: {', '.join(DTYPES)})")
    return (tuple(a.shape), a.dtype.name)


# -- tracing a function -----------------------------------------------------------------------

class Traced:
    """One traced signature: the primitive graph and the tree of its outputs."""

    def __init__(self, graph: Graph, out_tree, in_names: list[str]):
        self.graph, self.out_tree, self.in_names = graph, out_tree, in_names
        self.compiled = None


def _safe_name(path: str, used: set) -> str:
    name = path.replace(" ", "_") or "arg"
    base, k = name, 1
    while name in used:
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    return name


def trace_to_graph(fn: Callable, args: tuple, kwargs: dict, name: str, options=None,
                   paths: Sequence[str] | None = None) -> tuple[Graph, Any, list[str]]:
    """Trace ``fn(*args, **kwargs)``, whose array leaves become graph inputs, into a Graph.

    Returns (graph, output tree definition, input names).  Output leaves that are inputs, repeat
    another output, or are constants get a copy node so that every output is its own value.
    """
    leaves, lpaths, treedef = flatten((args, kwargs))
    names = list(paths) if paths is not None else lpaths
    used: set = set()
    with TraceContext(name, options) as ctx:
        ins = []
        for leaf, p in zip(leaves, names):
            shape, dtype = leaf_spec(leaf)
            ins.append(ctx.input(_safe_name(p, used), shape, dtype))
        a, kw = unflatten(treedef, ins)
        out = fn(*a, **kw)
        out_leaves, _, out_tree = flatten(out, "out")
        if any(isinstance(o, Tracer) and o._ctx is not ctx and not ctx._encloses(o._ctx) for o in out_leaves):
            raise TraceError(f"{name}: the function returned a tracer of another trace")
        vals = output_values(ctx, out_leaves)
        if ctx.captures:  # only child traces capture; a top-level trace has no parent
            raise TraceError(f"{name}: the function used tracers of an enclosing trace")
        graph = ctx.b.build(vals, name=name)
    return graph, out_tree, [graph.inputs[k] for k in range(len(leaves))]


def fn_name(fn) -> str:
    """A readable name for a function, a functools.partial or a callable object."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


class JittedFunction:
    """``ap.jit(fn)``: call it like ``fn``; numpy arrays in, numpy arrays out.

    Attributes: ``trace_count`` (traces so far), ``plan`` (plan of the latest signature),
    :meth:`lower` (the primitive Graph for some arguments), :meth:`explain`, :meth:`to_onnx`.
    Called inside another trace (nested jit, grad, cond), it inlines ``fn``.
    """

    def __init__(self, fn: Callable, options, static_argnames: Sequence[str] = (),
                 static_argnums: Sequence[int] = (), make_compiled: Callable | None = None):
        self.fn = fn
        # (graph, options) -> a callable compiled graph; passed in by ``apollo_py.api.jit`` (the
        # front end sits below the API floor and does not import it); None: trace/export only
        self._make_compiled = make_compiled
        self.name = fn_name(fn)
        self.options = options
        self._sig = inspect.signature(fn)
        params = list(self._sig.parameters)
        names = set(static_argnames or ())
        for i in static_argnums or ():
            if not 0 <= i < len(params):
                raise InputError(f"static_argnums {i} is out of range for {self.name}{self._sig}")
            names.add(params[i])
        unknown = names - set(params)
        if unknown and not any(p.kind == p.VAR_KEYWORD for p in self._sig.parameters.values()):
            raise InputError(f"static_argnames {sorted(unknown)} are not parameters of "
                             f"{self.name}{self._sig}")
        self.static_argnames = frozenset(names)
        self.trace_count = 0
        self._cache: dict[Any, Traced] = {}
        self._last: Traced | None = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn, updated=())

    def _split(self, args, kwargs):
        """(static arguments, dynamic arguments), each name -> value, defaults applied."""
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError as e:
            raise InputError(f"{self.name}: {e}") from None
        bound.apply_defaults()
        static, dynamic = {}, {}
        for k, v in bound.arguments.items():
            if k in self.static_argnames:
                try:
                    hash(v)
                except TypeError:
                    raise InputError(f"{self.name}: static argument {k!r} must be hashable, "
                                     f"got {type(v).__name__}") from None
                static[k] = v
            else:
                dynamic[k] = v
        return static, dynamic

    def _call_fn(self, static, dynamic):
        """Call ``fn`` with the arguments split by :meth:`_split` recombined."""
        bound = self._sig.bind_partial()
        merged = {**dynamic, **static}
        bound.arguments.update((k, merged[k]) for k in self._sig.parameters if k in merged)
        return self.fn(*bound.args, **bound.kwargs)

    def _traced(self, args, kwargs) -> tuple[Traced, list]:
        static, dynamic = self._split(args, kwargs)
        leaves, paths, subtrees = [], [], []
        for k, v in dynamic.items():  # signature order, so that graph inputs follow it
            ls, ps, t = flatten(v, k)
            leaves += ls
            paths += ps
            subtrees.append(t)
        treedef = ("dict", tuple(dynamic), tuple(subtrees))
        key = (treedef, tuple(leaf_spec(x) for x in leaves), tuple(sorted(static.items(), key=repr)))
        tr = self._cache.get(key)
        if tr is None:
            with self._lock:
                tr = self._cache.get(key)
                if tr is None:
                    def body(*ls):
                        return self._call_fn(static, unflatten(treedef, ls))
                    graph, out_tree, names = trace_to_graph(body, tuple(leaves), {}, self.name,
                                                            self.options, paths)
                    tr = Traced(graph, out_tree, names)
                    self.trace_count += 1
                    self._cache[key] = tr
        self._last = tr
        return tr, leaves

    def __call__(self, *args, **kwargs):
        if current() is not None:
            return self.fn(*args, **kwargs)  # inside another trace: inline
        tr, leaves = self._traced(args, kwargs)
        self._compile(tr)
        arrays = [np.asarray(x) for x in leaves]  # run() makes them contiguous (0-d stays 0-d)
        outs = tr.compiled.run(*arrays)
        return unflatten(tr.out_tree, outs)

    def _compile(self, tr: Traced):
        if tr.compiled is None:
            if self._make_compiled is None:
                raise InputError(f"{self.name}: this traced function was made for export only; "
                                 "use apollo_py.jit to run it")
            tr.compiled = self._make_compiled(tr.graph, self.options)
        return tr.compiled

    def lower(self, *args, **kwargs) -> Graph:
        """The primitive graph traced for these arguments (traced now if new; not compiled)."""
        return self._traced(args, kwargs)[0].graph

    @property
    def plan(self):
        """The fusion plan of the most recently called signature."""
        if self._last is None or self._last.compiled is None:
            raise InputError(f"{self.name}: call the function once (or use explain(*args)) "
                             "to see a plan")
        return self._last.compiled.plan

    def explain(self, *args, **kwargs):
        """The plan (micro-graphs, kernels, what fused and why not) for these arguments, or of
        the latest call when none are given."""
        if args or kwargs:
            tr, _ = self._traced(args, kwargs)
            return self._compile(tr).plan
        return self.plan

    def to_onnx(self, *args, **kwargs):
        """The traced graph for these arguments as an ``onnx.ModelProto`` (see ap.export)."""
        from .export import to_onnx
        tr = self._traced(args, kwargs)[0]
        n = len(tr.graph.outputs)
        _, paths, _ = flatten(unflatten(tr.out_tree, [np.zeros(())] * n), "out")
        return to_onnx(tr.graph, name=self.name, output_names=paths)

    def __repr__(self):
        return f"<apollo_py.jit {self.name}{self._sig}: {len(self._cache)} signatures>"


def export(fn, *example_args, **example_kwargs):
    """``fn`` as an ``onnx.ModelProto`` of standard ops (:mod:`.export`): a Python function
    (traced on the example arguments), an ``ap.jit`` function or a CompiledGraph (anything with
    ``to_onnx``), or a Graph.  Inputs are named after the arguments (``params.w1`` for a dict
    entry); outputs ``out``, ``out[0]``..."""
    from .export import to_onnx
    if isinstance(fn, Graph):
        return to_onnx(fn)
    if hasattr(fn, "to_onnx"):
        return fn.to_onnx(*example_args, **example_kwargs)
    if callable(fn):
        return JittedFunction(fn, None).to_onnx(*example_args, **example_kwargs)
    raise InputError(f"export: expected a function, a CompiledGraph or a Graph, got {type(fn).__name__}")
