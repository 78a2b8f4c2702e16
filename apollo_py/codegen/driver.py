"""The driver: one native function that runs a list of kernel calls without Python between them.

A compiled plan's schedule is a list of kernel calls ``f(void **args, int64 lo, int64 hi)``
(and, optionally, cblas ``?gemm`` calls).  Calling each from Python costs a ctypes call plus
packing its argument array: 3-6 us a kernel, tens of times a kernel's own run time on tiny
tensors.  The driver instead gets a *program* (an int64 array, built once per plan by
``runtime/drive.py``) and a *value table* (one pointer per buffer, filled once per arena for
arena slots and constants) and performs every call itself::

    void apollo_drive(int64 *prog, int64 nsteps, void **vals, int64 maxargs,
                      int64 *objs, int64 nobjs, int64 data_offset)

``objs`` holds ``nobjs`` pairs ``(value index, PyObject *)`` of the buffers that change per call
(graph inputs, fresh outputs, numpy steps' results): the driver reads each array's data pointer
at ``data_offset`` bytes into the object (numpy's ``PyArrayObject_fields.data``, what the C-API's
``PyArray_DATA`` reads; :func:`data_offset` checks the offset on this interpreter), so Python
only stores ``id(array)`` instead of paying ~0.9 us for ``array.ctypes.data``.

Program steps, each a run of int64 words:

* kernel: ``0, fn, lo, hi, nargs, idx_0 .. idx_{nargs-1}``: ``fn(&vals[idx_k]..., lo, hi)``;
* copy: ``5, dst, src, nbytes``: ``memmove(vals[dst], vals[src], nbytes)`` (a BLAS update's
  accumulator copied into its output first);
* gemm: ``kind, fn, trans_a, trans_b, m, n, k, alpha, beta, a, lda, b, ldb, c, ldc`` with
  ``kind`` 1 / 2 for cblas ``sgemm`` / ``dgemm`` with 64-bit integers, 3 / 4 with 32-bit ones;
  ``alpha``/``beta`` are the bits of a float64, ``a``, ``b``, ``c`` value indices; row-major.

The function is the same for every plan, so it is compiled once per process (no per-plan
compile time, nothing to cache on disk) and a step costs a few nanoseconds.
"""
from __future__ import annotations

import ctypes
import threading

from ..errors import CompileError

KERNEL, SGEMM64, DGEMM64, SGEMM32, DGEMM32, COPY = 0, 1, 2, 3, 4, 5

#: words of a gemm step
GEMM_WORDS = 15

DRIVE_CFUNCTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)


def _gemm_block(kind: int, fty: str, ity: str) -> list[str]:
    """IR of one cblas ?gemm step (``fty`` float/double, ``ity`` i64/i32)."""
    b = f"g{kind}"
    lines = [f"{b}:"]
    for k, name in enumerate(("fn", "ta", "tb", "m", "n", "k", "al", "be", "a", "lda", "b", "ldb", "c", "ldc")):
        lines += [f"  %{b}.o{name} = add i64 %pc, {k + 1}",
                  f"  %{b}.p{name} = getelementptr i64, ptr %prog, i64 %{b}.o{name}",
                  f"  %{b}.w{name} = load i64, ptr %{b}.p{name}"]
    lines.append(f"  %{b}.fp = inttoptr i64 %{b}.wfn to ptr")
    for t in ("ta", "tb"):      # CblasNoTrans 111, CblasTrans 112
        lines.append(f"  %{b}.{t}32 = trunc i64 %{b}.w{t} to i32")
        lines.append(f"  %{b}.c{t} = add i32 %{b}.{t}32, 111")
    ints = {}
    for name in ("m", "n", "k", "lda", "ldb", "ldc"):
        if ity == "i32":
            lines.append(f"  %{b}.i{name} = trunc i64 %{b}.w{name} to i32")
            ints[name] = f"%{b}.i{name}"
        else:
            ints[name] = f"%{b}.w{name}"
    for name in ("al", "be"):
        lines.append(f"  %{b}.d{name} = bitcast i64 %{b}.w{name} to double")
        if fty == "float":
            lines.append(f"  %{b}.f{name} = fptrunc double %{b}.d{name} to float")
        else:
            lines.append(f"  %{b}.f{name} = fadd double %{b}.d{name}, 0.0")
    for name in ("a", "b", "c"):
        lines += [f"  %{b}.v{name} = getelementptr ptr, ptr %vals, i64 %{b}.w{name}",
                  f"  %{b}.x{name} = load ptr, ptr %{b}.v{name}"]
    args = (f"i32 101, i32 %{b}.cta, i32 %{b}.ctb, {ity} {ints['m']}, {ity} {ints['n']}, {ity} {ints['k']}, "
            f"{fty} %{b}.fal, ptr %{b}.xa, {ity} {ints['lda']}, ptr %{b}.xb, {ity} {ints['ldb']}, "
            f"{fty} %{b}.fbe, ptr %{b}.xc, {ity} {ints['ldc']}")
    lines += [f"  call void %{b}.fp({args})",
              f"  %{b}.next = add i64 %pc, {GEMM_WORDS}",
              "  br label %next"]
    return lines


def driver_ir() -> str:
    """LLVM IR text of ``apollo_drive`` (see the module docstring)."""
    gemm = [(SGEMM64, "float", "i64"), (DGEMM64, "double", "i64"), (SGEMM32, "float", "i32"),
            (DGEMM32, "double", "i32")]
    lines = [
        "define void @apollo_drive(ptr %prog, i64 %nsteps, ptr %vals, i64 %maxargs, ptr %objs, "
        "i64 %nobjs, i64 %off) {",
        "entry:",
        "  %scratch = alloca ptr, i64 %maxargs",
        "  br label %objloop",
        # per-call buffers: vals[idx] = ((PyArrayObject *) obj)->data
        "objloop:",
        "  %j = phi i64 [0, %entry], [%jnext, %objbody]",
        "  %jdone = icmp sge i64 %j, %nobjs",
        "  br i1 %jdone, label %step, label %objbody",
        "objbody:",
        "  %j2 = shl i64 %j, 1",
        "  %pidx = getelementptr i64, ptr %objs, i64 %j2",
        "  %oidx = load i64, ptr %pidx",
        "  %j21 = add i64 %j2, 1",
        "  %pobj = getelementptr i64, ptr %objs, i64 %j21",
        "  %oobj = load i64, ptr %pobj",
        "  %odat = add i64 %oobj, %off",
        "  %pdat = inttoptr i64 %odat to ptr",
        "  %data = load ptr, ptr %pdat",
        "  %slot = getelementptr ptr, ptr %vals, i64 %oidx",
        "  store ptr %data, ptr %slot",
        "  %jnext = add i64 %j, 1",
        "  br label %objloop",
        "step:",
        "  %pc = phi i64 [0, %objloop], [%pcnext, %next]",
        "  %s = phi i64 [0, %objloop], [%snext, %next]",
        "  %done = icmp sge i64 %s, %nsteps",
        "  br i1 %done, label %exit, label %body",
        "body:",
        "  %pkind = getelementptr i64, ptr %prog, i64 %pc",
        "  %kind = load i64, ptr %pkind",
        "  switch i64 %kind, label %kernel [" + " ".join(f"i64 {k}, label %g{k}" for k, _, _ in gemm)
        + f" i64 {COPY}, label %copy]",
        "copy:",
        *(line for k, name in enumerate(("dst", "src", "len")) for line in (
            f"  %c.o{name} = add i64 %pc, {k + 1}",
            f"  %c.p{name} = getelementptr i64, ptr %prog, i64 %c.o{name}",
            f"  %c.w{name} = load i64, ptr %c.p{name}")),
        "  %c.vdst = getelementptr ptr, ptr %vals, i64 %c.wdst",
        "  %c.xdst = load ptr, ptr %c.vdst",
        "  %c.vsrc = getelementptr ptr, ptr %vals, i64 %c.wsrc",
        "  %c.xsrc = load ptr, ptr %c.vsrc",
        "  call void @llvm.memmove.p0.p0.i64(ptr %c.xdst, ptr %c.xsrc, i64 %c.wlen, i1 false)",
        "  %c.next = add i64 %pc, 4",
        "  br label %next",
        "kernel:",
        "  %o1 = add i64 %pc, 1",
        "  %p1 = getelementptr i64, ptr %prog, i64 %o1",
        "  %fnw = load i64, ptr %p1",
        "  %o2 = add i64 %pc, 2",
        "  %p2 = getelementptr i64, ptr %prog, i64 %o2",
        "  %lo = load i64, ptr %p2",
        "  %o3 = add i64 %pc, 3",
        "  %p3 = getelementptr i64, ptr %prog, i64 %o3",
        "  %hi = load i64, ptr %p3",
        "  %o4 = add i64 %pc, 4",
        "  %p4 = getelementptr i64, ptr %prog, i64 %o4",
        "  %nargs = load i64, ptr %p4",
        "  %argbase = add i64 %pc, 5",
        "  br label %argloop",
        "argloop:",
        "  %i = phi i64 [0, %kernel], [%inext, %argbody]",
        "  %more = icmp slt i64 %i, %nargs",
        "  br i1 %more, label %argbody, label %call",
        "argbody:",
        "  %q = add i64 %argbase, %i",
        "  %pq = getelementptr i64, ptr %prog, i64 %q",
        "  %idx = load i64, ptr %pq",
        "  %pv = getelementptr ptr, ptr %vals, i64 %idx",
        "  %v = load ptr, ptr %pv",
        "  %ps = getelementptr ptr, ptr %scratch, i64 %i",
        "  store ptr %v, ptr %ps",
        "  %inext = add i64 %i, 1",
        "  br label %argloop",
        "call:",
        "  %fn = inttoptr i64 %fnw to ptr",
        "  call void %fn(ptr %scratch, i64 %lo, i64 %hi)",
        "  %kpc = add i64 %argbase, %nargs",
        "  br label %next",
    ]
    for kind, fty, ity in gemm:
        lines += _gemm_block(kind, fty, ity)
    lines += [
        "next:",
        "  %pcnext = phi i64 [%kpc, %call], [%c.next, %copy], "
        + ", ".join(f"[%g{k}.next, %g{k}]" for k, _, _ in gemm),
        "  %snext = add i64 %s, 1",
        "  br label %step",
        "exit:",
        "  ret void",
        "}",
        "declare void @llvm.memmove.p0.p0.i64(ptr, ptr, i64, i1)",
    ]
    return "\n".join(lines) + "\n"


_lock = threading.Lock()
_state: dict = {}


def drive_function():
    """The process-wide compiled ``apollo_drive`` as a ctypes function (compiled on first use;
    calls release the GIL)."""
    with _lock:
        fn = _state.get("fn")
        if fn is None:
            from .llvm import _compile_lock, host
            h = host()
            with _compile_lock:
                try:
                    mod = h.llvm.parse_assembly(driver_ir())
                    mod.verify()
                except RuntimeError as exc:
                    raise CompileError(f"driver: invalid LLVM IR: {exc}") from exc
                mod.triple = h.triple
                engine = h.llvm.create_mcjit_compiler(mod, h.target_machine())
                engine.finalize_object()
            address = engine.get_function_address("apollo_drive")
            if not address:
                raise CompileError("driver: apollo_drive has no address")
            _state["engine"] = engine       # owns the code
            fn = _state["fn"] = DRIVE_CFUNCTYPE(address)
        return fn


def data_offset() -> int | None:
    """Byte offset of a numpy array's data pointer inside its PyObject on this interpreter
    (``PyArrayObject_fields.data``, right after the object header), or None when probing two
    arrays does not find it there (another numpy ABI): callers then pass pointers instead."""
    with _lock:
        if "offset" not in _state:
            import numpy as np
            found = None
            probes = [np.zeros(3, np.float32), np.arange(5.0)[1:]]
            header = object.__basicsize__       # 16 on a standard CPython build
            for off in (header,):
                if all(ctypes.c_void_p.from_address(id(a) + off).value == a.ctypes.data for a in probes):
                    found = off
            _state["offset"] = found
        return _state["offset"]
