"""NVRTC through ctypes: CUDA C++ -> PTX and cubin at run time, without a GPU.

``libnvrtc.so`` comes from the ``nvidia-cuda-nvrtc`` wheel (``site-packages/nvidia/*/lib``), so
compiling needs no CUDA toolkit and no driver; ``APOLLO_PY_NVRTC`` may name another library.
:func:`compile_cuda` compiles one translation unit for one architecture (``sm_80``, ``sm_90``):
the PTX (``.target sm_XX``, which the driver can also JIT) and the cubin of one NVRTC run with
``-arch=sm_XX``, and, per ``__global__`` function,
the resources ptxas assigned, read from the cubin's ELF (:func:`cubin_resources`):

* registers per thread: the ``EIATTR_REGCOUNT`` record of the ``.nv.info`` section;
* static shared memory per block: the size of the ``.nv.shared.<kernel>`` section (less the
  1 KiB that sm_90 reserves for the system in it);
* local memory (spills, per-thread arrays): the ``EIATTR_FRAME_SIZE`` record of
  ``.nv.info.<kernel>``.

(The PTX ``.reg`` declarations count virtual registers before allocation, so they say little;
the cubin holds what the hardware will reserve.  tests/cuda check these numbers against
ptxas's own ``-v`` report.)  Results go through the piecewise cache; the key holds the source,
the architecture and the NVRTC version.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import json
import os
import struct
import sys
import threading
from dataclasses import dataclass, field
from functools import lru_cache

from ..errors import ApolloError, CompileError

ARCHS = ("sm_80", "sm_90")


class NvrtcUnavailableError(ApolloError):
    """libnvrtc could not be found or loaded (install the ``nvidia-cuda-nvrtc`` wheel)."""


@lru_cache(maxsize=None)
def _lib() -> ctypes.CDLL:
    explicit = os.environ.get("APOLLO_PY_NVRTC")
    cands = [explicit] if explicit else []
    for base in sys.path:
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libnvrtc.so*")))
        cands += sorted(glob.glob(os.path.join(base, "nvidia", "cuda_nvrtc", "lib", "libnvrtc.so*")))
    cands = [c for c in cands if c and "builtins" not in os.path.basename(c)]
    errors = []
    for c in cands:
        try:
            _preload_builtins(os.path.dirname(c))
            lib = ctypes.CDLL(c)
        except OSError as e:
            errors.append(f"{c}: {e}")
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise NvrtcUnavailableError("NVRTC not found: install the 'nvidia-cuda-nvrtc' wheel "
                                "(pip install 'apollo_py[cuda]') or set APOLLO_PY_NVRTC"
                                + (f" ({'; '.join(errors)})" if errors else ""))


def _preload_builtins(libdir: str) -> None:
    """Load the ``libnvrtc-builtins`` beside a ``libnvrtc`` (RTLD_GLOBAL) before it.

    NVRTC opens its builtins library by soname when it compiles, and the loader finds it only on
    the library path or through an RPATH: the ``nvidia-cuda-nvrtc`` 12.x wheels set
    ``$ORIGIN``, 13.x (``nvidia/cu13/lib``) does not, so every compile failed with
    NVRTC_ERROR_BUILTIN_OPERATION_FAILURE ("failed to open libnvrtc-builtins.so.13.0").  A
    library already loaded under that soname is what dlopen returns."""
    for b in sorted(glob.glob(os.path.join(libdir, "libnvrtc-builtins.so*"))):
        try:
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue        # libnvrtc itself may still find one; its error names what is missing


@lru_cache(maxsize=None)
def nvrtc_version() -> str:
    """NVRTC's version, e.g. ``"13.5"``."""
    maj, mnr = ctypes.c_int(), ctypes.c_int()
    _lib().nvrtcVersion(ctypes.byref(maj), ctypes.byref(mnr))
    return f"{maj.value}.{mnr.value}"


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reserved for one ``__global__`` function."""

    registers: int
    shared_bytes: int
    local_bytes: int

    def to_dict(self) -> dict:
        return {"registers": self.registers, "shared_bytes": self.shared_bytes,
                "local_bytes": self.local_bytes}

    def __str__(self) -> str:
        return f"{self.registers} regs, {self.shared_bytes} B shared, {self.local_bytes} B local"


@dataclass(frozen=True)
class CudaBinary:
    """One compiled translation unit: PTX, cubin, resources per kernel, NVRTC's log."""

    arch: str
    ptx: str
    cubin: bytes
    resources: dict = field(default_factory=dict)    # kernel name -> KernelResources
    log: str = ""


_COMPILE_LOCK = threading.Lock()


def _check(res: int, what: str, log: str = "") -> None:
    if res != 0:
        msg = _lib().nvrtcGetErrorString(res).decode()
        raise CompileError(f"NVRTC {what} failed ({msg})" + (f":\n{log}" if log else ""))


def _run_nvrtc(source: str, name: str, options: list[str]) -> tuple[str, bytes, str]:
    lib = _lib()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                  0, None, None), "nvrtcCreateProgram")
    try:
        opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        res = lib.nvrtcCompileProgram(prog, len(options), opts)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        _check(res, f"compile of {name!r} ({' '.join(options)})", log)
        ptx = cubin = b""
        if lib.nvrtcGetPTXSize(prog, ctypes.byref(n)) == 0 and n.value > 1:
            buf = ctypes.create_string_buffer(n.value)
            _check(lib.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
            ptx = buf.value
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(n)) == 0 and n.value > 0:
            buf = ctypes.create_string_buffer(n.value)
            _check(lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN")
            cubin = buf.raw[:n.value]
        return ptx.decode(), cubin, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _options(arch: str, extra=()) -> list[str]:
    if not (arch.startswith("sm_") and arch[3:].isdigit()):
        raise CompileError(f"CUDA architecture {arch!r}: expected sm_XX, e.g. {', '.join(ARCHS)}")
    return [f"-arch={arch}", "-std=c++17", "-default-device", *extra]


def compile_cuda(source: str, name: str, arch: str = "sm_80", cache=None) -> CudaBinary:
    """PTX and cubin of ``source`` for ``arch`` (``sm_XX``), with resources per kernel.

    ``cache`` is a :class:`apollo_py.cache.PieceCache` (None: no cache).  Raises CompileError
    with NVRTC's log when the source does not compile, NvrtcUnavailableError without NVRTC.
    """
    key = None
    if cache is not None:
        from ..cache import piece_key
        digest = hashlib.sha256(source.encode()).hexdigest()
        key = piece_key(digest, f"cuda-{arch}", {"nvrtc": nvrtc_version(), "opts": _options(arch)})
        hit = cache.get(key)
        if hit is not None:
            payload, meta = hit
            ptx_len = meta["ptx_len"]
            res = {k: KernelResources(**v) for k, v in meta["resources"].items()}
            return CudaBinary(arch, payload[:ptx_len].decode(), payload[ptx_len:], res, "")
    with _COMPILE_LOCK:      # NVRTC is thread-safe, but two compiles only fight for 2 cores
        ptx, cubin, log = _run_nvrtc(source, name, _options(arch))
    res = cubin_resources(cubin)
    out = CudaBinary(arch, ptx, cubin, res, log.strip())
    if cache is not None:
        pb = ptx.encode()
        cache.put(key, pb + cubin, {"kernel": name, "arch": arch, "ptx_len": len(pb),
                                    "resources": {k: v.to_dict() for k, v in res.items()}})
    return out


def ptxas_report(source: str, name: str, arch: str = "sm_80") -> str:
    """ptxas's ``-v`` report for ``source`` (NVRTC's log), for checking :func:`cubin_resources`."""
    return _run_nvrtc(source, name, _options(arch, ("-Xptxas", "-v")))[2]


# ----------------------------------------------------------------------------- cubin ELF

EIATTR_REGCOUNT = 0x2F
EIATTR_FRAME_SIZE = 0x11
_EIFMT_SVAL = 0x04
#: sm_90 cubins lay 1 KiB of system-reserved shared memory (symbol ``.nv.reservedSmem.offset0``)
#: in front of each kernel's ``.nv.shared.<kernel>`` section; ptxas -v does not count it
SM90_RESERVED_SMEM = 1024
_EIFMT_HVAL = 0x03


def _elf_sections(blob: bytes) -> dict:
    """Section name -> (type, bytes) of a 64-bit little-endian ELF file."""
    if blob[:4] != b"\x7fELF" or blob[4] != 2:
        raise CompileError("cubin is not a 64-bit ELF file")
    shoff, = struct.unpack_from("<Q", blob, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", blob, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx]
    names = blob[strtab[4]:strtab[4] + strtab[5]]
    out = {}
    for h in heads:
        nm = names[h[0]:names.index(b"\0", h[0])].decode()
        data = b"" if h[1] == 8 else blob[h[4]:h[4] + h[5]]     # SHT_NOBITS has no file bytes
        out[nm] = (h[1], data, h[5])
    return out


def _nv_info(data: bytes):
    """(attribute, payload) records of an ``.nv.info`` section."""
    off = 0
    while off + 2 <= len(data):
        fmt, attr = data[off], data[off + 1]
        if fmt == _EIFMT_SVAL or fmt == _EIFMT_HVAL:
            size, = struct.unpack_from("<H", data, off + 2)
            payload = data[off + 4:off + 4 + size] if fmt == _EIFMT_SVAL else data[off + 2:off + 4]
            off += 4 + (size if fmt == _EIFMT_SVAL else 0)
        else:       # EIFMT_NVAL (no value) / EIFMT_BVAL (one byte)
            payload = data[off + 2:off + 4] if fmt == 0x02 else b""
            off += 2 if fmt == 0x01 else 4
        yield attr, payload


def _symbols(secs: dict) -> list[str]:
    if ".symtab" not in secs or ".strtab" not in secs:
        return []
    sym, strs = secs[".symtab"][1], secs[".strtab"][1]
    out = []
    for off in range(0, len(sym), 24):
        name_off, = struct.unpack_from("<I", sym, off)
        out.append(strs[name_off:strs.index(b"\0", name_off)].decode())
    return out


def cubin_resources(cubin: bytes) -> dict:
    """Kernel name -> :class:`KernelResources`, read from the cubin's ELF sections."""
    if not cubin:
        return {}
    secs = _elf_sections(cubin)
    syms = _symbols(secs)
    regs: dict = {}
    reserved = ".nv.reservedSmem.offset0" in syms
    for attr, payload in _nv_info(secs.get(".nv.info", (0, b"", 0))[1]):
        if attr == EIATTR_REGCOUNT and len(payload) >= 8:
            sym, val = struct.unpack_from("<II", payload)
            if sym < len(syms):
                regs[syms[sym]] = val
    out = {}
    for nm in secs:
        if not nm.startswith(".text."):
            continue
        k = nm[len(".text."):]
        frame = 0
        for attr, payload in _nv_info(secs.get(".nv.info." + k, (0, b"", 0))[1]):
            if attr == EIATTR_FRAME_SIZE and len(payload) >= 8:
                frame = struct.unpack_from("<II", payload)[1]
        shared = secs.get(".nv.shared." + k, (0, b"", 0))[2]
        if shared and reserved:
            shared -= SM90_RESERVED_SMEM
        out[k] = KernelResources(regs.get(k, 0), int(shared), int(frame))
    return out


def to_json(b: CudaBinary) -> str:
    """The resources of ``b`` as JSON text."""
    return json.dumps({"arch": b.arch, "kernels": {k: v.to_dict() for k, v in b.resources.items()}})
