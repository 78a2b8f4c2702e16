"""Native spin-wait of the thread pool's workers (runtime/threadpool.py): a worker that has just
finished a job stays in native code for a short while, ready to run the next lent call at once.

A pool dispatch from Python wakes a worker blocked on the job queue: a futex wake-up, then the
GIL, often tens of microseconds before the worker's kernel call starts -- most of a 100 us
GEMM of a transformer layer, whose caller meanwhile does the tiles alone (on the quiet box the
zoo's 128 x 768 x 768 products ran at 62% of the 2-core peak against 90% for one core's
kernel).  Instead, after each job the worker calls ``apollo_pool_spin(box, budget)`` (GIL
released) and polls its mailbox ``box`` (``BOX_WORDS`` int64):

* word 0, state: 0 the worker is in Python (blocked on the queue or running a job), 1 it spins
  and accepts a call, 2 a call is posted, 3 it runs the posted call, 4 a caller is writing one;
* words 1-4: the posted call ``fn(args, lo, hi)`` (the kernel ABI);
* word 5: set by the pool when it queued a job for Python (``ThreadPool.run``): the worker
  leaves the spin and takes it from the queue.

``apollo_pool_post(box, fn, args, lo, hi)`` (the caller, ``ThreadPool.lend``) claims a spinning
mailbox with a compare-and-swap 1 -> 4, writes the call and publishes it (state 2); it returns
0 when the worker is not spinning (the caller then queues the call as before).  The worker
runs the call, sets the state back to 1 (so a caller's next post, which needs state 1, proves
the last call has returned: its arrays may go), and keeps spinning.  After ``budget``
time-stamp-counter cycles without a call it leaves with a compare-and-swap 1 -> 0 (a post that
won the race is run first) and blocks on the queue again; every 256 polls it calls
``sched_yield`` so that on a busy machine the spin gives its core to a runnable thread.
"""
from __future__ import annotations

import ctypes
import threading

from ..errors import CompileError

BOX_WORDS = 8
#: time-stamp-counter cycles a worker spins without a call before it blocks (~0.3-0.7 ms)
SPIN_CYCLES = 1_500_000

SPIN_CFUNCTYPE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p)
POST_CFUNCTYPE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                  ctypes.c_int64, ctypes.c_int64)


def spin_ir(x86: bool) -> str:
    """LLVM IR of ``apollo_pool_spin(box, budget, sched_yield)`` and ``apollo_pool_post``."""
    pause = ["  call void @llvm.x86.sse2.pause()"] if x86 else []
    lines = [
        "declare i64 @llvm.readcyclecounter()",
        *(["declare void @llvm.x86.sse2.pause()"] if x86 else []),
        "define i64 @apollo_pool_spin(ptr %box, i64 %budget, ptr %yield) {",
        "entry:",
        "  %t0 = call i64 @llvm.readcyclecounter()",
        "  %tl = alloca i64, align 8",
        "  store i64 %t0, ptr %tl",
        "  %wfn = getelementptr i64, ptr %box, i64 1",
        "  %warg = getelementptr i64, ptr %box, i64 2",
        "  %wlo = getelementptr i64, ptr %box, i64 3",
        "  %whi = getelementptr i64, ptr %box, i64 4",
        "  %wpy = getelementptr i64, ptr %box, i64 5",
        "  store atomic i64 1, ptr %box release, align 8",
        "  br label %loop",
        "loop:",
        "  %n = phi i64 [0, %entry], [%n1, %idle], [0, %ran], [0, %yld], [0, %doy], [%n, %lost]",
        "  %s = load atomic i64, ptr %box acquire, align 8",
        "  %posted = icmp eq i64 %s, 2",
        "  br i1 %posted, label %run, label %chk",
        "run:",
        "  %fnw = load i64, ptr %wfn", "  %fn = inttoptr i64 %fnw to ptr",
        "  %argw = load i64, ptr %warg", "  %args = inttoptr i64 %argw to ptr",
        "  %lo = load i64, ptr %wlo", "  %hi = load i64, ptr %whi",
        "  store atomic i64 3, ptr %box monotonic, align 8",
        "  call void %fn(ptr %args, i64 %lo, i64 %hi)",
        "  store atomic i64 1, ptr %box release, align 8",
        "  %t1 = call i64 @llvm.readcyclecounter()",
        "  store i64 %t1, ptr %tl",
        "  br label %ran",
        "ran:",
        "  br label %loop",
        "chk:",
        "  %py = load atomic i64, ptr %wpy acquire, align 8",
        "  %pyset = icmp ne i64 %py, 0",
        "  br i1 %pyset, label %leavepy, label %idle",
        "leavepy:",
        "  %cp = cmpxchg ptr %box, i64 1, i64 0 acq_rel acquire",
        "  %cpok = extractvalue { i64, i1 } %cp, 1",
        "  br i1 %cpok, label %retpy, label %lost",
        "retpy:",
        "  store atomic i64 0, ptr %wpy release, align 8",
        "  ret i64 1",
        "lost:",        # a call was posted (or is being written) meanwhile: run it first
        "  br label %loop",
        "idle:",
        "  %n1 = add i64 %n, 1",
        *pause,
        "  %m = and i64 %n1, 255",
        "  %chkt = icmp eq i64 %m, 0",
        "  br i1 %chkt, label %tm, label %loop",
        "tm:",
        "  %tn = call i64 @llvm.readcyclecounter()",
        "  %ts = load i64, ptr %tl",
        "  %el = sub i64 %tn, %ts",
        "  %over = icmp ugt i64 %el, %budget",
        "  br i1 %over, label %leave, label %yld",
        "yld:",
        "  %hasy = icmp ne ptr %yield, null",
        "  br i1 %hasy, label %doy, label %loop",
        "doy:",
        "  %yr = call i32 %yield()",
        "  br label %loop",
        "leave:",
        "  %cl = cmpxchg ptr %box, i64 1, i64 0 acq_rel acquire",
        "  %clok = extractvalue { i64, i1 } %cl, 1",
        "  br i1 %clok, label %ret0, label %lost",
        "ret0:",
        "  ret i64 0",
        "}",
        "define i64 @apollo_pool_post(ptr %box, ptr %fn, ptr %args, i64 %lo, i64 %hi) {",
        "entry:",
        "  %c = cmpxchg ptr %box, i64 1, i64 4 acq_rel monotonic",
        "  %ok = extractvalue { i64, i1 } %c, 1",
        "  br i1 %ok, label %w, label %no",
        "w:",
        "  %wfn = getelementptr i64, ptr %box, i64 1", "  %fnw = ptrtoint ptr %fn to i64",
        "  store i64 %fnw, ptr %wfn",
        "  %warg = getelementptr i64, ptr %box, i64 2", "  %argw = ptrtoint ptr %args to i64",
        "  store i64 %argw, ptr %warg",
        "  %wlo = getelementptr i64, ptr %box, i64 3", "  store i64 %lo, ptr %wlo",
        "  %whi = getelementptr i64, ptr %box, i64 4", "  store i64 %hi, ptr %whi",
        "  store atomic i64 2, ptr %box release, align 8",
        "  ret i64 1",
        "no:",
        "  ret i64 0",
        "}",
    ]
    return "\n".join(lines) + "\n"


_lock = threading.Lock()
_state: dict = {}


def spin_functions():
    """``(spin, post, sched_yield address)``: the process-wide compiled functions as ctypes
    functions (compiled on first use; calls release the GIL), or None where they cannot be
    built (the pool then queues every call, as before)."""
    with _lock:
        if "fns" not in _state:
            try:
                _state["fns"] = _build()
            except (CompileError, RuntimeError, OSError):
                _state["fns"] = None
        return _state["fns"]


def _build():
    from .driver import sched_yield_address
    from .llvm import _compile_lock, host
    h = host()
    x86 = h.triple.split("-")[0] in ("x86_64", "i386", "i686")
    with _compile_lock:
        try:
            mod = h.llvm.parse_assembly(spin_ir(x86))
            mod.verify()
        except RuntimeError as exc:
            raise CompileError(f"pool spin: invalid LLVM IR: {exc}") from exc
        mod.triple = h.triple
        engine = h.llvm.create_mcjit_compiler(mod, h.target_machine())
        engine.finalize_object()
    spin = engine.get_function_address("apollo_pool_spin")
    post = engine.get_function_address("apollo_pool_post")
    if not spin or not post:
        raise CompileError("pool spin: functions have no address")
    _state["engine"] = engine       # owns the code
    return SPIN_CFUNCTYPE(spin), POST_CFUNCTYPE(post), sched_yield_address() or None
