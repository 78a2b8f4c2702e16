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

#: shape specialisations a CompiledGraph keeps (least recently used dropped first)
MAX_SPECIALIZATIONS = 32


def load_program(model: Any, input_shapes: Mapping[str, tuple] | None = None,
                 options: Options | None = None) -> Program:
    """Turn a model (ONNX path/bytes/ModelProto, Graph, or Program) into a Program
    (``options.cache_dir`` remembers which model files passed the ONNX checker)."""
    if isinstance(model, Program):
        return model
    if isinstance(model, Graph):
        return GraphProgram(model)
    import os
    cache_dir = options.cache_dir if options is not None else None
    if isinstance(model, (str, os.PathLike)) and cache_dir and options.target == "cpu":
        # a model file: its name and inputs from the model cache's header, the nodes parsed
        # only if no compile of it is stored (frontend/model_cache.py)
        from .frontend.model_cache import model_program
        program = model_program(model, cache_dir)
        if program is not None:
            return program
    from .frontend.onnx import load_onnx
    return load_onnx(model, cache_dir)


class CompiledGraph:
    """A compiled model: call it with numpy arrays (by name or position), get numpy outputs.

    Shapes are specialised on first use: a call with new input shapes compiles (and caches) a
    new specialisation.  Safe to call from several threads.
    """

    def __init__(self, program: Program, options: Options, input_shapes: Mapping[str, tuple] | None = None):
        self.program = program
        self.options = options
        self._specs = {s.name: s for s in program.inputs}
        self._dtypes = {s.name: np.dtype(DTYPES[s.dtype]) if s.dtype in DTYPES else None
                        for s in program.inputs}
        self._pinned = {k: tuple(v) for k, v in (input_shapes or {}).items()}
        for k in self._pinned:
            if k not in self._specs:
                raise InputError(f"input_shapes names {k!r}, which is not an input; inputs are "
                                 f"{list(self._specs)}")
        from cachetools import LRUCache
        # shape key -> executable, the least recently used dropped past the cap (a model fed
        # ever new shapes must not keep every specialisation's code and arenas alive)
        self._cache: LRUCache = LRUCache(MAX_SPECIALIZATIONS)
        self._last = None                   # the most recently compiled specialisation
        self._last_key = None               # and its shape key
        self._lock = threading.Lock()       # guards _cache, _last and _compiling
        self._compiling: dict[tuple, threading.Lock] = {}   # shape key -> lock held while compiling
        self._names = tuple(s.name for s in program.inputs)
        # (shapes, dtypes, executable) of the last call made with positional C-contiguous arrays:
        # a call with the same signature skips binding, validation and the cache lookup
        self._fast = None

    @property
    def input_names(self) -> list[str]:
        return list(self._names)

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
                    try:
                        arr = np.asarray(arr, dtype=DTYPES[spec.dtype])
                    except (ValueError, TypeError, OverflowError) as e:    # ragged, strings, ...
                        raise InputError(f"input {name!r}: cannot convert {type(arr).__name__} to a "
                                         f"{spec.dtype} array: {e}") from None
                else:
                    raise InputError(f"input {name!r} must be a numpy array, got {type(arr).__name__}")
            want = self._dtypes[name]     # dtype.name costs 3 us, dtype != 0.05 us
            if (arr.dtype != want) if want is not None else (arr.dtype.name != spec.dtype):
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
        with self._lock:        # LRUCache reorders on every get: not safe without the lock
            exe = self._cache.get(key)
            if exe is not None:
                return exe
            # one lock per shape: a slow compile of one shape does not block another shape's
            # first call, and two threads wanting the same new shape compile it once
            klock = self._compiling.setdefault(key, threading.Lock())
        with klock:
            with self._lock:
                exe = self._cache.get(key)
            if exe is None:
                from .frontend.staged import compile_program
                try:
                    if self.options.tune == "tune":     # time the pieces the database lacks first
                        from .tuning import ensure_tuned
                        ensure_tuned(self.program, dict(zip(self.input_names, key)), self.options)
                    exe = compile_program(self.program, dict(zip(self.input_names, key)), self.options)
                    with self._lock:
                        self._cache[key] = exe
                        self._last, self._last_key = exe, key
                finally:
                    with self._lock:
                        self._compiling.pop(key, None)
        return exe

    @property
    def plan(self):
        """The plan of the most recent specialisation, or of the pinned / static shapes."""
        with self._lock:
            last = self._last
        if last is not None:
            return last.plan
        shapes = {}
        for s in self.program.inputs:
            shape = self._pinned.get(s.name) or s.dims
            if not all(isinstance(d, int) for d in shape):
                raise InputError(f"input {s.name!r} has symbolic shape {s.describe()}: call the model "
                                 "once or pass input_shapes= (on the command line: --shape "
                                 f"{s.name}=D0,D1,...) to see a plan")
            shapes[s.name] = tuple(shape)
        return self.specialization(shapes).plan

    def to_onnx(self, *example_args, **example_kwargs):
        """The primitive graph as a standard ONNX model (:func:`apollo_py.export`), for the
        shapes of the example inputs, else of the latest call, else the pinned/static shapes."""
        from .frontend.export import to_onnx
        if example_args or example_kwargs:
            shapes = {k: v.shape for k, v in self._bind(example_args, example_kwargs).items()}
        elif self._last_key is not None:
            shapes = dict(zip(self.input_names, self._last_key))
        else:
            shapes = {s.name: tuple(self._pinned.get(s.name) or s.dims) for s in self.program.inputs}
            bad = [k for k, v in shapes.items() if not all(isinstance(d, int) for d in v)]
            if bad:
                raise InputError(f"to_onnx: inputs {bad} have symbolic shapes; pass example inputs")
        return to_onnx(self.program.specialize(shapes), name=self.program.name)

    def __call__(self, *args, out=None, **kwargs):
        outs = self.run(*args, out=out, **kwargs)
        return outs[0] if len(outs) == 1 else outs

    def run(self, *args, out=None, **kwargs) -> list[np.ndarray]:
        """Like calling the model, but always returns the list of outputs.

        ``out``: caller-provided output arrays, written in place and returned -- one array (a
        single-output model), a list with one entry per output (None = allocate that one), or
        a dict output name -> array.  Each must have the output's shape and dtype, be
        C-contiguous and writeable, and share no memory with an input.  (An input that is
        itself named ``out`` must then be passed by position.)  Arrays aligned to 64 bytes
        (``apollo_py.runtime.memory.aligned_empty``) are written fastest: ``np.empty`` gives 16,
        which splits every 64-byte vector store (softmax [768,128,128]: 2.9-3.2 ms against 2.5-2.6).
        """
        fast, feeds = self._fast, None
        if fast is not None and not kwargs and len(args) == len(fast[0]):
            for a, shape, dtype in zip(args, fast[0], fast[1]):
                if type(a) is not np.ndarray or a.shape != shape or a.dtype != dtype \
                        or not a.flags.c_contiguous:
                    break
            else:   # the signature of a call that passed every check of _bind
                feeds, exe = dict(zip(self._names, args)), fast[2]
                if out is None:
                    return list(exe.run(feeds))
        if feeds is None:
            feeds = self._bind(args, kwargs)
            exe = self.specialization({k: v.shape for k, v in feeds.items()})
            if not kwargs and len(args) == len(self._names) \
                    and all(type(a) is np.ndarray and a is feeds[n] for a, n in zip(args, self._names)):
                self._fast = (tuple(a.shape for a in args), tuple(a.dtype for a in args), exe)
        if out is None:
            return list(exe.run(feeds))
        dest = self._bind_out(out, exe.graph if hasattr(exe, "graph") else None, feeds)
        if getattr(exe, "supports_out", False):
            return list(exe.run(feeds, out=dest))
        result = list(exe.run(feeds))
        for k, name in enumerate(self.output_names):
            if name in dest:
                d, r = dest[name], result[k]
                if d.shape != r.shape or d.dtype != r.dtype:
                    raise InputError(f"out[{name!r}] has shape {d.shape} and dtype {d.dtype}; the output "
                                     f"is {r.shape} {r.dtype}")
                np.copyto(d, r)
                result[k] = d
        return result

    def profile(self, *args, repeat: int = 10, warmup: int = 1, **kwargs):
        """Run ``repeat`` times on these inputs and return a :class:`~apollo_py.runtime.profile.Profile`:
        per-step median times, achieved GB/s and GFLOP/s and each step's roofline position
        against the machine figures the cost model uses (``print`` it for a table)."""
        from .runtime.profile import profile_executable
        feeds = self._bind(args, kwargs)
        exe = self.specialization({k: v.shape for k, v in feeds.items()})
        return profile_executable(exe, feeds, repeat=repeat, warmup=warmup)

    def run_updating(self, updates: Mapping[str, str], /, **feeds) -> list[np.ndarray]:
        """Run on ``feeds`` (by name) and store each output ``o`` of ``updates`` (output name ->
        input name) into that input's array, e.g. a training step's new weights into the weights.

        Where the compiled steps allow it (``runtime/inplace.py``: the writing kernel or BLAS
        call reads each element before overwriting it, and nothing reads the input later) the
        output is computed straight into the input's array; otherwise it is computed as usual
        and copied in.  The arrays to update must be C-contiguous and writeable.  Returns all
        outputs, the updated ones being the input arrays themselves.
        """
        bound = self._bind((), feeds)
        outs, seen = self.output_names, set()
        for o, i in updates.items():
            if o not in outs or i not in bound:
                raise InputError(f"run_updating: {o!r} -> {i!r} must map an output ({outs}) to an "
                                 f"input ({self.input_names})")
            if i in seen:
                raise InputError(f"run_updating: input {i!r} is the target of two outputs")
            seen.add(i)
            a = bound[i]
            if a is not feeds[i] or not a.flags.writeable:
                raise InputError(f"run_updating: input {i!r} must be a C-contiguous, writeable numpy array")
        exe = self.specialization({k: v.shape for k, v in bound.items()})
        direct = {}
        if getattr(exe, "supports_out", False) and hasattr(exe, "inplace_reason"):
            direct = {o: bound[i] for o, i in updates.items() if not exe.inplace_reason(o, i)}
        result = list(exe.run(bound, out=direct) if direct else exe.run(bound))
        for k, name in enumerate(outs):
            if name in updates and name not in direct:
                dest = bound[updates[name]]
                if dest.shape != result[k].shape or dest.dtype != result[k].dtype:
                    raise InputError(f"run_updating: output {name!r} is {result[k].shape} {result[k].dtype}, "
                                     f"input {updates[name]!r} is {dest.shape} {dest.dtype}")
                np.copyto(dest, result[k])
                result[k] = dest
        return result

    def _bind_out(self, out, graph, feeds) -> dict[str, np.ndarray]:
        """Validate ``out`` (see :meth:`run`) against the output types; name -> array."""
        names = self.output_names
        if isinstance(out, np.ndarray):
            if len(names) != 1:
                raise InputError(f"{self.program.name}: out= got one array, the model has {len(names)} "
                                 f"outputs {names}: pass a list or a dict")
            out = {names[0]: out}
        elif isinstance(out, (list, tuple)):
            if len(out) != len(names):
                raise InputError(f"{self.program.name}: out= has {len(out)} entries, the model has "
                                 f"{len(names)} outputs {names}")
            out = {n: a for n, a in zip(names, out) if a is not None}
        elif not isinstance(out, Mapping):
            raise InputError(f"out= must be an array, a list or a dict, not {type(out).__name__}")
        types = graph.types if graph is not None else {}
        for name, a in out.items():
            if name not in names:
                raise InputError(f"out= names {name!r}, which is not an output; outputs are {names}")
            if not isinstance(a, np.ndarray):
                raise InputError(f"out[{name!r}] must be a numpy array, got {type(a).__name__}")
            t = types.get(name)
            if t is not None and (tuple(a.shape) != tuple(t.shape) or a.dtype != t.np_dtype):
                raise InputError(f"out[{name!r}] has shape {tuple(a.shape)} and dtype {a.dtype}; the output "
                                 f"is {tuple(t.shape)} {np.dtype(t.np_dtype).name}")
            if not a.flags.c_contiguous or not a.flags.writeable:
                raise InputError(f"out[{name!r}] must be C-contiguous and writeable")
            for k, x in feeds.items():
                if np.may_share_memory(a, x):
                    raise InputError(f"out[{name!r}] shares memory with input {k!r}")
        items = list(out.items())
        for i, (n1, a1) in enumerate(items):
            for n2, a2 in items[i + 1:]:
                if np.may_share_memory(a1, a2):
                    raise InputError(f"out[{n1!r}] and out[{n2!r}] share memory")
        return dict(out)


def jit(model: Any = None, *, target: str | None = None, options: Options | None = None,
        input_shapes: Mapping[str, tuple] | None = None, static_argnames=(), static_argnums=()):
    """Compile ``model`` for ``target``: an ONNX path/bytes/ModelProto or a Graph gives a
    :class:`CompiledGraph` (``input_shapes`` pins the shapes of symbolic inputs); a Python
    function gives a :class:`~apollo_py.frontend.jit.JittedFunction` that traces it with numpy
    semantics once per signature (``static_argnames`` / ``static_argnums``: arguments that are
    settings, part of the signature, not arrays).  Usable as ``@jit`` or ``@jit(...)``.
    """
    opts = options or Options()
    if target is not None:
        opts = opts.replace(target=target)
    if model is None:
        return lambda m: jit(m, target=target, options=options, input_shapes=input_shapes,
                             static_argnames=static_argnames, static_argnums=static_argnums)
    if callable(model) and not isinstance(model, (Graph, Program)):
        from .frontend.jit import JittedFunction
        if input_shapes:
            raise InputError("jit: input_shapes applies to models; a traced function is "
                             "specialised on the shapes it is called with")
        if isinstance(static_argnames, str):
            static_argnames = (static_argnames,)
        if isinstance(static_argnums, int):
            static_argnums = (static_argnums,)
        return JittedFunction(model, opts, static_argnames, static_argnums,
                              make_compiled=lambda g, o: CompiledGraph(GraphProgram(g), o))
    return CompiledGraph(load_program(model, input_shapes, opts), opts, input_shapes)


def explain(model: Any, options: Options | None = None, input_shapes: Any = None):
    """The fusion plan of ``model`` (ONNX path/bytes/ModelProto, Graph) without running it.

    Symbolic input dims need ``input_shapes``; the plan carries ``micro_graphs``."""
    return jit(model, options=options, input_shapes=input_shapes).plan
