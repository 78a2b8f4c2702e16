"""User entry points: ``jit`` and the callable :class:`CompiledGraph`."""
from __future__ import annotations

import threading
from typing import Any, Mapping

import numpy as np

from .errors import InputError
from .frontend import GraphProgram, Program
from .ir.graph import Graph
from .ir.types import DTYPES
from .options import Options


def load_program(model: Any, input_shapes: Mapping[str, tuple] | None = None) -> Program:
    """Turn a model (ONNX path/bytes/ModelProto, Graph, or Program) into a Program."""
    if isinstance(model, Program):
        return model
    if isinstance(model, Graph):
        return GraphProgram(model)
    from .frontend.onnx import load_onnx
    return load_onnx(model)


class CompiledGraph:
    """A compiled model: call it with numpy arrays (by name or position), get numpy outputs.

    Shapes are specialised on first use: a call with new input shapes compiles (and caches) a
    new specialisation.  Safe to call from several threads.
    """

    def __init__(self, program: Program, options: Options, input_shapes: Mapping[str, tuple] | None = None):
        self.program = program
        self.options = options
        self._specs = {s.name: s for s in program.inputs}
        self._pinned = {k: tuple(v) for k, v in (input_shapes or {}).items()}
        for k in self._pinned:
            if k not in self._specs:
                raise InputError(f"input_shapes names {k!r}, which is not an input; inputs are "
                                 f"{list(self._specs)}")
        self._cache: dict[tuple, Any] = {}
        self._lock = threading.Lock()

    @property
    def input_names(self) -> list[str]:
        return [s.name for s in self.program.inputs]

    @property
    def output_names(self) -> list[str]:
        return list(self.program.outputs)

    def _bind(self, args, kwargs) -> dict[str, np.ndarray]:
        names = self.input_names
        if len(args) > len(names):
            raise InputError(f"{self.program.name}: got {len(args)} positional inputs, the model takes "
                             f"{len(names)} ({', '.join(names)})")
        feeds = dict(zip(names, args))
        for k, v in kwargs.items():
            if k not in self._specs:
                raise InputError(f"{self.program.name}: unknown input {k!r}; inputs are {names}")
            if k in feeds:
                raise InputError(f"input {k!r} given both by position and by name")
            feeds[k] = v
        missing = [n for n in names if n not in feeds]
        if missing:
            raise InputError(f"{self.program.name}: missing input(s) {missing}; inputs are {names}")
        out = {}
        for name in names:
            spec = self._specs[name]
            arr = feeds[name]
            if not isinstance(arr, np.ndarray):
                if isinstance(arr, (bool, int, float, np.generic)) or isinstance(arr, (list, tuple)):
                    arr = np.asarray(arr, dtype=DTYPES[spec.dtype])
                else:
                    raise InputError(f"input {name!r} must be a numpy array, got {type(arr).__name__}")
            if arr.dtype.name != spec.dtype:
                raise InputError(f"input {name!r} has dtype {arr.dtype.name}, expected {spec.dtype}")
            want = self._pinned.get(name)
            if want is not None and tuple(arr.shape) != want:
                raise InputError(f"input {name!r} has shape {tuple(arr.shape)}, pinned to {want}")
            if not spec.matches(tuple(arr.shape)):
                raise InputError(f"input {name!r} has shape {tuple(arr.shape)}, expected {spec.describe()}")
            out[name] = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)  # keeps rank 0
        return out

    def specialization(self, shapes: Mapping[str, tuple]):
        """The executable for these input shapes (compiled on first use, then cached)."""
        key = tuple(tuple(shapes[n]) for n in self.input_names)
        exe = self._cache.get(key)
        if exe is None:
            with self._lock:
                exe = self._cache.get(key)
                if exe is None:
                    from .frontend.staged import compile_program
                    exe = compile_program(self.program, dict(zip(self.input_names, key)), self.options)
                    self._cache[key] = exe
        return exe

    @property
    def plan(self):
        """The plan of the most recent specialisation, or of the pinned / static shapes."""
        if self._cache:
            return next(reversed(self._cache.values())).plan
        shapes = {}
        for s in self.program.inputs:
            shape = self._pinned.get(s.name) or s.dims
            if not all(isinstance(d, int) for d in shape):
                raise InputError(f"input {s.name!r} has symbolic shape {s.describe()}: call the model "
                                 "once or pass input_shapes= to see a plan")
            shapes[s.name] = tuple(shape)
        return self.specialization(shapes).plan

    def __call__(self, *args, **kwargs):
        outs = self.run(*args, **kwargs)
        return outs[0] if len(outs) == 1 else outs

    def run(self, *args, **kwargs) -> list[np.ndarray]:
        """Like calling the model, but always returns the list of outputs."""
        feeds = self._bind(args, kwargs)
        return list(self.specialization({k: v.shape for k, v in feeds.items()}).run(feeds))


def jit(model: Any = None, *, target: str | None = None, options: Options | None = None,
        input_shapes: Mapping[str, tuple] | None = None):
    """Compile ``model`` (ONNX path/bytes/ModelProto, a Graph) for ``target``.

    Returns a :class:`CompiledGraph`.  ``input_shapes`` pins the shapes of symbolic inputs.
    """
    opts = options or Options()
    if target is not None:
        opts = opts.replace(target=target)
    if model is None:
        return lambda m: jit(m, target=target, options=options, input_shapes=input_shapes)
    return CompiledGraph(load_program(model, input_shapes), opts, input_shapes)
