"""Immutable graph IR: attributes, nodes, graphs and their structural hash.

A :class:`Graph` is in SSA form: every value name is assigned once, either as a graph input or
as an output of exactly one node, and ``nodes`` is topologically ordered.  Graphs and nodes are
frozen; passes build new ones with :meth:`Graph.replace`.  The structural key of a graph is a
sha256 over ops, attributes, types and edges — node and value names do not enter it, so two
graphs that differ only in naming hash (and compare) equal.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace as dc_replace
from functools import cached_property
from typing import Any, Iterable, Mapping

import mmap

import numpy as np

from ..errors import GraphError
from .types import TensorType, dtype_name


def _immutable(array) -> bool:
    """True for a read-only, C-contiguous numpy array over an immutable ``bytes`` object or a
    read-only ``mmap`` (a model file's weights, frontend/onnx_file.py): no one can write to it
    through this process, so it need not be copied (a 500 MB model's weights, 1.5 s)."""
    if not isinstance(array, np.ndarray) or array.flags.writeable or not array.flags.c_contiguous:
        return False
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, bytes) or isinstance(base, mmap.mmap) and memoryview(base).readonly


class ConstArray:
    """An immutable numpy array usable as an attribute value (hashable by content)."""

    __slots__ = ("array", "_key")

    def __init__(self, array):
        if _immutable(array):   # e.g. an ONNX initializer decoded over its proto's bytes
            arr = array
        else:
            arr = np.array(array, copy=True)
        if arr.dtype.name not in ("float32", "float16", "float64", "int32", "int64", "bool"):
            arr = arr.astype(dtype_name(arr.dtype))
        arr.setflags(write=False)
        self.array = arr
        self._key = None

    @property
    def key(self) -> str:
        """sha256 of dtype, shape and content (computed on first use: a compile that never
        compares a model's large weights need not hash them)."""
        if self._key is None:
            arr = self.array
            h = hashlib.sha256()
            h.update(f"{arr.dtype.name}{arr.shape}".encode())
            h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data if arr.size else b"")
            self._key = h.hexdigest()[:32]
        return self._key

    @property
    def type(self) -> TensorType:
        return TensorType(self.array.shape, self.array.dtype.name)

    def _quick(self) -> tuple:
        """dtype, shape and the first and last 256 bytes: what hashing needs to tell a model's
        weight matrices apart without reading them whole (equality still compares ``key``)."""
        flat = np.ascontiguousarray(self.array).reshape(-1).view(np.uint8)
        return (self.array.dtype.name, self.array.shape, flat[:256].tobytes(), flat[-256:].tobytes())

    def __hash__(self):
        return hash(self._quick())

    def __eq__(self, other):
        return isinstance(other, ConstArray) and (other is self or (
            other.array.shape == self.array.shape and other._quick() == self._quick() and other.key == self.key))

    def __repr__(self):
        a = self.array
        if a.size <= 8:
            return f"const({a.tolist()!r}, {a.dtype.name})"
        return f"const({a.dtype.name}{list(a.shape)}#{self.key[:8]})"


def _freeze(value: Any) -> Any:
    """Turn an attribute value into a hashable one (lists -> tuples, arrays -> ConstArray)."""
    if isinstance(value, ConstArray):
        return value
    if isinstance(value, np.ndarray):
        return ConstArray(value)
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, Attrs):
        return value
    if isinstance(value, Mapping):
        return Attrs(value)
    raise GraphError(f"attribute value {value!r} of type {type(value).__name__} is not supported")


def _canon(value: Any) -> str:
    """Canonical text of an attribute value, used in structural keys."""
    if isinstance(value, ConstArray):
        return "C" + value.key
    if isinstance(value, float):
        return repr(float(value))
    if isinstance(value, tuple):
        return "(" + ",".join(_canon(v) for v in value) + ")"
    if isinstance(value, Attrs):
        return value.canonical()
    return repr(value)


class Attrs(Mapping):
    """A frozen, hashable mapping of attribute names to frozen values."""

    __slots__ = ("_items", "_dict", "_hash")

    def __init__(self, items: Mapping[str, Any] | Iterable[tuple[str, Any]] = ()):
        pairs = items.items() if isinstance(items, Mapping) else items
        frozen = tuple(sorted((str(k), _freeze(v)) for k, v in pairs))
        self._items = frozen
        self._dict = dict(frozen)
        self._hash = None

    def __getitem__(self, key):
        return self._dict[key]

    def __iter__(self):
        return iter(self._dict)

    def __len__(self):
        return len(self._items)

    def __hash__(self):
        if self._hash is None:
            self._hash = hash(self._items)
        return self._hash

    def __eq__(self, other):
        return isinstance(other, Attrs) and self._items == other._items

    def canonical(self) -> str:
        return "{" + ",".join(f"{k}={_canon(v)}" for k, v in self._items) + "}"

    def with_(self, **kw) -> "Attrs":
        d = dict(self._dict)
        d.update(kw)
        return Attrs(d)

    def __repr__(self):
        return "Attrs(" + ", ".join(f"{k}={v!r}" for k, v in self._items) + ")"


@dataclass(frozen=True)
class Node:
    """One operation: ``outputs = op(inputs; attrs)``.

    ``name`` is a human label (not part of the structural key); ``source`` names the front-end
    nodes (e.g. ONNX node names) this node was lowered from, for the plan.
    """

    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Attrs = field(default_factory=Attrs)
    name: str = ""
    source: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        if not isinstance(self.attrs, Attrs):
            object.__setattr__(self, "attrs", Attrs(self.attrs))
        object.__setattr__(self, "source", tuple(self.source))

    @property
    def label(self) -> str:
        return self.name or (self.outputs[0] if self.outputs else self.op)

    def replace(self, **kw) -> "Node":
        return dc_replace(self, **kw)


@dataclass(frozen=True, eq=False)
class Graph:
    """A typed SSA dataflow graph with named inputs and outputs.

    ``types`` maps every value name (inputs and node outputs) to its :class:`TensorType`.
    Equality and hashing are structural (names ignored); see :meth:`structural_key`.
    """

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: tuple[Node, ...]
    types: Mapping[str, TensorType]
    name: str = "graph"

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "nodes", tuple(self.nodes))
        object.__setattr__(self, "types", dict(self.types))

    def replace(self, **kw) -> "Graph":
        """A new graph with the given fields replaced (types are kept for values still named)."""
        return dc_replace(self, **kw)

    # -- lookups -------------------------------------------------------------------------
    @cached_property
    def producers(self) -> dict[str, Node]:
        """Value name -> node that produces it (graph inputs are absent)."""
        return {o: n for n in self.nodes for o in n.outputs}

    @cached_property
    def consumers(self) -> dict[str, list[Node]]:
        """Value name -> nodes that read it (in node order, a node once per value)."""
        out: dict[str, list[Node]] = {}
        for n in self.nodes:
            for v in dict.fromkeys(n.inputs):
                out.setdefault(v, []).append(n)
        return out

    def type_of(self, value: str) -> TensorType:
        try:
            return self.types[value]
        except KeyError:
            raise GraphError(f"value {value!r} has no type in graph {self.name!r}") from None

    def input_types(self) -> list[TensorType]:
        return [self.types[v] for v in self.inputs]

    def output_types(self) -> list[TensorType]:
        return [self.types[v] for v in self.outputs]

    def constant_value(self, value: str):
        """The numpy array of ``value`` if it is produced by a ``constant`` node, else None."""
        node = self.producers.get(value)
        if node is not None and node.op == "constant":
            return node.attrs["value"].array
        return None

    # -- structural identity -------------------------------------------------------------
    @cached_property
    def value_keys(self) -> dict[str, str]:
        """Value name -> structural key of the computation that produces it (names ignored)."""
        keys: dict[str, str] = {}
        for i, v in enumerate(self.inputs):
            keys[v] = _sha(f"in{i}:{self.types[v]}")
        for n in self.nodes:
            ins = ",".join(keys.get(v, "?" + v) for v in n.inputs)
            base = f"{n.op}{n.attrs.canonical()}({ins})"
            for j, o in enumerate(n.outputs):
                keys[o] = _sha(f"{base}#{j}:{self.types.get(o)}")
        return keys

    @cached_property
    def structural_key(self) -> str:
        """sha256 of inputs' types, every node's op/attrs/types/edges and the outputs."""
        vk = self.value_keys
        return _sha("graph(" + ",".join(str(self.types[v]) for v in self.inputs) + ")->"
                    + ",".join(vk[v] for v in self.outputs))

    def __hash__(self):
        return hash(self.structural_key)

    def __eq__(self, other):
        return isinstance(other, Graph) and self.structural_key == other.structural_key

    def __str__(self) -> str:
        from .printer import format_graph
        return format_graph(self)

    def __repr__(self) -> str:
        return f"<Graph {self.name!r}: {len(self.inputs)} inputs, {len(self.nodes)} nodes, {len(self.outputs)} outputs>"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
