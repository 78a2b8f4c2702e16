"""Packed constant GEMM operands of a model-cache entry, stored next to it and mapped on load.

A generated GEMM (``codegen/gemm.py``) whose A or B is a graph constant (a weight) packs it once
into the panel layout its micro-kernel reads (``CompiledGemm.packed_a`` / ``packed_b``).  In a new
process that packing was the first call's largest cost on the model cache's warm path (~0.5 s of
BERT-base's 1.2 s).  This module keeps the packed buffers of a stored executable in
``<cache_dir>/models/<entry key>.packed``; a warm compile maps the file and hands each GEMM step
its buffer, so the first call packs nothing and the weights it was packed from are never read.

**Format.**  16 bytes of magic, a little-endian u64 header length, a JSON header (one record per
packed operand: step index, operand ``a``/``b``, tag, byte offset, floats), zero padding to a
4096-byte boundary, then the buffers, each starting on a 64-byte boundary (the micro-kernel's
packed loads are aligned).

**Invalidation.**  The file belongs to one model-cache entry, whose key already covers the model
file's identity (weights included, through its size, inode and modification time), the options,
the machine and apollo_py's sources.  Each record's *tag* adds what the buffer's layout depends on:
the GEMM's canonical descriptor, blocking and layout (the piece-cache key of the kernel that reads
it: a changed blocking or packing layout is a different tag), the operand, its dtype and shape and
its first and last 16 values.  A record whose tag does not match is not used: that GEMM packs on
its first call as without this store, and the file is rewritten with the new buffers.
"""
from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
import threading

import numpy as np

MAGIC = b"apollo_py-pack1\n"
ALIGN = 64
PAGE = 4096

#: what this process did: buffers mapped from a file, operands packed for storing, files written
STATS = {"mapped": 0, "packed": 0, "written": 0}

#: a warm load that finds no file but another process's writer still writing it waits this long
#: for the file (packing GPT-2's weights takes ~0.5 s, its writer ~0.35 s) before packing itself
WAIT_S = 1.0

_WRITERS: list[threading.Thread] = []     # writer threads (where fork is missing)
_CHILDREN: list[int] = []                   # writer processes not reaped yet


def const_operands(exe):
    """``(step index, GemmStep, "a" | "b", constant array)`` of every constant GEMM operand that
    ``exe`` (a CpuExecutable) packs once."""
    from ..runtime.gemm_step import GemmStep
    for i, s in enumerate(exe.steps):
        if isinstance(s, GemmStep):
            for op, v in s.const_operands():
                src = exe.constants.get(v)
                if isinstance(src, np.ndarray):
                    yield i, s, op, src


def const_operand_names(specs, steps) -> set:
    """Names of the constants that only packed GEMM operands read (``specs``: the executable's
    step specs, ``steps``: its steps, in the same order): once their packed buffers are stored,
    nothing reads these arrays."""
    from ..runtime.gemm_step import GemmStep
    packed, other = set(), set()
    for spec, s in zip(specs, steps):
        ops = {v for _, v in s.const_operands()} if isinstance(s, GemmStep) else set()
        packed |= ops
        other |= {v for v in spec.inputs if v not in ops}
    return packed - other


def tag(step, op: str, src: np.ndarray) -> str:
    """What a packed buffer of ``src`` for ``step``'s operand ``op`` depends on (module docstring)."""
    from ..codegen.gemm import canonical
    cg = step.compiled
    flat = src.reshape(-1)
    h = hashlib.sha256(repr((canonical(cg.desc), cg.blocking, cg.layout, op, src.dtype.str, src.shape))
                       .encode())
    h.update(flat[:16].tobytes())
    h.update(flat[-16:].tobytes())
    return h.hexdigest()


def _pack(step, op: str, src: np.ndarray) -> np.ndarray:
    cg = step.compiled
    return cg.packed_a(src) if op == "a" else cg.packed_b(src)


def load(exe, path: str) -> int:
    """Hand every GEMM step of ``exe`` whose operand has a matching record in the file at
    ``path`` its mapped buffer, and pack the others now (from an aligned copy where the weight
    is a misaligned view of the model file: the pack kernels expect aligned floats); returns
    how many operands were packed (the caller stores them for the next process)."""
    items = list(const_operands(exe))
    if not items:
        return 0
    if not os.path.exists(path):
        wait_for_writer(path, WAIT_S)
    by_key, mm, start, size = {}, b"", 0, 0
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        if mm[:16] != MAGIC:
            raise ValueError("magic")
        n, = struct.unpack_from("<Q", mm, 16)
        by_key = {(r["step"], r["op"]): r for r in json.loads(bytes(mm[24:24 + n]))}
        start = -(-(24 + n) // PAGE) * PAGE
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        by_key = {}
    packed = 0
    for i, s, op, src in items:
        r = by_key.get((i, op))
        if r is not None and r["tag"] == tag(s, op, src) and start + r["off"] + 4 * r["n"] <= size:
            buf = np.ndarray((r["n"],), np.float32, buffer=mm, offset=start + r["off"])
            STATS["mapped"] += 1
        else:
            aligned = src if src.ctypes.data % src.dtype.alignment == 0 else np.array(src)
            buf = _pack(s, op, aligned)
            STATS["packed"] += 1
            packed += 1
        s.adopt_packed(op, src, buf)
    return packed


def store(exe, path: str, background: bool = True) -> bool:
    """Pack every constant GEMM operand of ``exe`` not packed yet (now, in this thread: the first
    call would pack them anyway) and write the buffers to ``path`` atomically.  With
    ``background`` the write runs in a forked child that this process does not wait for -- not
    at exit either (writing GPT-2's 0.5 GB held a short-lived cold process up to half a second
    after its work was done); where fork is missing, in a thread that the interpreter joins at
    exit.  False when there is nothing to store."""
    recs, bufs, off = [], [], 0
    for i, s, op, src in const_operands(exe):
        packed = _pack(s, op, src)      # the buffer adopted or packed before, if there is one
        recs.append({"step": i, "op": op, "tag": tag(s, op, src), "off": off, "n": int(packed.size)})
        bufs.append((off, packed))
        off += -(-packed.nbytes // ALIGN) * ALIGN
    if not recs:
        return False
    header = json.dumps(recs).encode()
    head = MAGIC + struct.pack("<Q", len(header)) + header
    head += b"\0" * (-len(head) % PAGE)
    if not background:
        STATS["written"] += _write(path, head, bufs)
        return True
    _reap_children(block=False)
    if hasattr(os, "fork"):
        try:
            pid = os.fork()
        except OSError:
            pid = -1
        if pid == 0:            # the child: write, then leave without running any exit hooks
            code = 1
            try:
                # hold none of the parent's pipes open (a caller reading its output to the end
                # would wait for this child) nor any other of its files
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                os.closerange(3, 1 << 16)
                code = 0 if _write(path, head, bufs) else 1
            finally:
                os._exit(code)
        if pid > 0:
            _CHILDREN.append(pid)
            STATS["written"] += 1       # counted here: the child's counters are its own
            return True
    def write():
        STATS["written"] += _write(path, head, bufs)
    t = threading.Thread(target=write, name="apollo_py-packed-store")
    _WRITERS.append(t)                  # joined at exit
    t.start()
    return True


def _temp_prefix(path: str, pid: int | str) -> str:
    return f".tmp-{pid}-{os.path.basename(path)}-"


def wait_for_writer(path: str, timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` while a live process's temporary file for ``path`` exists and
    ``path`` itself does not (the cold process's background writer, still writing); True once
    ``path`` exists."""
    import time
    folder, deadline = os.path.dirname(path) or ".", time.monotonic() + timeout_s
    tail = os.path.basename(path) + "-"
    while not os.path.exists(path):
        try:
            names = os.listdir(folder)
        except OSError:
            return False
        writers = [n[5:].split("-", 1)[0] for n in names if n.startswith(".tmp-") and tail in n]
        if not any(_alive(w) for w in writers) or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def _write(path: str, head: bytes, bufs) -> bool:
    """Write the file (a temporary file ``.tmp-<pid>-<name>-*`` in the same folder, renamed over
    ``path``; a warm load finding it waits for it: :func:`wait_for_writer`)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=_temp_prefix(path, os.getpid()))
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(head)
            at = 0
            for o, b in bufs:
                f.write(b"\0" * (o - at))
                f.write(memoryview(np.ascontiguousarray(b)).cast("B"))
                at = o + b.nbytes
        os.replace(tmp, path)
        return True
    except OSError:     # a cache dir that cannot be written only costs the warm path
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def _reap_children(block: bool) -> None:
    """Collect the exit status of finished writer children (all of them when ``block``)."""
    for pid in list(_CHILDREN):
        try:
            done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 0
        if done:
            _CHILDREN.remove(pid)
            STATS["written"] -= status != 0         # counted when it started


def wait() -> None:
    """Wait for this process's background writes (tests; a process never waits for them)."""
    while _WRITERS:
        _WRITERS.pop().join()
    _reap_children(block=True)
