"""What every front end produces: a :class:`Program` (a model with input specs).

A :class:`Program` is a model whose input shapes may still be symbolic; ``specialize`` returns
the primitive :class:`~apollo_py.ir.Graph` for concrete input shapes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from ..errors import InputError
from ..ir.graph import Graph


@dataclass(frozen=True)
class InputSpec:
    """A model input: name, dims (int, or str/None for a symbolic dim) and dtype name."""

    name: str
    dims: tuple
    dtype: str

    def matches(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.dims) and all(
            not isinstance(d, int) or d == s for d, s in zip(self.dims, shape))

    def describe(self) -> str:
        return f"{self.dtype}[{','.join('?' if d is None else str(d) for d in self.dims)}]"


class Program:
    """Base class of front-end results: ``inputs``, ``outputs``, ``name`` and ``specialize``.

    A program may also offer ``lower(shapes, options)`` (as the ONNX program does): then
    :func:`apollo_py.frontend.staged.compile_program` can run models whose shapes depend on
    data in stages instead of requiring one static graph."""

    name: str = "model"
    inputs: tuple[InputSpec, ...] = ()
    outputs: tuple[str, ...] = ()

    def specialize(self, shapes: Mapping[str, tuple[int, ...]]) -> Graph:
        raise NotImplementedError


class GraphProgram(Program):
    """A builder graph: all shapes are static, ``specialize`` returns the graph itself."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.name = graph.name
        self.inputs = tuple(InputSpec(v, graph.types[v].shape, graph.types[v].dtype) for v in graph.inputs)
        self.outputs = graph.outputs

    def specialize(self, shapes):
        for spec in self.inputs:
            if tuple(shapes[spec.name]) != spec.dims:
                raise InputError(f"input {spec.name!r} has shape {tuple(shapes[spec.name])}, "
                                 f"expected {spec.describe()}")
        return self.graph

