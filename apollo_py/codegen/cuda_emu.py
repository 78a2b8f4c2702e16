"""Build and run generated CUDA sources on the CPU (the emulation build, issue #17 item 5b).

The very source that NVRTC compiles is compiled by g++ as C++17 with ``-DAPOLLO_CUDA_EMU``;
``cuda_emu.h`` (next to this module) supplies ``threadIdx``/``blockIdx``, ``__syncthreads``,
``__shfl_xor_sync``, ``__shared__`` and the float16 storage type, and runs each block's threads
as fibers (see the header).  Each kernel exports ``<name>_emu(void **args, const long long
*dims)``.  Libraries are cached by a hash of the source and the header under
``<cache_dir>/cuda_emu``.  Slow (one OS thread, a context switch per thread and barrier), and
meant for tests: it checks what the kernels compute, not how fast.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading

import numpy as np

from apollo_py.errors import CompileError

HEADER = os.path.join(os.path.dirname(__file__), "cuda_emu.h")
_LOCK = threading.Lock()
_LOADED: dict = {}


def find_cxx():
    """The C++ compiler used for the emulation build (``g++`` or ``clang++``), or None."""
    for name in ("g++", "clang++", "c++"):
        path = shutil.which(name)
        if path:
            return path
    return None


class EmuKernel:
    """A generated CUDA kernel compiled for the CPU; call :meth:`launch` with host arrays."""

    def __init__(self, kernel, lib: ctypes.CDLL, path: str, lock: threading.Lock):
        self.kernel = kernel
        self.lib = lib
        self.path = path
        self.lock = lock      # the library's scheduler state is global: one launch at a time
        self.fn = getattr(lib, kernel.name + "_emu")
        self.fn.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_longlong)]
        self.fn.restype = None

    def launch_ptrs(self, ptrs, grid=None, block=None) -> None:
        """Run the kernel on raw host addresses ``ptrs`` (one per param)."""
        k = self.kernel
        if len(ptrs) != len(k.params):
            raise CompileError(f"kernel {k.name!r} takes {len(k.params)} buffers, got {len(ptrs)}")
        args = (ctypes.c_void_p * max(1, len(ptrs)))(*ptrs)
        dims = (ctypes.c_longlong * 6)(*(grid or k.grid), *(block or k.block))
        with self.lock:
            self.fn(args, dims)

    def launch(self, arrays, grid=None, block=None) -> None:
        """Run the kernel on C-contiguous numpy ``arrays`` (one per param, in order)."""
        for (name, dt, n), a in zip(self.kernel.params, arrays):
            if not a.flags.c_contiguous or a.size < n:
                raise CompileError(f"kernel {self.kernel.name!r}: buffer {name!r} needs {n} contiguous "
                                   f"elements, got shape {a.shape}")
        self.launch_ptrs([a.ctypes.data for a in arrays], grid, block)


def build_emu(kernel, cache_dir: str | None = None, cxx=None) -> EmuKernel:
    """Compile ``kernel.source`` (a :class:`apollo_py.codegen.cuda.CudaKernel`) for the CPU."""
    cxx = cxx or find_cxx()
    if cxx is None:
        raise CompileError("the CUDA emulation build needs a C++ compiler (g++ or clang++) on PATH")
    with open(HEADER, "rb") as f:
        header = f.read()
    digest = hashlib.sha256(header + kernel.source.encode() + cxx.encode()).hexdigest()[:24]
    with _LOCK:
        hit = _LOADED.get(digest)
    if hit is not None:
        return EmuKernel(kernel, *hit)
    root = os.path.join(cache_dir, "cuda_emu") if cache_dir else tempfile.mkdtemp(prefix="apollo_cuda_emu_")
    os.makedirs(root, exist_ok=True)
    lib_path = os.path.join(root, f"{kernel.name}_{digest}.so")
    if not os.path.exists(lib_path):
        work = tempfile.mkdtemp(prefix="build_", dir=root)
        src = os.path.join(work, f"{kernel.name}.cu.cpp")
        with open(src, "w") as f:
            f.write(kernel.source)
        tmp = os.path.join(work, "k.so")
        cmd = [cxx, "-std=c++17", "-O1", "-fPIC", "-shared", "-DAPOLLO_CUDA_EMU",
               "-I", os.path.dirname(HEADER), "-w", src, "-o", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(f"emulation build of CUDA kernel {kernel.name!r} failed:\n{proc.stderr[-4000:]}")
        os.replace(tmp, lib_path)
        shutil.rmtree(work, ignore_errors=True)
    lib = ctypes.CDLL(lib_path)
    with _LOCK:
        hit = _LOADED.setdefault(digest, (lib, lib_path, threading.Lock()))
    return EmuKernel(kernel, *hit)


def run_emu(kernel, arrays, cache_dir: str | None = None) -> None:
    """Build (cached) and run ``kernel`` on numpy ``arrays`` in place."""
    build_emu(kernel, cache_dir).launch([np.ascontiguousarray(a) if not a.flags.c_contiguous else a
                                         for a in arrays])
