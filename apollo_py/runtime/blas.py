"""Direct calls into the BLAS numpy was built with, for matmul steps folded by
:mod:`apollo_py.layers.blas_fold`.

numpy's matmul cannot take a transposed operand without looking at strides, cannot accumulate
into its output (``C = alpha * op(A) @ op(B) + beta * C``) and allocates a fresh result.  A
:class:`BlasStep` calls ``cblas_sgemm`` / ``cblas_dgemm`` itself: transposes folded into the
``trans`` flags, a scaled update ``P - c * A @ B`` folded into ``alpha`` and ``beta = 1``, the
result written into the runtime's own buffer (an arena slot, a recycled output or the caller's
``out=`` array, which may be ``P`` itself for an in-place update).

The library is the one numpy links (``numpy.libs/libscipy_openblas*`` in the PyPI wheels).
:func:`cblas` returns None where it cannot be found (another numpy build): the lowering then
keeps matmul as a numpy step, which is always correct.
"""
from __future__ import annotations

import ctypes
import threading

import numpy as np

from ..codegen.blas_info import loaded_libraries
from ..errors import InputError
from ..layers.blas_fold import BlasDesc

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112

# (symbol prefix, integer type): ILP64 builds first (numpy >= 2 wheels), then LP64 ones
_FLAVOURS = (("scipy_cblas_{}64_", ctypes.c_int64), ("cblas_{}64_", ctypes.c_int64),
             ("scipy_cblas_{}", ctypes.c_int), ("cblas_{}", ctypes.c_int))

_lock = threading.Lock()
_loaded: dict = {}


class Cblas:
    """``gemm(dtype, ...)``: the cblas ``?gemm`` of one library (float32 and float64)."""

    def __init__(self, lib, fmt: str, itype):
        self.library = lib._name
        self._fns = {}
        for dt, ch, ctype in (("float32", "s", ctypes.c_float), ("float64", "d", ctypes.c_double)):
            fn = getattr(lib, fmt.format(ch + "gemm"))
            fn.restype = None
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, itype, itype, itype, ctype,
                           ctypes.c_void_p, itype, ctypes.c_void_p, itype, ctype, ctypes.c_void_p, itype]
            self._fns[dt] = fn

    def gemm(self, dtype: str, trans_a: bool, trans_b: bool, m: int, n: int, k: int, alpha: float,
             a: int, b: int, beta: float, c: int) -> None:
        """Row-major ``C[m,n] = alpha * op(A) @ op(B) + beta * C`` on data pointers ``a, b, c``
        of C-contiguous arrays (A stored [k,m] when ``trans_a`` else [m,k]; B likewise)."""
        self._fns[dtype](ROW_MAJOR, TRANS if trans_a else NO_TRANS, TRANS if trans_b else NO_TRANS,
                         m, n, k, alpha, a, m if trans_a else k, b, k if trans_b else n, beta, c, n)


def cblas() -> Cblas | None:
    """The cblas of numpy's BLAS (loaded once), or None when it cannot be found."""
    with _lock:
        if "lib" not in _loaded:
            _loaded["lib"] = _find()
        return _loaded["lib"]


def _find() -> Cblas | None:
    for lib in loaded_libraries():
        for fmt, itype in _FLAVOURS:
            if hasattr(lib, fmt.format("sgemm")) and hasattr(lib, fmt.format("dgemm")):
                return Cblas(lib, fmt, itype)
    return None


_THREAD_FNS = ("scipy_openblas_{}64_", "openblas_{}64_", "scipy_openblas_{}", "openblas_{}")


class OneBlasThread:
    """A context that holds numpy's OpenBLAS at one thread while an executable with BLAS steps
    runs (:class:`~apollo_py.runtime.cpu.CpuExecutable`), and restores the caller's count after.

    OpenBLAS's worker threads spin (``sched_yield`` loops, ~0.1 s) after every call they took
    part in, so beside apollo_py's own pool they take the cores its next kernels run on: a
    model of a 256^3 BLAS product and a pool kernel ran in 82 ms (p10) per call with OpenBLAS
    at its default 2 threads against 2.4 ms with 1 (shared box, load 22).  The BLAS products
    apollo_py leaves to BLAS are the small ones (docs/design/gemm.md), for which one thread
    costs little.  Nested and concurrent runs share one count (entered, restored by the
    last to leave); another thread's own numpy calls run on one BLAS thread meanwhile.  Does
    nothing where the library has no ``openblas_set_num_threads``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._depth = 0
        self._saved = 0
        self._get = self._set = None
        for lib in loaded_libraries():
            for fmt in _THREAD_FNS:
                g, st = getattr(lib, fmt.format("get_num_threads"), None), getattr(lib, fmt.format("set_num_threads"), None)
                if g is not None and st is not None:
                    g.restype, g.argtypes = ctypes.c_int, []
                    st.restype, st.argtypes = None, [ctypes.c_int]
                    self._get, self._set = g, st
                    return

    @property
    def available(self) -> bool:
        return self._set is not None

    def __enter__(self) -> "OneBlasThread":
        if self._set is not None:
            with self._lock:
                if self._depth == 0:
                    self._saved = self._get()
                    if self._saved != 1:
                        self._set(1)
                self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        if self._set is not None:
            with self._lock:
                self._depth -= 1
                if self._depth == 0 and self._saved != 1:
                    self._set(self._saved)


def one_blas_thread() -> OneBlasThread:
    """The process's :class:`OneBlasThread` (made once)."""
    with _lock:
        if "one" not in _loaded:
            _loaded["one"] = OneBlasThread()
        return _loaded["one"]


class BlasStep:
    """Runtime step of a :class:`BlasDesc` (``writes_buffers``: the runtime binds its output
    buffer in ``env`` before :meth:`execute`, like a kernel's)."""

    writes_buffers = True

    def __init__(self, desc: BlasDesc, reason: str):
        self.desc = desc
        self.reason = reason
        self.inputs = desc.inputs
        self.outputs = (desc.out,)
        self.nodes = desc.nodes
        self._lib = cblas()
        if self._lib is None:
            raise InputError("no cblas library found next to numpy (the lowering checks this first)")

    def execute(self, env: dict, pool=None) -> None:
        d = self.desc
        a, b, c = env[d.a], env[d.b], env[d.out]
        if not a.flags.c_contiguous:
            a = np.ascontiguousarray(a)
        if not b.flags.c_contiguous:
            b = np.ascontiguousarray(b)
        beta = 0.0
        if d.acc is not None:
            p = env[d.acc]
            if p is not c:
                np.copyto(c, p)
            beta = 1.0
        if d.m and d.n:
            if d.k == 0:
                if d.acc is None:
                    c.fill(0)
                return
            self._lib.gemm(d.dtype, d.trans_a, d.trans_b, d.m, d.n, d.k, d.alpha,
                           a.ctypes.data, b.ctypes.data, beta, c.ctypes.data)
