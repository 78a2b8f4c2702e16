"""A persistent thread pool that runs chunks of a kernel's parallel loop on all cores.

Kernels follow the CPU ABI ``void f(void **args, int64 lo, int64 hi)``; ctypes releases the
GIL for the duration of each call, so plain Python threads run chunks truly in parallel.
Workers are started once and wait on a queue -- first spinning for up to :data:`SPIN_US` in
native code while the cores are free of other processes (a worker blocked on the queue takes
0.1-0.3 ms to start on an idle VM); each :meth:`ThreadPool.run` splits
``[0, extent)`` into contiguous chunks (a few per thread), wakes up to ``num_threads - 1``
workers and works on the chunks itself too; chunks are claimed dynamically, so a worker
slowed down by other load takes fewer of them.  Several Python threads may call ``run`` at once: each
call has its own job object, and a caller always makes progress on its own job.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import queue
import threading
import time
import weakref
from typing import Optional

from apollo_py.cpuload import QuietGate
from apollo_py.errors import CompileError

#: microseconds a worker that finds no job spins for one (``codegen.driver.spin_ir``: native,
#: GIL released) before it blocks on the queue; only while :data:`QUIET` says other processes
#: leave two cores free (on a busy machine the spin would take a core from them).  0: never.
#: Off: on the quiet 2-core box (2026-11-25 13:21, load 1.1) 500 us made a lone 0.15 ms pool conv
#: 0.75x (called back to back) but whole models 0.97-1.03x (ResNet-50 1.02, BERT 1.03, U-Net
#: 0.97, the mobile CNNs 1.00) -- their pool steps are rarely that short or that close.
SPIN_US = 0.0
#: whether the cores are free of other processes (shared with runtime/drive.py's helper thread)
QUIET = QuietGate()
_cycles_per_us: list = []      # the cycle counter's rate, measured by the first worker that spins


class _Job:
    """One dispatch: a list of ``(cfunc, ptrs, lo, hi)`` chunks (of one or several kernels)."""

    __slots__ = ("chunks", "next", "lock", "remaining", "done", "error")

    def __init__(self, chunks):
        self.chunks = chunks
        self.next = 0
        self.lock = threading.Lock()
        self.remaining = len(chunks)
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def work(self) -> None:
        """Claim and run chunks until none are left."""
        chunks = self.chunks
        n = len(chunks)
        while True:
            with self.lock:
                k = self.next
                if k >= n:
                    return
                self.next = k + 1
            cfunc, ptrs, lo, hi = chunks[k]
            err = None
            try:
                cfunc(ptrs, lo, hi)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the caller thread
                err = exc
            with self.lock:
                if err is not None and self.error is None:
                    self.error = err        # the first error, as run() promises
                self.remaining -= 1
                if self.remaining == 0:
                    self.done.set()


class _Lent:
    """One call lent to the workers (:meth:`ThreadPool.lend`)."""

    __slots__ = ("cfunc", "ptrs", "lo", "hi", "keep")

    def __init__(self, cfunc, ptrs, lo, hi, keep):
        self.cfunc, self.ptrs, self.lo, self.hi, self.keep = cfunc, ptrs, lo, hi, keep

    def work(self) -> None:
        try:
            self.cfunc(self.ptrs, self.lo, self.hi)
        except BaseException:  # noqa: BLE001 - the caller's own call did the work
            pass


class ThreadPool:
    """Persistent worker threads that run kernel chunks.

    ``num_threads`` is the total parallelism including the calling thread (default
    ``os.cpu_count()``); ``num_threads - 1`` daemon workers are started on construction.
    Each run is cut into up to ``chunks_per_thread * num_threads`` chunks that threads claim
    one at a time, so a thread slowed down by other processes on the machine takes fewer.
    """

    def __init__(self, num_threads: Optional[int] = None, chunks_per_thread: int = 4):
        n = int(num_threads or os.cpu_count() or 1)
        if n < 1 or chunks_per_thread < 1:
            raise CompileError(f"ThreadPool needs num_threads >= 1 and chunks_per_thread >= 1, "
                               f"got {num_threads}, {chunks_per_thread}")
        self.num_threads = n
        self.chunks_per_thread = int(chunks_per_thread)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        # bumped after every put: a spinning worker (``_wait_spinning``) watches it
        self._posted = (ctypes.c_int64 * 1)()
        self._posted_address = ctypes.addressof(self._posted)
        self._workers = []
        self._closed = False
        for i in range(n - 1):
            t = threading.Thread(target=self._worker, name=f"apollo-pool-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        _LIVE.add(self)

    def _post(self, item) -> None:
        """Queue ``item`` (a job, a lent call, or None: stop) for one worker."""
        self._queue.put(item)
        self._posted[0] += 1

    def _worker(self) -> None:
        while True:
            seen = self._posted[0]
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                job = self._wait_spinning(seen)
            if job is None:
                return
            job.work()

    def _wait_spinning(self, seen: int):
        """The next queue item: spin (natively) until a post or :data:`SPIN_US` has passed, while
        the cores are free, then block on the queue."""
        if SPIN_US > 0 and QUIET():
            from ..codegen.driver import spin_functions
            fns = spin_functions()
            if fns is not None:
                spin, cycles = fns
                if not _cycles_per_us:
                    c0, t0 = cycles(), time.perf_counter()
                    time.sleep(0.002)
                    _cycles_per_us.append(max(1.0, (cycles() - c0) / ((time.perf_counter() - t0) * 1e6)))
                if spin(self._posted_address, seen, int(SPIN_US * _cycles_per_us[0])):
                    try:
                        return self._queue.get_nowait()
                    except queue.Empty:
                        pass
        return self._queue.get()

    @staticmethod
    def split(extent: int, parts: int) -> list:
        """Return ``parts`` contiguous ``(lo, hi)`` chunks covering ``[0, extent)``, as even
        as possible (sizes differ by at most one, larger chunks first)."""
        parts = max(1, min(parts, extent))
        base, extra = divmod(extent, parts)
        out, lo = [], 0
        for k in range(parts):
            hi = lo + base + (1 if k < extra else 0)
            out.append((lo, hi))
            lo = hi
        return out

    def run(self, kernel, arrays, extent: Optional[int] = None, min_chunk: int = 1) -> None:
        """Run ``kernel`` (a compiled kernel with ``pack_args``/``cfunc``) over ``[0, extent)``.

        ``arrays`` are the kernel's buffers (checked by ``kernel.pack_args``); ``extent``
        defaults to ``kernel.parallel_extent``.  Chunks hold at least ``min_chunk``
        iterations; when only one chunk results (small extent, one thread, or a kernel
        without a parallel loop) the kernel runs inline on the calling thread.  Returns
        when every chunk has finished; re-raises the first error from any chunk.
        """
        if extent is None:
            extent = kernel.parallel_extent or 0
        extent = int(extent)
        ptrs = kernel.pack_args(arrays)
        parts = min(self.num_threads * self.chunks_per_thread, extent // max(1, int(min_chunk)))
        if parts <= 1 or self.num_threads == 1 or kernel.parallel_extent is None:
            kernel.cfunc(ptrs, 0, extent)
            return
        cfunc = kernel.cfunc
        self._dispatch([(cfunc, ptrs, lo, hi) for lo, hi in self.split(extent, parts)])

    def run_many(self, items) -> None:
        """Run several independent kernels as one dispatch (layer 3's parallel stitching).

        ``items`` are ``(kernel, arrays)`` or ``(kernel, arrays, max_parts)`` tuples whose
        kernels neither read nor write each other's outputs; each kernel's parallel loop is
        cut as in :meth:`run` (into at most ``max_parts`` chunks when given) and the threads
        claim chunks of all of them from one list, so small kernels share the machine instead
        of each paying a wake-up.  Returns when all chunks are done; re-raises the first error.
        """
        chunks = []
        per = self.num_threads * self.chunks_per_thread
        for item in items:
            kernel, arrays = item[0], item[1]
            parts = min(per, int(item[2])) if len(item) > 2 else per
            ptrs = kernel.pack_args(arrays)
            extent = kernel.parallel_extent
            if extent is None or extent <= 1 or self.num_threads == 1 or parts <= 1:
                chunks.append((kernel.cfunc, ptrs, 0, int(extent or 0)))
            else:
                chunks.extend((kernel.cfunc, ptrs, lo, hi) for lo, hi in self.split(extent, min(parts, extent)))
        if self.num_threads == 1 or len(chunks) == 1:
            for cfunc, ptrs, lo, hi in chunks:
                cfunc(ptrs, lo, hi)
            return
        self._dispatch(chunks)

    def lend(self, cfunc, ptrs, lo: int, hi: int, keep=None) -> None:
        """Hand the call ``cfunc(ptrs, lo, hi)`` to each worker without waiting for it: for a
        kernel whose calls share their work through a counter of their own and whose
        caller's call returns only when all of it is done (codegen/gemm_ir.py), so that a
        worker that wakes late finds nothing left.  ``keep`` (the arrays behind ``ptrs``) is
        held until every worker has made its call.  Errors of a lent call are dropped (the
        kernels it is for cannot raise).  A closed pool lends nothing."""
        if self._closed:
            return
        lent = _Lent(cfunc, ptrs, lo, hi, keep)
        for _ in range(self.num_threads - 1):
            self._post(lent)

    def _dispatch(self, chunks) -> None:
        job = _Job(chunks)
        # a closed pool (close(), or interpreter exit under a daemon caller) has no workers:
        # the caller runs every chunk itself.  A job queued after the workers left is harmless
        # too: the caller claims all of its chunks.
        for _ in range(0 if self._closed else min(len(chunks), self.num_threads) - 1):
            self._post(job)
        job.work()
        job.done.wait()
        if job.error is not None:
            raise job.error

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop the workers (idempotent); later runs execute on the calling thread alone.  Each worker
        finishes the chunk it is running first; ``timeout`` bounds the wait per worker."""
        if self._closed:
            return
        self._closed = True
        for _ in self._workers:
            self._post(None)
        for t in self._workers:
            t.join(timeout)

    def __enter__(self) -> "ThreadPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


#: every pool not yet garbage-collected, closed at interpreter exit
_LIVE: "weakref.WeakSet[ThreadPool]" = weakref.WeakSet()


@atexit.register
def _close_pools_at_exit() -> None:
    """Stop every pool's workers when the interpreter exits (after the program's own non-daemon
    threads have been joined): daemon workers would otherwise be frozen wherever they are while
    the interpreter tears down the modules they use.  A worker still inside a kernel chunk (a
    daemon caller thread's job) gets 5 s to finish it."""
    for pool in list(_LIVE):
        pool.close(timeout=5.0)
