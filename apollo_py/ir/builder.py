"""GraphBuilder: build typed graphs of primitives from Python.

    b = GraphBuilder("mlp")
    x = b.input("x", (8, 16))
    w = b.constant(np.ones((16, 4), np.float32))
    y = b.relu(b.matmul(x, w) + 1.0)
    g = b.build([y])

Every primitive of the op table (:mod:`.optable`, filled by ``apollo_py.ops``) is a method
(``b.add``, ``b.reduce_sum(x, axes=(1,))``...), made on first use; each call checks shapes at
once and returns a typed :class:`Value`.  Python scalars given as
operands become constants of the other operand's dtype.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..errors import GraphError, ShapeError
from .graph import Attrs, ConstArray, Graph, Node
from .optable import op_table
from .types import TensorType
from .verify import verify


class Value:
    """A typed value in a graph under construction (supports + - * / @ and unary -)."""

    __slots__ = ("builder", "name", "type")

    def __init__(self, builder: "GraphBuilder", name: str, type: TensorType):
        self.builder, self.name, self.type = builder, name, type

    @property
    def shape(self):
        return self.type.shape

    @property
    def dtype(self):
        return self.type.dtype

    def __add__(self, o): return self.builder.add(self, o)
    def __radd__(self, o): return self.builder.add(o, self)
    def __sub__(self, o): return self.builder.sub(self, o)
    def __rsub__(self, o): return self.builder.sub(o, self)
    def __mul__(self, o): return self.builder.mul(self, o)
    def __rmul__(self, o): return self.builder.mul(o, self)
    def __truediv__(self, o): return self.builder.div(self, o)
    def __rtruediv__(self, o): return self.builder.div(o, self)
    def __matmul__(self, o): return self.builder.matmul(self, o)
    def __neg__(self): return self.builder.neg(self)
    def __pow__(self, o): return self.builder.pow(self, o)

    def __repr__(self):
        return f"Value({self.name}: {self.type})"


class GraphBuilder:
    """Accumulates nodes; :meth:`build` returns a verified immutable :class:`Graph`."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self._inputs: list[str] = []
        self._nodes: list[Node] = []
        self._types: dict[str, TensorType] = {}
        self._counter = 0
        self._source: tuple[str, ...] = ()

    # -- naming / provenance -------------------------------------------------------------
    def fresh(self, hint: str = "v") -> str:
        while True:
            self._counter += 1
            name = f"{hint}_{self._counter}"
            if name not in self._types:
                return name

    def set_source(self, *names: str) -> None:
        """Record that the nodes added from now on come from these front-end nodes."""
        self._source = tuple(n for n in names if n)

    # -- leaves --------------------------------------------------------------------------
    def input(self, name: str, shape: Sequence[int], dtype: str = "float32") -> Value:
        if name in self._types:
            raise GraphError(f"value name {name!r} is already defined")
        t = TensorType(tuple(shape), dtype)
        self._inputs.append(name)
        self._types[name] = t
        return Value(self, name, t)

    def constant(self, value, dtype: str | None = None, name: str | None = None) -> Value:
        arr = np.asarray(value, dtype=dtype) if dtype else np.asarray(value)
        if arr.dtype == np.float64 and dtype is None and not isinstance(value, np.ndarray):
            arr = arr.astype(np.float32)
        return self.op("constant", value=ConstArray(arr), name=name)[0]

    def _coerce(self, x: Any, like: Value | None) -> Value:
        if isinstance(x, Value):
            if x.builder is not self:
                raise GraphError(f"value {x.name!r} belongs to another builder")
            return x
        dtype = like.dtype if like is not None else None
        return self.constant(np.asarray(x, dtype=dtype) if dtype else x)

    # -- generic op ----------------------------------------------------------------------
    def op(self, op: str, *inputs: Any, name: str | None = None, outputs: Sequence[str] | None = None,
           **attrs) -> list[Value]:
        """Append primitive ``op`` and return its output values."""
        table = op_table()
        label = name or ""
        attrs = table.normalize_attrs(op, attrs, label)
        like = next((x for x in inputs if isinstance(x, Value)), None)
        vals = [self._coerce(x, like) for x in inputs]
        fattrs = Attrs(attrs)
        out_types = table.infer_types(op, [v.type for v in vals], fattrs, label)
        if outputs is None:
            outs = [name if (name and k == 0 and name not in self._types) else self.fresh(op)
                    for k in range(len(out_types))]
        else:
            outs = list(outputs)
            for o in outs:
                if o in self._types:
                    raise GraphError(f"value name {o!r} is already defined")
        node = Node(op, tuple(v.name for v in vals), tuple(outs), fattrs, name=label, source=self._source)
        self._nodes.append(node)
        for o, t in zip(outs, out_types):
            self._types[o] = t
        return [Value(self, o, t) for o, t in zip(outs, out_types)]

    def value(self, name: str) -> Value:
        try:
            return Value(self, name, self._types[name])
        except KeyError:
            raise GraphError(f"no value named {name!r}") from None

    def build(self, outputs: Sequence[Value | str], name: str | None = None) -> Graph:
        """Return the verified graph with ``outputs`` in order."""
        outs = [o.name if isinstance(o, Value) else o for o in outputs]
        g = Graph(tuple(self._inputs), tuple(outs), tuple(self._nodes), dict(self._types), name or self.name)
        verify(g)
        return g

    def __getattr__(self, attr: str):
        # Op methods are made on first use from the op table, which ``ir`` cannot import
        # (ops sits above it), and kept on the class, so later calls are plain methods.
        if attr.startswith("__"):
            raise AttributeError(attr)
        opname = _ALIASES.get(attr, attr)
        table = op_table()
        if opname == "constant" or not table.has(opname):
            raise AttributeError(f"GraphBuilder has no op or attribute {attr!r}")
        method = _make_method(opname, table.doc(opname))
        setattr(GraphBuilder, attr, method)
        return getattr(self, attr)

    def __dir__(self):
        ops = {n for n in op_table().names() if n != "constant"}
        return sorted(set(super().__dir__()) | ops | set(_ALIASES))


#: friendlier names for some ops
_ALIASES = {"select": "where", "logical_and": "and", "logical_or": "or", "logical_not": "not",
            "logical_xor": "xor"}


def _make_method(opname: str, doc: str):
    def method(self, *inputs, name: str | None = None, **attrs):
        return self.op(opname, *inputs, name=name, **attrs)[0]

    method.__name__ = opname
    method.__doc__ = doc
    return method
