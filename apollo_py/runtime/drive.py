"""Segments: runs of a CPU executable's schedule that the native driver runs in one call.

:func:`build_program` turns the executable's dispatch schedule into a list of entries: a
:class:`Segment` (consecutive kernels that run on the calling thread, and cblas calls, as one
program for ``codegen/driver.py``'s ``apollo_drive``) or an entry of the schedule that needs
Python (a thread-pool dispatch, a generated GEMM, a numpy step).  Reshapes between kernels are
views and do not split a segment.  A plan of tiny kernels is then one native call per model
call instead of one ctypes call (and argument packing) per kernel.

Buffers are named by an index into a per-arena value table: arena slots and constants are
written once when the arena is made; graph inputs, fresh outputs and numpy steps' results
("dynamic" values) are given per call as ``(index, id(array))`` pairs that the driver
dereferences (or as pointers, where :func:`~apollo_py.codegen.driver.data_offset` is None).
"""
from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from .threadpool import QUIET


#: GEMM / direct-conv steps that run on the calling thread (``CompiledGemm.inline``) share their
#: chunks with one helper thread (a pool worker running ``codegen.driver``'s ``apollo_help``)
#: that joins the segment's call: the second core for steps too small for a pool dispatch.
#: ``"auto"`` (default): such steps are built for a helper, and each call asks for one only while
#: other processes leave two cores free (``cpuload.QuietGate``: on 2 cores, at most 0.4 of a core
#: taken by others over the last 0.25 s); ``True``: always; ``False``: never (one call per step).
#: Why: on the quiet 2-core box (``benchmarks/helper_ab.py``, 2026-11-25 12:03, load 0.6) the
#: helper took 0.945x (MobileNetV3-Large) and 0.951x (EfficientNet-B0) the time without it,
#: 0.99-1.01x on ResNet-50 and RegNetY; on the shared box at load 16-17 1.03x and 1.04-1.11x
#: (no free core there: a caller waits for chunks of a descheduled helper).  A call without a
#: helper runs a parallel step as one call, exactly as with ``False``.  Generated GEMMs claim
#: their tiles from a counter of their own and run as one call (GemmStep.claims_tiles), so only
#: direct convs share chunks with it.
HELPER: "bool | str" = "auto"
#: ... when they do at least this many flops or move this many bytes (GemmStep.work)
HELPER_MIN_WORK = 1 << 20
#: the tile-claiming GEMM / conv steps too large for the rule of ``gemm_step.SHARED_MAX_FLOPS``
#: (pool dispatches from Python, each ~10-20 us of Python plus a worker's wake-up) run as
#: helper-shared driver steps in a second program (``Program.big``), used by the calls that get
#: the helper (``HELPER`` True, or "auto" while the gate finds the cores free); a call without
#: the helper runs the first program, so on a busy machine the big steps keep the pool's two
#: threads (docs/design/driver.md, "Big steps in the driver")
SHARE_BIG = True
#: judges, for HELPER "auto", whether the cores are free of other processes (the pool's gate)
_QUIET = QUIET


@dataclass
class Segment:
    """One native call: ``prog`` (int64 words, see codegen/driver.py) of ``nsteps`` program
    steps (a BLAS update is two: the accumulator's copy and the gemm).

    ``fresh``: graph outputs the segment writes (bound to arrays before the call);
    ``views``: reshape steps ``(output, input, shape)`` run as numpy views before the call;
    ``dynamic``: ``(value, index, dtype, elements)`` of the per-call buffers it touches;
    ``steps``: the runtime steps it runs, in order; ``first``: its first schedule index.
    """

    prog: object
    nsteps: int
    maxargs: int
    fresh: tuple
    views: tuple
    dynamic: tuple
    steps: tuple
    first: int
    parallel: bool = False      # has parallel steps: run with a helper thread (codegen/driver.py)

    @property
    def address(self) -> int:
        return ctypes.addressof(self.prog)


class DriverTables:
    """Per-arena state of the driver: the value table and one ``objs`` array per segment."""

    def __init__(self, program: "Program", arena, constants: dict, offset: int | None = None):
        self.env = dict(constants)      # a call's values start from these: constants, arena views
        self.env.update(arena.views)
        self.values = (ctypes.c_void_p * max(1, len(program.index)))()
        for v, i in program.index.items():
            a = arena.views.get(v)
            if a is None:
                a = program.constants.get(v)
            if a is not None:
                self.values[i] = a.ctypes.data
        # per arena, zeroed by the program before each use: two calls in two arenas never share one
        self.scratch = {v: _aligned_words(n) for v, n in (program.scratch or {}).items()}
        for v, a in self.scratch.items():
            self.values[program.index[v]] = a.ctypes.data
        self.values_address = ctypes.addressof(self.values)
        # shared state of a call and its helper thread (codegen/driver.py, helper_ir); a helper
        # job that the pool runs late holds this array (its chunk), so it never outlives it
        from ..codegen.driver import BLOCK_WORDS, SYNC_WORDS
        self.sync = (ctypes.c_int64 * SYNC_WORDS)()
        self.sync_address = ctypes.addressof(self.sync)
        self.objs = []
        # per segment, the arguments of its apollo_drive call (codegen/driver.py, block_ir):
        # all fixed for this arena but the helper's sync word of a parallel segment
        self.blocks = []
        for seg in program.segments:
            arr = (ctypes.c_int64 * max(1, 2 * len(seg.dynamic)))()
            for k, (_, i, _, _) in enumerate(seg.dynamic):
                arr[2 * k] = i
            self.objs.append((arr, ctypes.addressof(arr)))
            blk = (ctypes.c_int64 * BLOCK_WORDS)(
                seg.address, seg.nsteps, self.values_address, seg.maxargs, ctypes.addressof(arr),
                len(seg.dynamic) if offset is not None else 0, offset or 0, 0)
            self.blocks.append((blk, ctypes.addressof(blk)))
        #: the tables of ``program.big`` (made on the first call that runs it)
        self.big = None


@dataclass
class Program:
    """What :func:`build_program` returns: ``entries`` (``("drive", k)`` for ``segments[k]`` or
    a schedule entry ``(kind, item)``), the value ``index`` and the constants it reads."""

    entries: list
    segments: list
    index: dict
    constants: dict
    #: per-arena int64 buffers by key and length (the tile counters of shared GEMM steps, the
    #: padded copies of shared row-reading convs)
    scratch: dict = None
    #: the program with the big steps shared too (``SHARE_BIG``; None: none, or not built)
    big: "Program | None" = None


#: the zeros a shared GEMM step's tile counter is reset from (read only)
_ZEROS = "\0zeros"
_ZERO_WORDS = np.zeros(4, np.int64)


def _aligned_words(n: int) -> np.ndarray:
    """``n`` zero int64 words, 64-byte aligned (a padded copy's rows are read with aligned loads)."""
    raw = np.zeros(n + 8, np.int64)
    skip = (-raw.ctypes.data % 64) // 8
    return raw[skip:skip + n]


def _blas_words(step, index, root, types) -> list | None:
    """Program words of a BLAS step the driver can run (no empty dimension, an accumulator of
    the output's shape, a known cblas flavour), else None."""
    from ..codegen import driver as D
    d = step.desc
    if not (d.m and d.n and d.k) or d.dtype not in ("float32", "float64"):
        return None
    copy = []
    if d.acc is not None:       # C = P first (a memmove: P may be C itself, an in-place update)
        p, c = types[d.acc], types[d.out]
        if p.shape != c.shape or p.dtype != c.dtype:
            return None         # np.copyto would broadcast: left to Python
        copy = [D.COPY, index(d.out), index(root.get(d.acc, d.acc)), int(c.nbytes)]
    fn = step._lib._fns[d.dtype]
    itype = fn.argtypes[3]
    if itype is ctypes.c_int64:
        kind = D.SGEMM64 if d.dtype == "float32" else D.DGEMM64
    elif itype is ctypes.c_int and ctypes.sizeof(ctypes.c_int) == 4:
        kind = D.SGEMM32 if d.dtype == "float32" else D.DGEMM32
    else:
        return None
    bits = lambda x: struct.unpack("<q", struct.pack("<d", float(x)))[0]    # noqa: E731
    lda = d.m if d.trans_a else d.k
    ldb = d.k if d.trans_b else d.n
    return copy + [kind, ctypes.cast(fn, ctypes.c_void_p).value, int(d.trans_a), int(d.trans_b), d.m, d.n,
                   d.k, bits(d.alpha), bits(1.0 if copy else 0.0), index(root.get(d.a, d.a)), lda,
                   index(root.get(d.b, d.b)), ldb, index(d.out), d.n]


def build_program(exe, inline, big: bool = False) -> Program:
    """Split ``exe``'s schedule (a CpuExecutable) into driver segments and Python entries;
    ``inline(step)`` says whether a schedule entry's single step is a kernel that runs on the
    calling thread.  ``big``: tile-claiming steps of any size are shared driver steps (the
    program of calls that get the helper, ``SHARE_BIG``); otherwise, where ``SHARE_BIG`` is on
    and that changes anything, the result's ``big`` is that program."""
    from ..codegen import driver as D
    from .blas import BlasStep
    from .gemm_step import GemmStep
    root = exe._root
    pool = getattr(exe, "_pool", None)
    # a helper thread needs a pool worker to run it and sched_yield for the spin-waits
    threads = pool.num_threads if HELPER and pool is not None and D.sched_yield_address() else 1
    # small generated matmuls shared with the helper (GemmStep.shares_tiles): only where the
    # helper is the pool's one worker (a larger pool gives a pool dispatch more threads)
    share = threads == 2
    scratch: dict = {}
    slots = exe.memory.slots
    graph = exe.graph
    index: dict = {}
    packed: dict = {}       # constant GEMM operands packed once, by a key that is no graph value

    def idx(v):
        i = index.get(v)
        if i is None:
            i = index[v] = len(index)
        return i

    entries: list = []
    segments: list = []
    cur: dict = {}

    def flush():
        if cur.get("steps"):
            words = cur["words"]
            dyn = []
            for v in cur["touched"]:
                if v in slots or v in exe.constants or v in exe._error_nodes:
                    continue        # fixed addresses: arena slots, constants, error words
                t = graph.types[v]
                dyn.append((v, index[v], np.dtype(t.np_dtype), int(np.prod(t.shape, dtype=np.int64))))
            prog = (ctypes.c_int64 * len(words))(*words)
            segments.append(Segment(prog, len(cur["steps"]) + cur["extra"], max(1, cur["maxargs"]),
                                    tuple(cur["fresh"]), tuple(cur["views"]), tuple(dyn),
                                    tuple(cur["steps"]), cur["first"], cur.get("parallel", False)))
            entries.append(("drive", len(segments) - 1))
        elif cur.get("views"):      # reshapes with no kernel after them: run as usual
            entries.extend(cur["pending"])
        cur.clear()

    def start(k):
        if not cur:
            cur.update(words=[], steps=[], fresh=[], views=[], touched={}, maxargs=1, first=k, pending=[],
                       extra=0)

    for k, (kind, item) in enumerate(exe._schedule):
        if kind == "kernels" and len(item) == 1 and inline(item[0]):
            s = item[0]
            start(k)
            vals = [root.get(v, v) for v in s.param_values]
            cur["words"] += [0, s.compiled.address, 0, s.compiled.parallel_extent or 0, len(vals),
                             *(idx(v) for v in vals)]
            cur["maxargs"] = max(cur["maxargs"], len(vals))
        elif kind == "step" and isinstance(item, BlasStep) and item._lib is not None \
                and (words := _blas_words(item, idx, root, graph.types)) is not None:
            s = item
            if cur.get("parallel"):
                flush()     # OpenBLAS's threads and a spinning helper would share the cores
            start(k)
            cur["blas"] = True
            d = s.desc
            vals = [root.get(v, v) for v in (d.a, d.b, d.out) + ((d.acc,) if d.acc is not None else ())]
            cur["words"] += words
            cur["extra"] += 1 if d.acc is not None else 0
        elif kind == "step" and getattr(item, "noop", False):
            continue        # a concat whose inputs were all written in place (runtime/concat.py)
        elif kind == "step" and isinstance(item, GemmStep) \
                and (call := item.driver_call(exe.constants, graph.types, shared=share, big=big)) is not None:
            s = item        # a generated GEMM or direct conv
            address, extent, args, more = call
            par = threads > 1 and extent > 1 and item.work() >= HELPER_MIN_WORK and not item.claims_tiles
            tiles = share and item.shares_tiles(big)
            if (par or tiles) and cur.get("blas"):
                flush()
            start(k)
            packed.update(more)
            if tiles:
                # caller and helper each make one call (chunks [0, 1) and [1, 2)) claiming tiles
                # from this step's counter in the arena, zeroed first (codegen/gemm_ir.py)
                ctr = f"\0tile_counter:{k}"
                scratch[ctr] = words = item.counter_words()
                packed[_ZEROS] = _ZERO_WORDS
                args = (*args[:-1], ctr)
                # a conv's copies: per arena, shared by the convs of their kind and size only
                # (a row-reading conv's slack after its padded copy and its side copy's columns
                # past the tail are never written, so they stay zero)
                subst = {}
                for stand, (what, n) in item.scratch_buffers().items():
                    subst[stand] = key = f"{stand}:{what}:{n}"
                    scratch[key] = -(-n // 2)
                args = tuple(subst.get(v, v) for v in args)
            ids = [idx(root.get(v, v)) for v in args]
            src = None
            if tiles and (pre := item.copy_call()) is not None:
                # the copy first (one call, on the calling thread), from the conv's input
                src = root.get(item.head_names()[1], item.head_names()[1])
                cur["words"] += [0, pre[0], 0, pre[1], 2, idx(subst[pre[2]]), idx(src)]
                cur["extra"] += 1
                cur["maxargs"] = max(cur["maxargs"], 2)
            if tiles:
                cur["words"] += [D.COPY, idx(ctr), idx(_ZEROS), 8 * words, D.PARALLEL, address, 1, 2, len(args),
                                 *ids]
                cur["extra"] += 1
                cur["parallel"] = True
            elif par:
                # run with the call's helper thread: chunks of about a quarter of a thread's share
                chunk = max(item.min_chunk(), -(-extent // (4 * threads)))
                cur["words"] += [D.PARALLEL, address, chunk, extent, len(args), *ids]
                cur["parallel"] = True
            else:
                cur["words"] += [0, address, 0, extent, len(args), *ids]
            cur["maxargs"] = max(cur["maxargs"], len(args))
            vals = [root.get(v, v) for v in args if v not in more and v not in scratch] + ([src] if src else [])
        elif kind == "step" and item.outputs and item.outputs[0] in root and not hasattr(item, "execute"):
            start(k)       # a reshape: a view made before the segment runs
            cur["views"].append((item.outputs[0], item.inputs[0], tuple(graph.types[item.outputs[0]].shape)))
            cur["pending"].append((kind, item))
            continue
        else:
            flush()
            entries.append((kind, item))
            continue
        cur["steps"].append(s)
        cur["pending"].append((kind, item))
        cur["fresh"] += [v for v in s.outputs if v in exe._fresh]
        for v in vals:
            cur["touched"][v] = None
    flush()
    consts = {v: exe.constants[v] for v in index if v in exe.constants}
    consts.update(packed)
    prog = Program(entries, segments, index, consts, scratch)
    if SHARE_BIG and share and not big:
        other = build_program(exe, inline, big=True)
        if len(other.entries) < len(entries):
            prog.big = other
    return prog


def helper_wanted() -> bool:
    """Whether this call asks for the helper thread: ``HELPER`` True, or "auto" while the gate
    finds two cores free of other processes."""
    return HELPER is True or (bool(HELPER) and _QUIET())


def run_segment(exe, seg: Segment, tables: DriverTables, k: int, env: dict, out, arena, offset,
                helper: bool = True) -> None:
    """Bind ``seg``'s outputs and views in ``env``, then run it with one native call (a parallel
    segment with the helper thread where ``helper``, the call's :func:`helper_wanted`)."""
    fresh = exe._fresh
    for v in seg.fresh:
        if v in out:
            env[v] = out[v]
        else:
            env[v] = arena.output_buffer(v, *fresh[v])
    for o, i, shape in seg.views:
        env[o] = env[i].reshape(shape)
    objs = tables.objs[k][0]
    values = tables.values
    for j, (v, i, dt, n) in enumerate(seg.dynamic):
        a = env[v]
        if type(a) is not np.ndarray or a.dtype != dt or not a.flags.c_contiguous or a.size < n:
            a = _checked(a, v, dt, n)
            env[v] = a
        if offset is None:
            values[i] = a.ctypes.data
        else:
            objs[2 * j + 1] = id(a)
    block, block_address = tables.blocks[k]
    if seg.parallel:
        block[7] = helper and _start_helper(exe._pool, tables) or 0
    exe._driver_fn(block_address)


def _start_helper(pool, tables: DriverTables):
    """Reset the call's shared state and queue one helper (``apollo_help``) on ``pool``; returns
    the state's address for the driver, or None (no worker: the caller runs every chunk)."""
    from ..codegen.driver import SYNC_WORDS, help_function, sched_yield_address
    from .threadpool import _Job
    if pool is None or pool.num_threads < 2 or pool._closed:
        return None
    sync = tables.sync
    # word 6 (joined) last: a helper of an earlier call that comes late can join this call only
    # once the rest is reset (it would otherwise see the old finish flag, leave, and have its
    # "left" flag wiped, and the call would wait for it forever)
    ctypes.memset(tables.sync_address, 0, 8 * 6)
    sync[7] = sync[8] = 0
    sync[SYNC_WORDS - 1] = sched_yield_address()
    sync[6] = 0
    pool._post(_Job([(help_function(), sync, 0, 0)]))
    return tables.sync_address


def _checked(a, v: str, dt, n: int) -> np.ndarray:
    """``a`` as a C-contiguous base-class ndarray of dtype ``dt`` with at least ``n`` elements
    (a numpy scalar or a subclass is converted), or InputError naming buffer ``v``."""
    if isinstance(a, (np.ndarray, np.generic)) and a.dtype == dt:
        a = np.ascontiguousarray(a).view(np.ndarray)
        if a.size >= n:
            return a
    raise InputError(f"buffer {v!r} needs a C-contiguous {dt} array of {n} elements, got "
                     f"{type(a).__name__} {getattr(a, 'dtype', '')} {getattr(a, 'shape', '')}")
