"""What numpy's BLAS is, for the compile-time choice between it and the generated GEMM
(layers/gemm_lowering.py): where the library is, and how wide the vectors of the kernel it
picked at load time are.

numpy's PyPI wheels ship OpenBLAS built with ``DYNAMIC_ARCH``: it picks a kernel for the CPU
when it loads, unless ``OPENBLAS_CORETYPE`` forces one (this project's dev box sets
``Haswell``: AVX2, 8 floats, on an AVX-512 CPU).  ``openblas_get_corename`` says which.
Bottom-layer module (ctypes only): the runtime's cblas binding (runtime/blas.py) finds the
library through :func:`loaded_libraries` too.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os

#: OpenBLAS core names whose sgemm kernel uses 512-bit vectors (16 floats); every other
#: x86 core name (Haswell, Zen, SkylakeX's AVX2 fallback names, Sandybridge, ...) is 8 or fewer
AVX512_CORES = ("skylakex", "cooperlake", "sapphirerapids")
_CORENAME = ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename",
             "openblas_get_corename64_", "openblas_get_corename")


def candidate_libraries() -> list[str]:
    """Paths of the BLAS libraries numpy's wheel ships (OpenBLAS, or MKL in some builds)."""
    import numpy
    root = os.path.dirname(numpy.__file__)
    names = []
    for pattern in ("../numpy.libs/*blas*", ".dylibs/*blas*", "../numpy.libs/*mkl_rt*"):
        names += sorted(glob.glob(os.path.join(root, pattern)))
    return names


def loaded_libraries():
    """The libraries of :func:`candidate_libraries` that load (``ctypes.CDLL`` handles), in
    order; one that fails to load is passed over."""
    for path in candidate_libraries():
        try:
            yield ctypes.CDLL(path)
        except OSError:
            continue


@functools.lru_cache(maxsize=1)
def blas_core() -> str:
    """The OpenBLAS core name of numpy's BLAS (lower case, e.g. ``"haswell"``), or "" where
    it cannot be asked (another BLAS, no library found)."""
    for lib in loaded_libraries():
        for sym in _CORENAME:
            fn = getattr(lib, sym, None)
            if fn is not None:
                fn.restype, fn.argtypes = ctypes.c_char_p, []
                return (fn() or b"").decode(errors="replace").strip().lower()
    return ""


def blas_vector_floats() -> int | None:
    """float32 lanes of numpy's sgemm kernel: 16 for OpenBLAS's AVX-512 cores, 8 for any
    other OpenBLAS core, None when unknown (not OpenBLAS: assume it uses the widest)."""
    core = blas_core()
    if not core:
        return None
    return 16 if core in AVX512_CORES else 8
