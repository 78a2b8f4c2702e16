"""Staged execution of models with data-dependent shapes (DESIGN-facing text in the docstring).

A node whose output shape depends on input data (see :mod:`.fallback`, step 4) cannot be part
of a static primitive graph.  :func:`compile_program` then builds a :class:`StagedExecutable`:

* **head** — the primitive graph of the nodes before the split node, computing exactly the
  values the rest of the model reads; compiled once for the call's input shapes like any graph;
* **split node** — run through its onnx.reference op class on the concrete values (control-flow
  bodies compiled by apollo_py, :mod:`.control_flow`); listed in the plan as ``fallback``;
* **tail** — the remaining nodes as a new program whose inputs are the values they read, with
  the shapes just observed; lowered and compiled on first sight of those shapes and cached per
  shape, the :data:`MAX_TAILS` most recent kept (a tail may split again).  Values folded to constants in the head stay constants in the
  tail, so shape arithmetic keeps folding across the split.

The executable is itself one specialisation of the model (per input shapes) in
:class:`apollo_py.api.CompiledGraph`'s cache; its ``plan`` shows head, split node and the most
recent tail, and sums their coverage.
"""
from __future__ import annotations

import threading
from typing import Any, Mapping

import numpy as np
from cachetools import FIFOCache

from ..errors import UnsupportedOpError
from ..ir.types import DTYPES

#: run-time specialisations of the rest kept per staged executable (oldest dropped first): a
#: NonZero whose count changes on every call must not grow the cache without bound
MAX_TAILS = 32


def compile_nodes_for(name: str, names, arrays, outputs, nodes, inits, opset: int, options,
                      bad_dtype) -> Any:
    """Compile ONNX ``nodes`` as a program named ``name`` whose inputs are ``names`` with the
    shapes and dtypes of ``arrays`` (concrete run-time values); ``bad_dtype(value, dtype)`` is
    the error raised for a dtype apollo_py has no type for."""
    from .program import InputSpec
    from .onnx import OnnxProgram

    for n, a in zip(names, arrays):
        if a.dtype.name not in DTYPES:
            raise bad_dtype(n, a.dtype.name)
    specs = tuple(InputSpec(n, tuple(a.shape), a.dtype.name) for n, a in zip(names, arrays))
    program = OnnxProgram.from_parts(name, specs, tuple(outputs), nodes, inits, opset)
    return compile_program(program, {s.name: s.dims for s in specs}, options)


def compile_program(program, shapes: Mapping[str, tuple], options) -> Any:
    """An executable (``.run(feeds) -> [arrays]``, ``.plan``) of ``program`` at ``shapes``."""
    from ..compiler import compile_graph
    from ..options import Options

    options = options if options is not None else Options()
    from ..deadline import compile_deadline
    with compile_deadline(options, getattr(program, "name", "")):
        return _compile_program(program, shapes, options)


def _compile_program(program, shapes, options):
    from ..compiler import compile_graph
    from .model_cache import ModelFileProgram, load_executable, save_executable
    cached = isinstance(program, ModelFileProgram)
    if cached:      # a model file compiled before at these shapes: no pass runs again
        exe = load_executable(program, shapes, options)
        if exe is not None:
            return exe
    lower = getattr(program, "lower", None)
    if lower is None:
        return compile_graph(program.specialize(shapes), options)
    lowered = lower(shapes, options)
    if lowered.split is None:
        exe = compile_graph(lowered.graph, options)
        if cached:
            save_executable(program, shapes, options, exe)
        return exe
    return StagedExecutable(program, lowered, options)


class StagedExecutable:
    """Compiled head, one node run through onnx.reference, tail compiled per observed shapes."""

    def __init__(self, program, lowered, options):
        from ..compiler import compile_graph
        from .control_flow import embed_constant_captures, node_captures, op_instance, options_key

        self.program, self.options = program, options
        self.head = compile_graph(lowered.graph, options) if lowered.graph is not None else None
        self.head_outputs = tuple(lowered.graph.outputs) if lowered.graph is not None else ()
        self.node, self.reason = lowered.split, lowered.split_reason
        self.constants = dict(lowered.constants)
        self.rest = tuple(program.nodes[lowered.split_index + 1:])
        proto = embed_constant_captures(self.node.proto, self._constant)
        self.captures = node_captures(proto)
        self.op, self.proto = op_instance(proto.SerializeToString().hex(), "", program.opset, options_key(options))
        reads: dict[str, None] = {}
        for n in self.rest:
            for i in n.inputs:
                if i:
                    reads.setdefault(i)
            if n.proto is not None:
                for c in node_captures(n.proto):
                    reads.setdefault(c)
        self.reads = tuple(reads)
        produced = {o for n in self.rest for o in n.outputs if o}
        # outputs the rest computes come from the tail; the others straight from the values
        self.tail_outputs = tuple(o for o in program.outputs if o in produced)
        self._tails: FIFOCache = FIFOCache(MAX_TAILS)   # shapes -> compiled tail, oldest dropped first
        self.n_compiled = 0  # tail specialisations compiled so far (the cache keeps MAX_TAILS)
        self._last = None
        self._lock = threading.Lock()

    def _constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is known before run time (folded in the head, initializer)."""
        if name in self.constants:
            return self.constants[name]
        if self.head is not None and name in self.head_outputs:
            return None
        return self.program.initializers.get(name)

    def _get(self, name: str, env: Mapping[str, np.ndarray]) -> np.ndarray:
        if name in env:
            return env[name]
        if name in self.constants:
            return self.constants[name]
        if name in self.program.initializers:
            return self.program.initializers[name]
        raise UnsupportedOpError(self.node.op_type, self.node.name, f"reads {name!r}, which is not available")

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        from .control_flow import run_op

        env = dict(feeds)
        if self.head is not None:
            env.update(zip(self.head_outputs, self.head.run(feeds)))
        present = [self._get(i, env) for i in self.node.inputs if i]
        context = {c: self._get(c, env) for c in self.captures}
        outs = run_op(self.op, self.proto, present, context)
        for name, arr in zip(self.node.outputs, outs):
            if name:
                env[name] = arr
        names = [n for n in self.reads if n in env]
        arrays = [np.ascontiguousarray(env[n]) for n in names]
        if self.tail_outputs:
            env.update(zip(self.tail_outputs, self._tail(names, arrays).run(dict(zip(names, arrays)))))
        return [np.asarray(self._get(o, env)) for o in self.program.outputs]

    def _tail(self, names: list[str], arrays: list[np.ndarray]):
        key = tuple((n, a.shape, a.dtype.name) for n, a in zip(names, arrays))
        exe = self._tails.get(key)
        if exe is None:
            with self._lock:
                exe = self._tails.get(key)
                if exe is None:
                    exe = compile_nodes_for(
                        f"{self.program.name}/after {self.node.name}", names, arrays, self.tail_outputs,
                        self.rest, {**self.program.initializers, **self.constants}, self.program.opset,
                        self.options, lambda n, dt: UnsupportedOpError(
                            self.node.op_type, self.node.name,
                            f"value {n!r} has dtype {dt}, which apollo_py does not support"))
                    self._tails[key] = exe
                    self.n_compiled += 1
        self._last = exe
        return exe

    @property
    def plan(self):
        from ..plan import StagedPlan
        from .control_flow import body_plans
        return StagedPlan(bodies=tuple(body_plans(self.op)), head=self.head.plan if self.head is not None else None,
                          node=(self.node.name, self.node.op_type, self.reason),
                          tail=self._last.plan if self._last is not None else None,
                          n_tails=self.n_compiled)
