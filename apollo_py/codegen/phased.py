"""Phases with a barrier between them: one kernel's parallel loop run by several threads in order.

A *phased* kernel (the recurrent time loop, ``codegen/recurrent.py``'s
``recurrent_phased_kernel``) has a parallel loop of ``phases * chunks`` iterations: the
``chunks`` iterations of one phase are independent, but a phase reads what the earlier ones
wrote.  One call over the whole range is correct (it runs the phases in order); the thread
pool's usual split into contiguous ranges is not.  ``apollo_phased(ctl, lo, hi)`` (the pool's
kernel ABI) runs it on every thread that calls it: per phase, each caller claims chunks until
none are left, then waits until every chunk of the phase is finished.  ``ctl`` is an int64
array::

    [0] kernel address   [1] its args (void **)   [2] phases   [3] chunks   [4] sched_yield or 0
    [5] workers that joined
    [8 + 16 * ph]  claim word of phase ph: front claims (low 32 bits) | back claims (high 32)
    [16 + 16 * ph] chunks of phase ph finished

(each phase's words on a cache line of their own; zero before the run).  The call with
``lo == 0`` (the caller's) claims chunks from the front (0, 1, ...), the others (the pool's
workers, handed the call by ``ThreadPool.lend``) from the back, so that on a quiet machine each
thread takes the same chunks phase after phase and keeps its rows of the weights in its own
cache; a claim is valid while the front and back claims before it number fewer than
``chunks``.  Nobody ever waits for a thread that has not claimed a chunk, so a worker that
wakes late (or never) costs nothing: the caller claims every chunk itself; a worker that finds
the run over walks the spent phases and returns.  Waits spin with ``pause`` and call
``sched_yield`` after ``SPINS`` rounds (a preempted thread on a loaded machine).
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from ..errors import CompileError

#: pause loops before a waiting thread yields its core instead
SPINS = 1000
#: pause loops a thread leaves the other thread's chunks of a phase to it before taking them
STEAL_SPINS = 288
#: ... of which the last are sched_yield calls instead of pauses
STEAL_YIELDS = 32
#: int64 words of ``ctl`` before the first phase's counters, and per phase
HEAD, STRIDE = 8, 16

PHASED_CFUNCTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)

#: False: :func:`run_phased` runs every phase on the calling thread (one sequential call), for
#: A/B runs against the two-thread form (as ``runtime/drive.py``'s ``HELPER`` switch)
ENABLED = True


def phased_ir(x86: bool) -> str:
    """LLVM IR text of ``apollo_phased`` (see the module docstring)."""
    pause = ["  call void @llvm.x86.sse2.pause()"] if x86 else []
    return "\n".join([
        "define void @apollo_phased(ptr %ctl, i64 %lo, i64 %hi) {",
        "entry:",
        "  %fnw = load i64, ptr %ctl",
        "  %pa = getelementptr i64, ptr %ctl, i64 1", "  %argw = load i64, ptr %pa",
        "  %pp = getelementptr i64, ptr %ctl, i64 2", "  %nph = load i64, ptr %pp",
        "  %pc = getelementptr i64, ptr %ctl, i64 3", "  %nch = load i64, ptr %pc",
        "  %py = getelementptr i64, ptr %ctl, i64 4", "  %yw = load i64, ptr %py",
        "  %pj = getelementptr i64, ptr %ctl, i64 5",
        "  %fn = inttoptr i64 %fnw to ptr", "  %args = inttoptr i64 %argw to ptr",
        "  %yf = inttoptr i64 %yw to ptr", "  %hasy = icmp ne i64 %yw, 0",
        "  %front = icmp eq i64 %lo, 0",
        "  %inc = select i1 %front, i64 1, i64 4294967296",
        "  %nch1 = add i64 %nch, 1", "  %nfront = lshr i64 %nch1, 1", "  %nback = sub i64 %nch, %nfront",
        "  %own = select i1 %front, i64 %nfront, i64 %nback",
        "  br i1 %front, label %phase, label %join",
        "join:",
        "  %jd = atomicrmw add ptr %pj, i64 1 seq_cst",
        "  br label %phase",
        "phase:",
        "  %ph = phi i64 [0, %entry], [0, %join], [%ph1, %next]",
        "  %more = icmp slt i64 %ph, %nph",
        "  br i1 %more, label %pbody, label %ret",
        "pbody:",
        f"  %w0 = mul i64 %ph, {STRIDE}", f"  %w1 = add i64 %w0, {HEAD}",
        "  %claim = getelementptr i64, ptr %ctl, i64 %w1",
        "  %done = getelementptr i64, ptr %claim, i64 8",
        "  %base = mul i64 %ph, %nch",
        "  br label %look",
        # claim: a chunk of this thread's side first; the other side's only once that thread
        # has had STEAL_SPINS pauses to claim it (or has not joined the run at all)
        "look:",
        "  %spin = phi i64 [0, %pbody], [%spin1, %hpause], [%spin1, %hyield], [%spin, %try], [0, %run]",
        "  %w = load atomic i64, ptr %claim acquire, align 8",
        "  %f = and i64 %w, 4294967295",
        "  %b = lshr i64 %w, 32",
        "  %fb = add i64 %f, %b",
        "  %left = icmp slt i64 %fb, %nch",
        "  br i1 %left, label %decide, label %wait",
        "decide:",
        "  %mine = select i1 %front, i64 %f, i64 %b",
        "  %isown = icmp slt i64 %mine, %own",
        "  br i1 %isown, label %try, label %steal",
        "steal:",
        "  %jn = load atomic i64, ptr %pj acquire, align 8",
        "  %joined = icmp ne i64 %jn, 0",
        "  %patient = select i1 %front, i1 %joined, i1 true",
        f"  %young = icmp ult i64 %spin, {STEAL_SPINS}",
        "  %holdit = and i1 %patient, %young",
        "  br i1 %holdit, label %hold, label %try",
        # pauses first; then yields, for a machine where the other thread waits for this core
        "hold:",
        "  %spin1 = add i64 %spin, 1",
        f"  %calm = icmp ult i64 %spin, {STEAL_SPINS - STEAL_YIELDS}",
        "  %noy = xor i1 %hasy, true",
        "  %dopause = or i1 %calm, %noy",
        "  br i1 %dopause, label %hpause, label %hyield",
        "hpause:", *pause, "  br label %look",
        "hyield:", "  %hyr = call i32 %yf()", "  br label %look",
        "try:",
        "  %wn = add i64 %w, %inc",
        "  %cr = cmpxchg ptr %claim, i64 %w, i64 %wn seq_cst seq_cst",
        "  %cok = extractvalue { i64, i1 } %cr, 1",
        "  br i1 %cok, label %run, label %look",
        "run:",
        "  %bk0 = sub i64 %nch, 1", "  %bk = sub i64 %bk0, %b",
        "  %c = select i1 %front, i64 %f, i64 %bk",
        "  %i = add i64 %base, %c", "  %i1 = add i64 %i, 1",
        "  call void %fn(ptr %args, i64 %i, i64 %i1)",
        "  %dd = atomicrmw add ptr %done, i64 1 seq_cst",
        "  br label %look",
        "wait:",
        "  %ws = phi i64 [0, %look], [%ws1, %wpause], [0, %wyield]",
        "  %nd = load atomic i64, ptr %done acquire, align 8",
        "  %alld = icmp sge i64 %nd, %nch",
        "  br i1 %alld, label %next, label %wmore",
        "wmore:",
        "  %ws1 = add i64 %ws, 1",
        f"  %many = icmp ugt i64 %ws1, {SPINS}",
        "  %doy = and i1 %many, %hasy",
        "  br i1 %doy, label %wyield, label %wpause",
        "wpause:", *pause, "  br label %wait",
        "wyield:", "  %yr = call i32 %yf()", "  br label %wait",
        "next:",
        "  %ph1 = add i64 %ph, 1",
        "  br label %phase",
        "ret:",
        "  ret void",
        "}",
        *(["declare void @llvm.x86.sse2.pause()"] if x86 else []),
    ]) + "\n"


_lock = threading.Lock()
_state: dict = {}


def phased_function():
    """The process-wide compiled ``apollo_phased`` as a ctypes function (compiled on first use)."""
    with _lock:
        fn = _state.get("fn")
        if fn is None:
            from .driver import jit_module
            from .llvm import host
            x86 = host().triple.split("-")[0] in ("x86_64", "i386", "i686")
            engine = jit_module(phased_ir(x86), "phased runner")
            address = engine.get_function_address("apollo_phased")
            if not address:
                raise CompileError("phased runner: apollo_phased has no address")
            _state["engine"] = engine       # owns the code
            fn = _state["fn"] = PHASED_CFUNCTYPE(address)
        return fn


def run_phased(pool, kernel, arrays, phases: int) -> None:
    """Run ``kernel`` (a compiled phased kernel whose parallel extent is ``phases`` times its
    chunks per phase) over its whole range on the calling thread and ``pool``'s workers,
    phase after phase; returns when every phase is finished."""
    ptrs = kernel.pack_args(arrays)
    extent = int(kernel.parallel_extent or 0)
    if not ENABLED or pool is None or pool.num_threads < 2 or phases < 1 or extent % phases or extent == phases:
        kernel.cfunc(ptrs, 0, extent)
        return
    from .driver import sched_yield_address
    ctl = np.zeros(HEAD + STRIDE * phases, np.int64)
    ctl[:5] = (kernel.address, ctypes.addressof(ptrs), phases, extent // phases, sched_yield_address())
    fn = phased_function()
    address = ctl.ctypes.data
    # each worker's call holds ctl, the argument array and the arrays until it has returned
    pool.lend(fn, address, 1, 2, (ctl, ptrs, arrays))
    fn(address, 0, 1)
