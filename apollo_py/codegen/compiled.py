"""The callable side of a compiled kernel, shared by the LLVM and C back ends.

Every CPU kernel has the ABI ``void name(void **args, int64 lo, int64 hi)``: ``args[k]`` is
the data pointer of the k-th Param and ``[lo, hi)`` the chunk of the parallel loop.
"""
from __future__ import annotations

import ctypes

from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError, InputError

KERNEL_CFUNCTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)

_NUMPY_NAMES = {"float32": "float32", "float64": "float64", "float16": "float16", "bool": "bool",
                **{d: d for d in L.INT_DTYPES}}


class CompiledKernelBase:
    """A kernel function pointer plus argument checking.

    Subclasses set ``address`` and keep alive whatever owns the code.  ``cfunc`` is the
    ctypes function (calls release the GIL).
    """

    def __init__(self, kernel: L.Kernel, address: int):
        if not address:
            raise CompileError(f"kernel {kernel.name!r}: code has no address")
        self.kernel = kernel
        self.name = kernel.name
        self.params = kernel.params
        self.parallel_extent = kernel.parallel_extent
        self.address = address
        self.cfunc = KERNEL_CFUNCTYPE(address)
        import numpy as np
        self._dtypes = tuple(np.dtype(_NUMPY_NAMES[p.dtype]) for p in self.params)
        self._ptr_array = ctypes.c_void_p * max(1, len(self.params))

    def pack_args(self, arrays):
        """Check ``arrays`` against the params and return the ctypes ``void*[]`` array.

        Expects one C-contiguous numpy array per Param with the Param's dtype and at least
        ``size`` elements; raises InputError naming the offending buffer otherwise.  The
        caller must keep the arrays alive while the returned pointer array is used.
        """
        if len(arrays) != len(self.params):
            raise InputError(f"kernel {self.name!r} takes {len(self.params)} arrays, "
                             f"got {len(arrays)}")
        ptrs = self._ptr_array()
        for k, (p, want, a) in enumerate(zip(self.params, self._dtypes, arrays)):
            dt = getattr(a, "dtype", None)
            if dt is None or dt != want:  # dtype.name costs 3 us, dtype == 0.05 us
                raise InputError(f"kernel {self.name!r}: buffer {p.name!r} needs dtype "
                                 f"{p.dtype}, got {dt}")
            if not a.flags.c_contiguous:
                raise InputError(f"kernel {self.name!r}: buffer {p.name!r} is not contiguous")
            if a.size < p.size:
                raise InputError(f"kernel {self.name!r}: buffer {p.name!r} has {a.size} "
                                 f"elements, needs {p.size}")
            ptrs[k] = a.ctypes.data
        return ptrs

    def __call__(self, arrays, lo=None, hi=None) -> None:
        """Run the kernel on ``arrays`` over the parallel chunk ``[lo, hi)``.

        ``lo`` defaults to 0 and ``hi`` to the kernel's parallel extent (0 if it has none,
        where the values are ignored).  Outputs are written into the given arrays.
        """
        ptrs = self.pack_args(arrays)
        lo = 0 if lo is None else int(lo)
        hi = (self.parallel_extent or 0) if hi is None else int(hi)
        self.cfunc(ptrs, lo, hi)


def run_claiming(kernel, pool, arrays, alone: bool = False) -> None:
    """Run ``kernel``, whose calls claim their tiles from a counter among ``arrays`` (zero before
    the call) and whose caller's call (``lo`` = 0) returns only when every tile is finished: on
    the calling thread alone (``alone``, no pool, a one-thread pool), or with each of ``pool``'s
    workers making a helper call (``lo`` = 1) when it wakes up -- a worker that wakes late finds
    the counter spent and returns, so nothing waits for it."""
    if alone or pool is None or pool.num_threads == 1:
        kernel(arrays)
        return
    ptrs = kernel.pack_args(arrays)
    pool.lend(kernel.cfunc, ptrs, 1, 2, arrays)
    kernel.cfunc(ptrs, 0, 1)
