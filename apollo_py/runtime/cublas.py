"""cuBLAS through ctypes (``libcublas.so`` from the ``nvidia-cublas`` wheel, the ``cuda`` extra).

The alternative to the generated GEMM (codegen/cuda_gemm.py) for a matmul step without an
epilogue, chosen per shape by measurement on the device (:func:`choose_gemm`), like the CPU
target's BLAS rule.  Row-major ``C[b] = A[b] @ B[b]`` is cuBLAS's column-major
``C^T = B^T A^T``: ``cublasGemmStridedBatchedEx(N, N, n, m, k, B, A, C)``, float32 or float16
storage with float32 compute.  Needs a GPU: without one, loading fails with
:class:`apollo_py.errors.CudaUnavailableError`.  Not run yet (no GPU was lent to the
session that wrote it); ``tests/cuda`` has a ``gpu``-marked check against numpy.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
from functools import lru_cache

CUBLAS_OP_N = 0
CUDA_R_32F, CUDA_R_16F = 0, 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
_DT = {"float32": CUDA_R_32F, "float16": CUDA_R_16F}


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    from ..errors import CudaUnavailableError
    cands = []
    for base in sys.path:
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcublas.so*")))
    cands = [c for c in cands if "Lt" not in os.path.basename(c)] + ["libcublas.so"]
    errors = []
    for c in cands:
        try:
            return ctypes.CDLL(c)
        except OSError as e:
            errors.append(str(e))
    raise CudaUnavailableError("cuBLAS not found: pip install 'apollo_py[cuda]' (nvidia-cublas) "
                               f"({'; '.join(errors[-2:])})")


class Cublas:
    """One cuBLAS handle bound to a CUDA stream (an int ``CUstream`` handle, 0 = default)."""

    def __init__(self, stream: int = 0):
        self.lib = _lib()
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream)), "cublasSetStream")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            from ..errors import CompileError
            raise CompileError(f"{what} failed with cuBLAS status {status}")

    def gemm(self, dtype: str, batch: int, m: int, n: int, k: int, a: int, b: int, c: int,
             stride_a: int, stride_b: int) -> None:
        """``C[i] = A[i] @ B[i]`` (row-major device pointers ``a``, ``b``, ``c``) for ``i < batch``;
        ``stride_a`` / ``stride_b`` in elements (0 broadcasts one matrix)."""
        alpha, beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        t = _DT[dtype]
        self._check(self.lib.cublasGemmStridedBatchedEx(
            self.handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, ctypes.byref(alpha),
            ctypes.c_void_p(b), t, n, ctypes.c_longlong(stride_b),
            ctypes.c_void_p(a), t, k, ctypes.c_longlong(stride_a), ctypes.byref(beta),
            ctypes.c_void_p(c), t, n, ctypes.c_longlong(m * n), batch,
            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), "cublasGemmStridedBatchedEx")


def cublas_form(desc):
    """``(batch, stride_a, stride_b)`` when GemmDesc ``desc`` is a plain strided matmul that
    cuBLAS can run (no epilogue nodes, no conv, batch indices ``b`` or all-zero), else None."""
    if desc.conv is not None or desc.nodes or desc.outputs != (desc.head,):
        return None
    if desc.a_batches == 1:
        sa = 0
    elif desc.a_index == tuple(range(desc.batch)):
        sa = desc.m * desc.k
    else:
        return None
    if max(desc.b_index) == 0:
        sb = 0
    elif desc.b_index == tuple(range(desc.batch)):
        sb = desc.k * desc.n
    else:
        return None
    return desc.batch, sa, sb


def choose_gemm(run_generated, run_cublas, device, repeats: int = 5) -> tuple[str, float, float]:
    """Time both ways on ``device`` (median of ``repeats`` after a warm-up); returns
    ``("cublas" | "generated", t_generated, t_cublas)`` in seconds."""
    import time

    def timed(fn):
        fn()
        device.synchronize()
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            device.synchronize()
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2]
    tg, tc = timed(run_generated), timed(run_cublas)
    return ("cublas" if tc < tg else "generated"), tg, tc
