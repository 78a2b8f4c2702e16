"""CPU executable (``target="cpu"``): compiled LLVM kernels and reference steps in order.

Steps run in a fixed order.  A kernel step runs its compiled function on the thread pool in
chunks of its outermost parallel loop; a reference step runs primitives through their numpy
references (opaque ops without a lowering, matmul/conv through numpy's BLAS) and the plan says
so.  Intermediates live in a pre-faulted arena laid out by the liveness-based memory plan;
graph outputs are fresh arrays handed to the caller.  Safe to call from several threads: each
call borrows its own arena.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import CompileError
from ..ir.graph import Graph
from . import drive
from .concat import ConcatStep, SliceView, concat_members, concat_step, slice_views
from .memory import ArenaPool, plan_memory
from .reference import run_nodes


@dataclass
class KernelStep:
    """One compiled kernel: ``compiled`` (CompiledKernel), buffers bound by ``param_values``."""

    compiled: object
    fused: object           # layer 1's FusedKernel
    param_values: tuple
    inputs: tuple
    outputs: tuple
    parts: int | None = None    # chunks of the parallel loop a tuning decision fixed (None: _parts)


@dataclass
class ReferenceStep:
    """Primitives run through their numpy references; ``reason`` is shown in the plan."""

    nodes: tuple
    inputs: tuple
    outputs: tuple
    reason: str


_POOLS: dict[int, object] = {}
_POOL_LOCK = threading.Lock()


def thread_pool(num_threads: int | None):
    """A process-wide thread pool per thread count (workers are daemon threads)."""
    from .threadpool import ThreadPool
    n = int(num_threads or os.cpu_count() or 1)
    with _POOL_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = ThreadPool(n)
        return pool


class CpuExecutable:
    """Runs ``steps`` over a memory plan; ``plan`` describes what was compiled and why."""

    def __init__(self, graph: Graph, steps: Sequence, plan, num_threads: int | None = None,
                 machine=None, options=None):
        from ..machine import PRESETS
        self.machine = machine or PRESETS["conservative"]   # layer 3's cost model, dispatch sizes
        self._options = options                     # for layer 3's parallel_rejected events
        self.graph = graph
        self.steps = list(steps)
        # read-only views of the graph's constants (ConstArray holds C-contiguous, read-only
        # arrays): copying them cost 2 s of a GPT-2 compile; a constant output is copied out
        self.constants = {n.outputs[0]: np.asarray(n.attrs["value"].array, order="C")
                          for n in graph.nodes if n.op == "constant"}
        external = set(graph.inputs) | set(graph.outputs) | set(self.constants)
        self._root = _reshape_aliases(self.steps)
        root = self._root
        members, bound = self._concats_in_place(external)
        # only outputs of kernels and BLAS calls go into the arena (and generated GEMMs' outputs
        # placed in a concat's slot or sliced in place); reference steps return their own arrays, except a reshape,
        # whose output is a view of its input (an alias: the memory plan keeps the input's
        # buffer alive for the alias's readers)
        kernel_outs = {v for s in self.steps if _writes_buffers(s) for v in s.outputs} | set(members) | bound
        external |= {v for s in self.steps for v in s.outputs if v not in kernel_outs}
        # a graph output that is a reshape view of an arena value is copied out after the last
        # step, so that value lives to the end: the closing pseudo-step reads it (else a later
        # kernel reuses its slot first -- found by tests/fuzz_graphs.py, seed 1743)
        closing = [(tuple(root[v] for v in graph.outputs if v in root), ())]
        self.memory = plan_memory([(tuple(root.get(v, v) for v in s.inputs), s.outputs) for s in self.steps] + closing,
                                  {v: graph.types[v].nbytes for s in self.steps for v in (*s.inputs, *s.outputs)},
                                  external, members)
        from ..options import check_memory
        consts = sum(a.nbytes for a in self.constants.values())
        outs = sum(graph.types[v].nbytes for v in set(graph.outputs) if v not in self.constants)
        check_memory(self.memory.arena_bytes + outs + consts, f"graph {graph.name!r} (arena "
                     f"{self.memory.arena_bytes} B, outputs {outs} B, constants {consts} B)", options)
        # error words of kernels that check their input (gathers: an index out of range), by name
        self._error_nodes = {s.param_values[-1]: s.fused.nodes[0] for s in self.steps
                             if isinstance(s, KernelStep) and getattr(s.fused, "signature", "") == "gather"}
        self._arenas = ArenaPool(self.memory, graph.types, tuple(self._error_nodes))  # made on first call
        self._trace = threading.local()
        self._pool = thread_pool(num_threads)
        self.plan = plan
        self._tuned, self._kernel_keys = _apply_tuning(self.steps, graph, options)
        self._schedule = self._dispatch_schedule()
        if plan is not None and hasattr(plan, "launches"):     # str(plan) shows layer 3's groups
            index = {id(s): k for k, s in enumerate(self.steps)}
            kernels = plan.kernels
            if len(kernels) == len(self.steps):     # concats in place: their reason says so
                kernels = tuple(dataclasses.replace(spec, reason=s.reason) if isinstance(s, (ConcatStep, SliceView))
                                else spec
                                for spec, s in zip(kernels, self.steps))
            self.plan = dataclasses.replace(plan, kernels=kernels, launches=tuple(
                tuple(index[id(s)] for s in item) for kind, item in self._schedule if kind == "kernels"))
        self._fresh = {v: (graph.types[v].shape, graph.types[v].np_dtype) for s in self.steps
                       if _writes_buffers(s) for v in s.outputs if v not in self.memory.slots}
        self._inplace: dict[tuple, str] = {}
        self._copy_out = tuple(v in self.memory.slots or v in self.constants or v in graph.inputs
                               or v in self._root for v in graph.outputs)
        self._outs = tuple((v, c, v in self._fresh) for v, c in zip(graph.outputs, self._copy_out))
        # the native driver (runtime/drive.py) runs runs of inline kernels and BLAS calls in
        # one call; False (or a profiler's ``trace``) runs every step from Python instead
        self.use_driver = True
        self._program = None        # drive.Program, built on the first driven call
        self._driver_fn = None
        self._program_lock = threading.Lock()
        # OpenBLAS held at one thread while a plan with BLAS steps runs (its spinning threads
        # would take the pool's cores: runtime/blas.py, OneBlasThread)
        from .blas import BlasStep, one_blas_thread
        self._blas_threads = (one_blas_thread() if any(isinstance(s, BlasStep) for s in self.steps)
                              else None)

    def _concats_in_place(self, external: set) -> tuple[dict, set]:
        """Place concat inputs in their slices of the concat output and slices that are a
        contiguous block of their input inside it (runtime/concat.py): those steps become
        :class:`ConcatStep` / :class:`SliceView`, and generated GEMMs writing a placed value get
        it in ``bound``.  Returns the placements for the memory plan and the GEMM outputs that
        now live in the arena."""
        from .gemm_step import GemmStep
        writers = {v: s for s in self.steps if _writes_buffers(s) or type(s) is GemmStep for v in s.outputs}
        members, concats = concat_members(self.steps, self.graph, self._root, writers, external)
        for k, (axis, copies) in concats.items():
            self.steps[k] = concat_step(self.steps[k], axis, copies, members)
        writers.update({v: s for s in self.steps if isinstance(s, ConcatStep) for v in s.outputs})
        views, at = slice_views(self.steps, self.graph, self._root, writers, external, members)
        for k in at:
            s = self.steps[k]
            self.steps[k] = SliceView(s.nodes, s.inputs, s.outputs, "slice as a view: a contiguous block of "
                                      f"{s.inputs[0]!r} in its buffer (no copy)")
        # an excitation written over its operand (layers/conv_squeeze.excite_in_place): the
        # product is the operand's buffer
        for s in self.steps:
            ex = getattr(s.compiled.desc, "excite", None) if type(s) is GemmStep else None
            if ex is not None and ex.inplace:
                members[ex.output] = (ex.operand, 0)
        placed = {*members, *(r for r, _ in views.values())}
        bound = set()
        for s in self.steps:
            if type(s) is GemmStep:
                s.bound = frozenset(v for v in s.outputs if v in placed)
                bound |= s.bound
        return {**members, **views}, bound

    def _dispatch_schedule(self) -> list:
        """Steps in order, consecutive independent kernel steps merged into one dispatch.

        Returns a list of ``("kernels", [KernelStep, ...])`` and ``("step", step)`` entries.
        A run of consecutive kernel steps is independent while no member reads or writes a
        value another member writes and no member's arena slot overlaps a buffer of another
        member (the memory plan reuses slots in step order, which a concurrent run must not
        see); layer 3's policy (``layers.layer3.stitch_parallel`` with the cost model
        ``self.machine``) then picks which members of the run share one thread-pool job.  Tiny kernels (under ``machine.inline_bytes``
        moved) run on the calling thread without waking the pool.
        """
        slots = self.memory.slots

        root = self._root

        def ranges(vals):
            vals = [root.get(v, v) for v in vals]
            return [(slots[v].offset, slots[v].offset + max(slots[v].nbytes, 1)) for v in vals if v in slots]

        def overlap(a, b):
            return any(x0 < y1 and y0 < x1 for x0, x1 in a for y0, y1 in b)

        out: list = []
        group: list = []

        self.runs = []      # runs of independent kernel steps layer 3 saw (the tuner times them)

        def flush():
            if len(group) > 1:
                self.runs.append(list(group))
            for g in _layer3_groups(group, self.machine, self._options, self._kernel_keys, self._tuned):
                if len(g) > 1 and sum(_bytes(k, self.machine) for k in g) < self.machine.inline_bytes:
                    # too small to be worth waking the pool: each runs inline, one after another
                    out.extend(("kernels", [k]) for k in g)
                else:
                    out.append(("kernels", g))

        for s in self.steps:
            if isinstance(s, KernelStep) and _phases(s):
                # phases in order (codegen/phased.py): never chunked alongside other kernels
                if group:
                    flush()
                    group = []
                out.append(("kernels", [s]))
                continue
            if isinstance(s, KernelStep):
                if group:
                    written = {v for g in group for v in g.outputs}
                    touched = {v for g in group for v in g.param_values}
                    ok = (not (set(s.param_values) & written) and not (set(s.outputs) & touched)
                          and not overlap(ranges(s.outputs), ranges(touched))
                          and not overlap(ranges(written), ranges(s.param_values)))
                    if ok:
                        group.append(s)
                        continue
                    flush()
                group = [s]
                continue
            if group:
                flush()
                group = []
            out.append(("step", s))
        if group:
            flush()
        return out

    supports_out = True

    def inplace_reason(self, output: str, source: str) -> str:
        """Why ``output`` cannot be written into input ``source``'s array ("" if it can; see
        runtime/inplace.py), memoised per pair."""
        key = (output, source)
        why = self._inplace.get(key)
        if why is None:
            from .inplace import inplace_reason
            why = self._inplace[key] = inplace_reason(self, output, source)
        return why

    @property
    def trace(self) -> list | None:
        """Set to a list to record ``(schedule index, seconds)`` per dispatch of this
        executable's calls made by the setting thread (profiling).  Per executable and per
        thread, so a profiler in one thread never sees, nor races on, another thread's calls."""
        return getattr(self._trace, "value", None)

    @trace.setter
    def trace(self, value: list | None) -> None:
        self._trace.value = value

    def run(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray] | None = None) -> list[np.ndarray]:
        """Graph outputs for ``feeds``; ``out`` (output name -> array, already validated by the
        caller) receives them in place: kernels write into it directly, other steps' results
        are copied in."""
        out = out or {}
        if self._blas_threads is None:      # no BLAS step: no context to enter (~0.2 us a call)
            return self._run(feeds, out)
        with self._blas_threads:
            return self._run(feeds, out)

    def _run(self, feeds: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        arena = self._arenas.acquire()
        try:
            trace = getattr(self._trace, "value", None)     # self.trace, without the property call
            if self.use_driver and trace is None:
                env = self._run_driven(feeds, out, arena)
            else:
                env: dict[str, np.ndarray] = dict(self.constants)
                env.update(feeds)
                env.update(arena.views)     # every arena value, written before it is read
                for k, (kind, item) in enumerate(self._schedule):
                    t0 = time.perf_counter() if trace is not None else 0.0
                    self._dispatch(kind, item, env, out, arena)
                    if trace is not None:
                        trace.append((k, time.perf_counter() - t0))
            errors = arena.errors
            # tobytes() and a compare: 0.12 us for DLRM's 17 words, where errors.any() takes 2 us
            if errors is not None and errors.tobytes() != arena.errors_clear:
                self._raise_input_error(errors)
            result = []
            kept = {}       # fresh output arrays handed out as they are, recycled next call
            for v, copy, fresh in self._outs:
                a = env[v]
                if v in out:
                    if a is not out[v]:
                        np.copyto(out[v], a)
                    a = out[v]
                elif copy or v in feeds:
                    a = a.copy()
                elif fresh:
                    kept[v] = a
                result.append(a)
            arena.keep_outputs(kept, merge=bool(out))
            return result
        finally:
            self._arenas.release(arena)

    def _raise_input_error(self, errors: np.ndarray) -> None:
        """Raise the error the numpy reference would have raised for the first kernel whose
        error word is set (and clear the words: the arena is used again)."""
        from ..errors import ShapeError
        from ..ops.evaluate import _describe
        k = int(np.flatnonzero(errors)[0])
        errors[:] = 0
        node = self._error_nodes[list(self._error_nodes)[k]]
        n = self.graph.types[node.inputs[0]].shape[int(node.attrs["axis"])]
        # the graph inputs the indices come from: what the caller passed wrong
        producer = {o: m for m in self.graph.nodes for o in m.outputs}
        seen, todo, inputs = set(), [node.inputs[1]], []
        while todo:
            v = todo.pop()
            if v in seen:
                continue
            seen.add(v)
            if v in self.graph.inputs:
                inputs.append(v)
            elif v in producer:
                todo.extend(producer[v].inputs)
        src = f" (from graph input {', '.join(repr(v) for v in sorted(inputs))})" if inputs else ""
        raise ShapeError(f"{_describe(node)}: gather index out of range [-{n}, {n}) in index tensor "
                         f"{node.inputs[1]!r}{src}")

    def _run_driven(self, feeds: Mapping, out: Mapping, arena) -> dict:
        """Run the schedule with its driver segments as one native call each (runtime/drive.py);
        returns the values by name (constants, arena views, feeds and what the steps made)."""
        prog = self._program
        if prog is None:
            with self._program_lock:    # two first calls at once build it once
                prog = self._program
                if prog is None:
                    from ..codegen.driver import data_offset, drive_block_function
                    self._driver_fn = self._driver_fn or drive_block_function()
                    self._offset = data_offset()
                    prog = self._program = drive.build_program(
                        self, lambda s: isinstance(s, KernelStep) and _parts(s, self.machine) <= 1)
        tables = arena.driver
        if tables is None:
            tables = arena.driver = drive.DriverTables(prog, arena, self.constants, self._offset)
        helper = drive.helper_wanted() if drive.HELPER and (prog.segments or prog.big is not None) else False
        if helper and prog.big is not None:
            # the helper has a core for this call: the big GEMM / conv steps are driver steps
            # it shares (drive.SHARE_BIG); without it they stay pool dispatches
            prog = prog.big
            tables = tables.big or drive.DriverTables(prog, arena, self.constants, self._offset)
            arena.driver.big = tables
        env = tables.env.copy()
        env.update(feeds)
        offset = self._offset
        for kind, item in prog.entries:
            if kind == "drive":
                drive.run_segment(self, prog.segments[item], tables, item, env, out, arena, offset, helper)
            else:
                self._dispatch(kind, item, env, out, arena)
        return env

    def _bind_outputs(self, s, env, out, arena) -> None:
        fresh = self._fresh
        for v in s.outputs:
            if v in out and v in fresh:
                env[v] = out[v]
            elif v in fresh:
                env[v] = arena.output_buffer(v, *fresh[v])

    def _dispatch(self, kind: str, item, env: dict, out: Mapping, arena) -> None:
        """Run one schedule entry: a group of kernels (inline, chunked on the pool, or several
        at once), a generated GEMM or BLAS call, or a numpy reference step."""
        pool = self._pool
        if kind == "kernels":
            for s in item:
                self._bind_outputs(s, env, out, arena)
            if len(item) == 1:
                s = item[0]
                args = [env[v] for v in s.param_values]
                parts = _parts(s, self.machine)
                if parts <= 1:
                    s.compiled.cfunc(s.compiled.pack_args(args), 0, s.compiled.parallel_extent or 0)
                elif _phases(s):
                    from ..codegen.phased import run_phased
                    run_phased(pool, s.compiled, args, _phases(s))
                else:
                    ext = s.compiled.parallel_extent
                    pool.run(s.compiled, args, min_chunk=-(-ext // parts))
            else:
                pool.run_many([(s.compiled, [env[v] for v in s.param_values], _parts(s, self.machine)) for s in item])
            return
        s = item
        if hasattr(s, "execute"):     # a generated GEMM (gemm_step.py) or a BLAS call (blas.py)
            if _writes_buffers(s):
                self._bind_outputs(s, env, out, arena)
            s.execute(env, pool)
            return
        if s.outputs and s.outputs[0] in self._root:    # a reshape: a view, no copy
            env[s.outputs[0]] = env[s.inputs[0]].reshape(self.graph.types[s.outputs[0]].shape)
            return
        local = {v: env[v] for v in s.inputs}
        run_nodes(s.nodes, local, self.graph.types)
        for v in s.outputs:
            a = local[v]
            # a numpy view (slice, transpose) of an arena buffer must not outlive its slot
            if not a.flags.c_contiguous or np.may_share_memory(a, arena.block):
                a = np.array(a, order="C")
            env[v] = a


def _reshape_aliases(steps) -> dict:
    """Output -> root value (the buffer it views) of every reference step that is one
    ``reshape`` of a C-contiguous value (every value the runtime binds is one), transitively."""
    root: dict = {}
    for s in steps:
        if isinstance(s, ReferenceStep) and len(s.nodes) == 1 and s.nodes[0].op == "reshape" \
                and len(s.outputs) == 1 and s.outputs[0] == s.nodes[0].outputs[0]:
            v = s.nodes[0].inputs[0]
            root[s.outputs[0]] = root.get(v, v)
    return root


def _phases(step) -> int:
    """Phases of a kernel step whose parallel loop must run phase after phase (0: any split)."""
    return getattr(step.fused, "phases", 0) if step.fused is not None else 0


def _writes_buffers(step) -> bool:
    """True for steps that write into buffers the runtime binds (kernels, BLAS calls)."""
    return isinstance(step, KernelStep) or getattr(step, "writes_buffers", False)


class _Layer3Kernel:
    """A kernel step as layer 3 sees it: value names, bytes, flops, compute-bound flag."""

    def __init__(self, step, machine):
        self.step = step
        self.name = step.compiled.name
        self.inputs = tuple(v for v in step.param_values if v not in step.outputs)
        self.outputs = tuple(step.outputs)
        self.bytes = step.fused.bytes if step.fused is not None else 0
        self.flops = step.fused.flops if step.fused is not None else 0
        self.compute_bound = machine.is_compute_bound(self.bytes, self.flops)


def _apply_tuning(steps, graph, options) -> tuple[dict, dict]:
    """(decisions, kernel step id -> piece key): the tuning database's decisions for this
    machine (tuning/db.py), with each kernel step's ``parts`` set where one is stored."""
    if options is None:
        return {}, {}
    from ..tuning.db import decisions, kernel_key
    tuned = decisions(options)
    if not tuned:
        return {}, {}
    keys = {}
    for s in steps:
        if isinstance(s, KernelStep) and s.fused is not None:
            keys[id(s)] = k = kernel_key(s.fused, graph.types)
            d = tuned.get(k)
            if d and isinstance(d.get("parts"), int) and d["parts"] >= 1:
                s.parts = d["parts"]
    return tuned, keys


def _layer3_groups(run: list, machine, options=None, keys=None, tuned=None) -> list:
    """Split a run of mutually independent kernel steps into layer 3's parallel groups.

    With ``options``, every combination layer 3 tries and rejects is logged as a
    ``parallel_rejected`` feedback event (kernel names, bytes, estimated gain); combinations a
    ``[[no_parallel]]`` overlay entry names are refused without a new event.  A tuning decision
    ``{"layer3": "separate"}`` for the run (``tuned``, by the run key of the members' ``keys``)
    runs every member on its own; the tuner's ``kernel`` cost correction scales the figures.
    """
    if len(run) < 2:
        return [run] if run else []
    from ..layers.layer3 import stitch_parallel
    if tuned and keys:
        from ..tuning.db import run_key
        if (tuned.get(run_key([keys.get(id(s), "") for s in run])) or {}).get("layer3") == "separate":
            return [[s] for s in run]
    refused: frozenset = frozenset()
    if options is not None:
        from ..tuning.db import corrections
        f = corrections(options).get("kernel")
        if f:       # measured / predicted kernel time on this machine: the same roofline, rescaled
            machine = machine.replace(bandwidth=machine.bandwidth / f, peak=machine.peak / f)
        if options.rules_overlay:
            from ..partition.rules import overlay_signatures
            refused = overlay_signatures(options.rules_overlay, "no_parallel")
    on_reject = None
    if options is not None:
        from ..feedback.log import log_event

        def on_reject(combo, gain):
            try:
                log_event(options, "parallel_rejected", "+".join(k.name for k in combo),
                          sizes=[k.bytes for k in combo],
                          detail={"gain_s": gain, "launch_s": machine.launch,
                                  "reason": "estimated gain below the policy threshold"})
            except OSError:     # the log is advisory: never fail a compile for it
                pass
    groups = stitch_parallel([_Layer3Kernel(s, machine) for s in run], machine, on_reject=on_reject,
                             **({"refused": refused} if refused else {}))
    return [[k.step for k in g] for g in groups]


def _bytes(step, machine) -> int:
    """Bytes a kernel step moves (an unknown amount counts as large)."""
    return step.fused.bytes if step.fused is not None else machine.chunk_bytes * 64


def _parts(step, machine) -> int:
    """How many chunks a kernel step's parallel loop is worth on ``machine`` (1 = run it
    inline: it moves less than ``machine.inline_bytes``; else chunks of ``chunk_bytes``)."""
    ext = step.compiled.parallel_extent
    if ext is None or ext <= 1:
        return 1
    if step.parts is not None:      # a tuning decision (tuning/db.py)
        return max(1, min(ext, step.parts))
    nbytes = _bytes(step, machine)
    if nbytes < machine.inline_bytes:
        return 1
    if _phases(step):       # its chunks per phase, shared by every thread (codegen/phased.py)
        return ext
    return max(1, min(ext, nbytes // machine.chunk_bytes))


def compile_kernels(fused: Sequence, cache_dir: str | None = None, progress=None, types=None,
                    options=None) -> list:
    """Compile layer-1 kernels with LLVM behind the piecewise cache (``cache_dir``; None = memory).
    With ``types`` and ``options``: a kernel the tuning database has a code decision for
    (vector width, parallel dim: tuning/kernels.py) is compiled with it."""
    from ..codegen.cached import compile_all
    loops, keys = [f.loop for f in fused], [f.object_key for f in fused]
    if types is not None and options is not None:
        from ..tuning.db import decisions, kernel_key
        tuned = decisions(options)
        if tuned:
            from ..tuning.kernels import tuned_loop
            for i, f in enumerate(fused):
                d = tuned.get(kernel_key(f, types))
                k = tuned_loop(f, d) if d else None
                if k is not None:
                    loops[i], keys[i] = k, ""       # another text: its own object-cache key
    return compile_all(loops, cache_dir, progress, keys)
