"""Machine roofline: STREAM-like triad bandwidth and numpy sgemm rate, and a floor per workload.

``floor_seconds(bytes, flops) = max(bytes / bandwidth, flops / sgemm_rate)``: no implementation
can move ``bytes`` through memory faster than the triad does, nor do ``flops`` faster than the
BLAS sgemm does (an optimistic compute peak for non-matmul work, which is never the binding term
here anyway).

Triad: ``a[:] = b + s*c`` on three float32 arrays of 64 MB each, output preallocated and already
touched.  numpy cannot do the triad in one pass (``b + s*c`` makes a temporary), so it runs in
blocks of 64K elements (256 KB): the block's temporary stays in cache and memory sees exactly the
three arrays.  It runs in 1 thread and in ``os.cpu_count()`` threads (numpy ufuncs release the
GIL); the better of the two counts, 3 arrays x 64 MB per run, median of several runs.

Sgemm: ``np.matmul`` of two 2048x2048 float32 matrices into a preallocated output, median.
OpenBLAS picks its kernel at load time; OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE, if set in the
environment, force a (slower) kernel.  :func:`blas_info` reports which one actually runs.

Run ``python benchmarks/roofline.py`` to print the numbers.
"""
from __future__ import annotations

import ctypes
import glob
import os
import statistics
import threading
import time

import numpy as np

TRIAD_MB = 64
TRIAD_BLOCK = 64 * 1024
SGEMM_N = 2048


def _triad_blocked(a, b, c, s, lo, hi, tmp):
    for i in range(lo, hi, TRIAD_BLOCK):
        j = min(i + TRIAD_BLOCK, hi)
        t = tmp[: j - i]
        np.multiply(c[i:j], s, out=t)
        np.add(t, b[i:j], out=a[i:j])


_C_TRIAD_SRC = r"""
void triad(float *restrict a, const float *restrict b, const float *restrict c, float s,
           long lo, long hi) {
    for (long i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
}
"""
_C_TRIAD = None  # (ctypes function, description) once built; False when no C compiler works


def c_triad():
    """A one-pass triad compiled with the system C compiler (cc -O3 -march=native), or None.

    numpy needs two passes for ``b + s*c`` and its per-call overhead caps the rate; a compiled
    loop measures the memory system rather than the ufunc machinery.  Built once per process
    in a temporary directory; ctypes releases the GIL, so Python threads run it in parallel.
    """
    global _C_TRIAD
    if _C_TRIAD is None:
        _C_TRIAD = False
        if os.environ.get("APOLLO_BENCH_NUMPY_TRIAD"):
            return None
        import shutil
        import subprocess
        import tempfile
        cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
        if cc:
            d = tempfile.mkdtemp(prefix="apollo-bench-triad-")
            src, lib = os.path.join(d, "triad.c"), os.path.join(d, "triad.so")
            with open(src, "w") as fh:
                fh.write(_C_TRIAD_SRC)
            flags = ["-O3", "-march=native", "-fno-tree-loop-distribute-patterns", "-shared", "-fPIC"]
            try:
                subprocess.run([cc, *flags, src, "-o", lib], check=True, capture_output=True, timeout=60)
                fn = ctypes.CDLL(lib).triad
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
                               ctypes.c_long, ctypes.c_long]
                fn.restype = None
                _C_TRIAD = (fn, f"C loop ({os.path.basename(cc)} {' '.join(flags[:2])})")
            except (OSError, subprocess.SubprocessError):
                _C_TRIAD = False
    return _C_TRIAD or None


def _triad_c_range(fn, a, b, c, s, lo, hi, _tmp):
    fn(a.ctypes.data, b.ctypes.data, c.ctypes.data, float(s), lo, hi)


def _triad_once(a, b, c, s, nthreads, tmps) -> float:
    n = a.size
    ct = c_triad()
    if ct is not None:
        def work(lo, hi, tmp):
            _triad_c_range(ct[0], a, b, c, s, lo, hi, tmp)
    else:
        def work(lo, hi, tmp):
            _triad_blocked(a, b, c, s, lo, hi, tmp)
    if nthreads == 1:
        t0 = time.perf_counter()
        work(0, n, tmps[0])
        return time.perf_counter() - t0
    bounds = [n * k // nthreads for k in range(nthreads + 1)]
    ths = [threading.Thread(target=work, args=(bounds[k], bounds[k + 1], tmps[k]))
           for k in range(nthreads)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return time.perf_counter() - t0


def triad_bandwidth(mb: int = TRIAD_MB, runs: int = 7) -> dict:
    """Triad GB/s (10^9 bytes/s, counting 3 arrays of ``mb`` MB), 1 thread and all cores."""
    n = mb * (1 << 20) // 4
    a = np.zeros(n, np.float32)  # zeros + the warm-up run touch every page before timing
    b = np.full(n, 1.0, np.float32)
    c = np.full(n, 2.0, np.float32)
    s = np.float32(3.0)
    cores = os.cpu_count() or 1
    out = {}
    for nt in sorted({1, cores}):
        tmps = [np.empty(TRIAD_BLOCK, np.float32) for _ in range(nt)]
        _triad_once(a, b, c, s, nt, tmps)  # warm-up
        times = [_triad_once(a, b, c, s, nt, tmps) for _ in range(runs)]
        out[nt] = 3 * a.nbytes / statistics.median(times) / 1e9
    assert a[0] == 7.0 and a[-1] == 7.0
    ct = c_triad()
    method = ct[1] if ct else "numpy, blocked in 64K-element chunks"
    return {"gbps": max(out.values()), "by_threads": out, "array_mb": mb, "method": method}


def sgemm_rate(n: int = SGEMM_N, runs: int = 5) -> float:
    """numpy float32 matmul GFLOP/s (2*n^3 per product), median of ``runs``."""
    return sgemm_stats(n, runs)[0]


def sgemm_stats(n: int = SGEMM_N, runs: int = 5) -> tuple[float, float]:
    """(median, best) numpy float32 matmul GFLOP/s over ``runs`` timed products."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    c = np.empty((n, n), np.float32)
    np.matmul(a, b, out=c)  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        times.append(time.perf_counter() - t0)
    flop = 2.0 * n ** 3
    return flop / statistics.median(times) / 1e9, flop / min(times) / 1e9


def blas_info() -> dict:
    """Which BLAS numpy uses and which kernel runs: threadpoolctl if installed, else the
    OpenBLAS library itself (read-only queries through ctypes), else numpy's build config."""
    info: dict = {"env": {k: os.environ.get(k) for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                                          "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")}}
    try:
        blas = np.__config__.CONFIG["Build Dependencies"]["blas"]
        info["name"] = blas.get("name")
        info["version"] = blas.get("version")
    except Exception:  # pragma: no cover - older numpy
        pass
    try:
        import threadpoolctl  # optional, used only if installed

        for lib in threadpoolctl.threadpool_info():
            if lib.get("user_api") == "blas":
                info.update(kernel=lib.get("architecture"), threads=lib.get("num_threads"),
                            source="threadpoolctl", library=lib.get("filepath"))
                return info
    except ImportError:
        pass
    libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libdir, "lib*openblas*.so*"))):
        try:
            lib = ctypes.CDLL(path)  # already loaded by numpy: returns the same handle
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas_", "64_"), ("scipy_openblas_", ""), ("openblas_", "")):
            fn = getattr(lib, f"{prefix}get_corename{suffix}", None)
            if fn is None:
                continue
            fn.restype = ctypes.c_char_p
            info["kernel"] = fn().decode()
            nt = getattr(lib, f"{prefix}get_num_threads{suffix}", None)
            if nt is not None:
                nt.restype = ctypes.c_int
                info["threads"] = nt()
            cfg = getattr(lib, f"{prefix}get_config{suffix}", None)
            if cfg is not None:
                cfg.restype = ctypes.c_char_p
                info["config"] = cfg().decode().strip()
            info["source"] = "openblas get_corename (ctypes)"
            info["library"] = os.path.basename(path)
            return info
    info["source"] = "numpy build config only (kernel unknown)"
    return info


class Roofline:
    """Measured once per process; ``floor_seconds`` uses the measured numbers."""

    def __init__(self, bw_gbps: float, sgemm_gflops: float, detail: dict | None = None):
        self.bw_gbps = bw_gbps
        self.sgemm_gflops = sgemm_gflops
        self.detail = detail or {}

    @classmethod
    def measure(cls, quick: bool = False) -> "Roofline":
        tri = triad_bandwidth(runs=3 if quick else 7)
        med, best = sgemm_stats(n=SGEMM_N, runs=7)
        return cls(tri["gbps"], med, {"triad": tri, "sgemm_n": SGEMM_N, "sgemm_best_gflops": best,
                                      "triad_threads": max(tri["by_threads"], key=tri["by_threads"].get)})

    def floor_seconds(self, nbytes: float, flops: float) -> float:
        return max(nbytes / (self.bw_gbps * 1e9), flops / (self.sgemm_gflops * 1e9))


class Probe:
    """Triad and sgemm as callables, to be sampled interleaved with the contenders.

    ``run.py`` puts ``triad`` and ``sgemm`` in each workload's round-robin, so the floor of a
    workload is computed from roofline samples taken in the same seconds as its contenders' (on a
    shared machine the load changes from minute to minute).
    """

    def __init__(self, threads: int = 1, mb: int = TRIAD_MB, n: int = SGEMM_N):
        count = mb * (1 << 20) // 4
        self.a = np.zeros(count, np.float32)
        self.b = np.full(count, 1.0, np.float32)
        self.c = np.full(count, 2.0, np.float32)
        self.threads = threads
        self.tmps = [np.empty(TRIAD_BLOCK, np.float32) for _ in range(threads)]
        rng = np.random.default_rng(0)
        self.ma = rng.standard_normal((n, n), dtype=np.float32)
        self.mb = rng.standard_normal((n, n), dtype=np.float32)
        self.mc = np.empty((n, n), np.float32)
        self.triad_bytes = 3 * self.a.nbytes
        self.sgemm_flops = 2.0 * n ** 3

    def triad(self):
        _triad_once(self.a, self.b, self.c, np.float32(3.0), self.threads, self.tmps)

    def sgemm(self):
        np.matmul(self.ma, self.mb, out=self.mc)

    def roofline(self, triad_s: float, sgemm_s: float) -> Roofline:
        return Roofline(self.triad_bytes / triad_s / 1e9, self.sgemm_flops / sgemm_s / 1e9)


_DEFAULT: Roofline | None = None


def floor_seconds(nbytes: float, flops: float) -> float:
    """``max(bytes/bw, flops/sgemm_rate)`` with this machine's numbers (measured on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Roofline.measure()
    return _DEFAULT.floor_seconds(nbytes, flops)


if __name__ == "__main__":
    r = Roofline.measure()
    tri = r.detail["triad"]
    print(f"triad: {r.bw_gbps:.2f} GB/s (3 x {tri['array_mb']} MB; by threads: "
          + ", ".join(f"{k}: {v:.2f}" for k, v in tri["by_threads"].items()) + ")")
    print(f"sgemm {SGEMM_N}^3 float32: {r.sgemm_gflops:.1f} GFLOP/s median "
          f"(best run {r.detail['sgemm_best_gflops']:.1f})")
    print(f"blas: {blas_info()}")
