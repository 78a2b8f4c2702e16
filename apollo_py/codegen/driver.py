"""The driver: one native function that runs a list of kernel calls without Python between them.

A compiled plan's schedule is a list of kernel calls ``f(void **args, int64 lo, int64 hi)``
(and, optionally, cblas ``?gemm`` calls).  Calling each from Python costs a ctypes call plus
packing its argument array: 3-6 us a kernel, tens of times a kernel's own run time on tiny
tensors.  The driver instead gets a *program* (an int64 array, built once per plan by
``runtime/drive.py``) and a *value table* (one pointer per buffer, filled once per arena for
arena slots and constants) and performs every call itself::

    void apollo_drive(int64 *prog, int64 nsteps, void **vals, int64 maxargs,
                      int64 *objs, int64 nobjs, int64 data_offset, int64 *sync)

``objs`` holds ``nobjs`` pairs ``(value index, PyObject *)`` of the buffers that change per call
(graph inputs, fresh outputs, numpy steps' results): the driver reads each array's data pointer
at ``data_offset`` bytes into the object (numpy's ``PyArrayObject_fields.data``, what the C-API's
``PyArray_DATA`` reads; :func:`data_offset` checks the offset on this interpreter), so Python
only stores ``id(array)`` instead of paying ~0.9 us for ``array.ctypes.data``.

Program steps, each a run of int64 words:

* kernel: ``0, fn, lo, hi, nargs, idx_0 .. idx_{nargs-1}``: ``fn(&vals[idx_k]..., lo, hi)``;
* parallel kernel: ``6, fn, chunk, hi, nargs, idx_0 ..``: ``fn(args, lo, hi)`` over ``[0, hi)`` in
  chunks of ``chunk`` iterations shared with a helper thread through ``sync`` (see
  :func:`helper_ir`; ``sync`` null: one call over the whole range);
* copy: ``5, dst, src, nbytes``: ``memmove(vals[dst], vals[src], nbytes)`` (a BLAS update's
  accumulator copied into its output first);
* gemm: ``kind, fn, trans_a, trans_b, m, n, k, alpha, beta, a, lda, b, ldb, c, ldc`` with
  ``kind`` 1 / 2 for cblas ``sgemm`` / ``dgemm`` with 64-bit integers, 3 / 4 with 32-bit ones;
  ``alpha``/``beta`` are the bits of a float64, ``a``, ``b``, ``c`` value indices; row-major.

The function is the same for every plan, so it is compiled once per process (no per-plan
compile time, nothing to cache on disk) and a step costs a few nanoseconds.

**Helper thread.**  A segment with parallel steps is run with ``sync``, ``SYNC_WORDS`` int64 of
shared state, and one thread-pool worker is asked to run ``apollo_help(sync)``: it joins unless
the call is already over, then claims chunks of whatever parallel step the caller has
published, until the caller says the call is over.  The caller never waits for a helper that
has not joined (it claims every chunk itself), only for chunks a helper has claimed and, at the
end, for a joined helper to leave -- so a worker that wakes late costs nothing, where a thread
pool dispatch from Python costs ~35 us per step (machine.py).  Spin-waits call ``sched_yield``
after 64 spins.
"""
from __future__ import annotations

import ctypes
import threading

from ..errors import CompileError

KERNEL, SGEMM64, DGEMM64, SGEMM32, DGEMM32, COPY, PARALLEL = 0, 1, 2, 3, 4, 5, 6

#: words of the shared state of a call with a helper thread (see ``helper_ir``)
SYNC_WORDS = 10
#: low 32 bits of the claim word once a parallel step is closed: no index is below it
CLOSED = 0x7FFFFFFF

#: words of a gemm step
GEMM_WORDS = 15

DRIVE_CFUNCTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p)
HELP_CFUNCTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
BLOCK_CFUNCTYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
#: int64 words of an ``apollo_drive_block`` call block
BLOCK_WORDS = 8


def _wait(name: str, cond: list, ok: str, sync: str = "%sync") -> list[str]:
    """IR of a spin-wait: block ``{name}.pre`` (branch there) loops until the i1 ``%{name}.c``
    that the lines ``cond`` compute holds, then branches to ``ok``.  After 64 spins it calls
    ``sched_yield`` (its address is word 9 of ``sync``) on every spin, so that on a busy machine
    a waiter gives its core to the thread it waits for."""
    return [
        f"{name}.pre:",
        f"  br label %{name}",
        f"{name}:",
        f"  %{name}.n = phi i64 [0, %{name}.pre], [%{name}.n1, %{name}.spin], [%{name}.n1, %{name}.yield]",
        *cond,
        f"  br i1 %{name}.c, label %{ok}, label %{name}.spin",
        f"{name}.spin:",
        f"  %{name}.n1 = add i64 %{name}.n, 1",
        f"  %{name}.many = icmp ugt i64 %{name}.n, 64",
        f"  br i1 %{name}.many, label %{name}.yield, label %{name}",
        f"{name}.yield:",
        f"  %{name}.py = getelementptr i64, ptr {sync}, i64 9",
        f"  %{name}.yw = load i64, ptr %{name}.py",
        f"  %{name}.yf = inttoptr i64 %{name}.yw to ptr",
        f"  %{name}.yr = call i32 %{name}.yf()",
        f"  br label %{name}",
    ]


def _sync_word(name: str, k: int, sync: str = "%sync") -> str:
    return f"  %{name} = getelementptr i64, ptr {sync}, i64 {k}"


def _parallel_block() -> list[str]:
    """IR of a parallel kernel step ``6, fn, chunk, hi, nargs, idx...`` run by the caller with a
    helper thread that may join (``helper_ir``): the caller publishes the step in the shared
    state (``%sync``; null: no helper, the caller runs ``fn(args, 0, hi)``), claims chunks of
    ``chunk`` iterations with atomic adds on the claim word ``seq << 32 | next`` like the helper
    does, waits until every claimed chunk is done, then closes the word."""
    words = [f"  %pw.o{k} = add i64 %pc, {k}" for k in range(1, 5)]
    for k, name in enumerate(("fnw", "chunk", "hi", "nargs"), start=1):
        words += [f"  %pw.p{k} = getelementptr i64, ptr %prog, i64 %pw.o{k}",
                  f"  %p.{name} = load i64, ptr %pw.p{k}"]
    return [
        "par:",
        *words,
        "  %p.argbase = add i64 %pc, 5",
        "  br label %pargloop",
        "pargloop:",
        "  %pi = phi i64 [0, %par], [%pinext, %pargbody]",
        "  %pmore = icmp slt i64 %pi, %p.nargs",
        "  br i1 %pmore, label %pargbody, label %pready",
        "pargbody:",
        "  %ppq0 = add i64 %p.argbase, %pi",
        "  %ppq = getelementptr i64, ptr %prog, i64 %ppq0",
        "  %ppidx = load i64, ptr %ppq",
        "  %ppv = getelementptr ptr, ptr %vals, i64 %ppidx",
        "  %ppval = load ptr, ptr %ppv",
        "  %pps = getelementptr ptr, ptr %scratch, i64 %pi",
        "  store ptr %ppval, ptr %pps",
        "  %pinext = add i64 %pi, 1",
        "  br label %pargloop",
        "pready:",
        "  %p.fn = inttoptr i64 %p.fnw to ptr",
        "  %p.nosync = icmp eq ptr %sync, null",
        "  br i1 %p.nosync, label %psolo, label %ppub",
        "psolo:",
        "  call void %p.fn(ptr %scratch, i64 0, i64 %p.hi)",
        "  br label %pend",
        "ppub:",
        "  %seq0 = load i64, ptr %seqp",
        "  %seq = add i64 %seq0, 1",
        "  store i64 %seq, ptr %seqp",
        _sync_word("s1", 1), _sync_word("s2", 2), _sync_word("s3", 3), _sync_word("s4", 4),
        _sync_word("s5", 5),
        "  store i64 %p.fnw, ptr %s1",
        "  %p.args = ptrtoint ptr %scratch to i64",
        "  store i64 %p.args, ptr %s2",
        "  store i64 %p.hi, ptr %s3",
        "  store i64 %p.chunk, ptr %s4",
        "  store atomic i64 0, ptr %s5 monotonic, align 8",
        "  %p.word = shl i64 %seq, 32",
        "  store atomic i64 %p.word, ptr %sync release, align 8",      # published
        "  br label %pclaim",
        "pclaim:",
        "  %p.old = atomicrmw add ptr %sync, i64 %p.chunk seq_cst",
        "  %p.idx = and i64 %p.old, 4294967295",
        "  %p.has = icmp slt i64 %p.idx, %p.hi",
        "  br i1 %p.has, label %prun, label %pwait.pre",
        "prun:",
        "  %p.e0 = add i64 %p.idx, %p.chunk",
        "  %p.elt = icmp slt i64 %p.e0, %p.hi",
        "  %p.e = select i1 %p.elt, i64 %p.e0, i64 %p.hi",
        "  call void %p.fn(ptr %scratch, i64 %p.idx, i64 %p.e)",
        "  %p.cnt = sub i64 %p.e, %p.idx",
        "  %p.dd = atomicrmw add ptr %s5, i64 %p.cnt seq_cst",
        "  br label %pclaim",
        *_wait("pwait", ["  %pwait.d = load atomic i64, ptr %s5 acquire, align 8",
                         "  %pwait.c = icmp sge i64 %pwait.d, %p.hi"], "pclose"),
        "pclose:",
        f"  %p.closed = or i64 %p.word, {CLOSED}",
        "  store atomic i64 %p.closed, ptr %sync seq_cst, align 8",
        "  fence seq_cst",       # the next step's parameters are written after the close
        "  br label %pend",
        "pend:",
        "  %pkpc = add i64 %p.argbase, %p.nargs",
        "  br label %next",
    ]


def helper_ir() -> str:
    """LLVM IR of ``apollo_help(sync, lo, hi)`` (the thread pool's kernel ABI; ``lo``, ``hi``
    unused): a helper thread of one driver call.  It joins (word 6: 0 -> 1) unless the call
    already finished (the caller set it to 2), then claims chunks of the published parallel
    step (words 1-4: fn, args, hi, chunk) with compare-and-swap on the claim word 0 (so a
    claim of a step that the caller closed or replaced fails), adds the iterations it ran to
    word 5, and leaves when the caller sets word 7 (saying so in word 8).  Sync words:
    0 claim, 1 fn, 2 args, 3 hi, 4 chunk, 5 done, 6 joined, 7 finish, 8 left, 9 sched_yield."""
    return "\n".join([
        "define void @apollo_help(ptr %sync, i64 %lo, i64 %hi) {",
        "entry:",
        _sync_word("j", 6), _sync_word("f", 7), _sync_word("l", 8), _sync_word("s1", 1),
        _sync_word("s2", 2), _sync_word("s3", 3), _sync_word("s4", 4), _sync_word("s5", 5),
        "  %jr = cmpxchg ptr %j, i64 0, i64 1 seq_cst seq_cst",
        "  %jok = extractvalue { i64, i1 } %jr, 1",
        "  br i1 %jok, label %loop, label %ret",
        "loop:",
        "  %n = phi i64 [0, %entry], [0, %run], [%n, %try], [%n1, %idle], [%n1, %yield]",
        "  %fin = load atomic i64, ptr %f acquire, align 8",
        "  %isfin = icmp ne i64 %fin, 0",
        "  br i1 %isfin, label %leave, label %look",
        "look:",
        "  %w = load atomic i64, ptr %sync acquire, align 8",
        "  %seq = lshr i64 %w, 32",
        "  %idx = and i64 %w, 4294967295",
        "  %h = load i64, ptr %s3",
        "  %ch = load i64, ptr %s4",
        "  %fnw = load i64, ptr %s1",
        "  %aw = load i64, ptr %s2",
        "  %pub = icmp ne i64 %seq, 0",
        "  %lt = icmp slt i64 %idx, %h",
        "  %has = and i1 %pub, %lt",
        "  br i1 %has, label %try, label %idle",
        "try:",
        "  %wn = add i64 %w, %ch",
        "  %cr = cmpxchg ptr %sync, i64 %w, i64 %wn seq_cst seq_cst",
        "  %cok = extractvalue { i64, i1 } %cr, 1",
        "  br i1 %cok, label %run, label %loop",
        "run:",
        "  %e0 = add i64 %idx, %ch",
        "  %elt = icmp slt i64 %e0, %h",
        "  %e = select i1 %elt, i64 %e0, i64 %h",
        "  %fn = inttoptr i64 %fnw to ptr",
        "  %args = inttoptr i64 %aw to ptr",
        "  call void %fn(ptr %args, i64 %idx, i64 %e)",
        "  %cnt = sub i64 %e, %idx",
        "  %dd = atomicrmw add ptr %s5, i64 %cnt seq_cst",
        "  br label %loop",
        "idle:",
        "  %n1 = add i64 %n, 1",
        "  %many = icmp ugt i64 %n, 64",
        "  br i1 %many, label %yield, label %loop",
        "yield:",
        _sync_word("py", 9),
        "  %yw = load i64, ptr %py",
        "  %yf = inttoptr i64 %yw to ptr",
        "  %yr = call i32 %yf()",
        "  br label %loop",
        "leave:",
        "  store atomic i64 1, ptr %l release, align 8",
        "  ret void",
        "ret:",
        "  ret void",
        "}",
    ]) + "\n"


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
        "i64 %nobjs, i64 %off, ptr %sync) {",
        "entry:",
        "  %scratch = alloca ptr, i64 %maxargs",
        "  %seqp = alloca i64",
        "  store i64 0, ptr %seqp",
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
        + f" i64 {COPY}, label %copy i64 {PARALLEL}, label %par]",
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
    lines += _parallel_block()
    lines += [
        "next:",
        "  %pcnext = phi i64 [%kpc, %call], [%c.next, %copy], [%pkpc, %pend], "
        + ", ".join(f"[%g{k}.next, %g{k}]" for k, _, _ in gemm),
        "  %snext = add i64 %s, 1",
        "  br label %step",
        # a helper thread (helper_ir) that joined is told to leave and waited for; one that
        # has not joined yet finds word 6 closed and returns at once
        "exit:",
        "  %x.nosync = icmp eq ptr %sync, null",
        "  br i1 %x.nosync, label %ret, label %xfin",
        "xfin:",
        _sync_word("xf", 7), _sync_word("xj", 6), _sync_word("xl", 8),
        "  store atomic i64 1, ptr %xf seq_cst, align 8",
        "  %xr = cmpxchg ptr %xj, i64 0, i64 2 seq_cst seq_cst",
        "  %xok = extractvalue { i64, i1 } %xr, 1",
        "  br i1 %xok, label %ret, label %xwait.pre",
        *_wait("xwait", ["  %xwait.v = load atomic i64, ptr %xl acquire, align 8",
                         "  %xwait.c = icmp ne i64 %xwait.v, 0"], "ret"),
        "ret:",
        "  ret void",
        "}",
        "declare void @llvm.memmove.p0.p0.i64(ptr, ptr, i64, i1)",
    ]
    return "\n".join(lines) + "\n"


def block_ir() -> str:
    """LLVM IR of ``apollo_drive_block(int64 *call)``: ``apollo_drive`` with its eight arguments
    read from ``call[0..7]`` (prog, nsteps, vals, maxargs, objs, nobjs, data_offset, sync).  A
    ctypes call converts one argument instead of eight: ~0.45 us instead of ~1.3 us a call,
    most of a one-kernel model's fixed cost (runtime/drive.py keeps one block per segment and
    arena, written once)."""
    names = ("prog", "nsteps", "vals", "maxargs", "objs", "nobjs", "off", "sync")
    ptrs = {"prog", "vals", "objs", "sync"}
    lines = ["define void @apollo_drive_block(ptr %c) {", "entry:"]
    for k, n in enumerate(names):
        lines += [f"  %p.{n} = getelementptr i64, ptr %c, i64 {k}", f"  %w.{n} = load i64, ptr %p.{n}"]
        if n in ptrs:
            lines.append(f"  %a.{n} = inttoptr i64 %w.{n} to ptr")
    args = ", ".join(f"ptr %a.{n}" if n in ptrs else f"i64 %w.{n}" for n in names)
    lines += [f"  call void @apollo_drive({args})", "  ret void", "}"]
    return "\n".join(lines) + "\n"


def spin_ir(x86: bool) -> str:
    """LLVM IR of ``i64 apollo_spin(ptr word, i64 seen, i64 cycles)``: spin until the int64 at
    ``word`` differs from ``seen`` (returns 1) or ``cycles`` of the cycle counter have passed
    (returns 0), with ``pause`` between reads on x86; and ``i64 apollo_cycles()``, the counter.
    A thread-pool worker waits here for its next job (runtime/threadpool.py) before it blocks
    on the job queue: a woken thread takes 0.1-0.3 ms to start on an idle VM, a spinning one
    microseconds."""
    pause = ["  call void @llvm.x86.sse2.pause()"] if x86 else []
    return "\n".join([
        "declare i64 @llvm.readcyclecounter()",
        *(["declare void @llvm.x86.sse2.pause()"] if x86 else []),
        "define i64 @apollo_cycles() {",
        "  %t = call i64 @llvm.readcyclecounter()",
        "  ret i64 %t",
        "}",
        "define i64 @apollo_spin(ptr %word, i64 %seen, i64 %cycles) {",
        "entry:",
        "  %t0 = call i64 @llvm.readcyclecounter()",
        "  br label %loop",
        "loop:",
        "  %v = load atomic i64, ptr %word acquire, align 8",
        "  %new = icmp ne i64 %v, %seen",
        "  br i1 %new, label %yes, label %more",
        "more:",
        *pause,
        "  %t = call i64 @llvm.readcyclecounter()",
        "  %el = sub i64 %t, %t0",
        "  %over = icmp ugt i64 %el, %cycles",
        "  br i1 %over, label %no, label %loop",
        "yes:",
        "  ret i64 1",
        "no:",
        "  ret i64 0",
        "}",
    ]) + "\n"


SPIN_CFUNCTYPE = ctypes.CFUNCTYPE(ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64)
CYCLES_CFUNCTYPE = ctypes.CFUNCTYPE(ctypes.c_int64)

_lock = threading.Lock()
_state: dict = {}


def jit_module(ir: str, what: str):
    """``ir`` parsed, verified and compiled for the host by MCJIT; returns the engine, which owns
    the code (keep it alive while its functions are called).  CompileError names ``what``."""
    from .llvm import _compile_lock, host
    h = host()
    with _compile_lock:
        try:
            mod = h.llvm.parse_assembly(ir)
            mod.verify()
        except RuntimeError as exc:
            raise CompileError(f"{what}: invalid LLVM IR: {exc}") from exc
        mod.triple = h.triple
        engine = h.llvm.create_mcjit_compiler(mod, h.target_machine())
        engine.finalize_object()
    return engine


def drive_function():
    """The process-wide compiled ``apollo_drive`` as a ctypes function (compiled on first use;
    calls release the GIL)."""
    with _lock:
        fn = _state.get("fn")
        if fn is None:
            engine = jit_module(driver_ir() + helper_ir() + block_ir(), "driver")
            address = engine.get_function_address("apollo_drive")
            if not address:
                raise CompileError("driver: apollo_drive has no address")
            helper = engine.get_function_address("apollo_help")
            if not helper:
                raise CompileError("driver: apollo_help has no address")
            block = engine.get_function_address("apollo_drive_block")
            if not block:
                raise CompileError("driver: apollo_drive_block has no address")
            _state["engine"] = engine       # owns the code
            _state["help"] = HELP_CFUNCTYPE(helper)
            _state["block"] = BLOCK_CFUNCTYPE(block)
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


def drive_block_function():
    """The compiled ``apollo_drive_block`` (:func:`block_ir`) as a ctypes function of one pointer."""
    drive_function()
    return _state["block"]


def spin_functions():
    """``(apollo_spin, apollo_cycles)`` (:func:`spin_ir`) as ctypes functions (calls release the
    GIL), or None off x86-64, where the cycle counter may not count."""
    with _lock:
        if "spin" not in _state:
            from .llvm import host
            if not host().triple.startswith(("x86_64", "amd64")):
                _state["spin"] = None
                return None
            engine = jit_module(spin_ir(True), "the spin-wait")
            _state["spin_engine"] = engine
            _state["spin"] = (SPIN_CFUNCTYPE(engine.get_function_address("apollo_spin")),
                              CYCLES_CFUNCTYPE(engine.get_function_address("apollo_cycles")))
        return _state["spin"]


def help_function():
    """The compiled ``apollo_help`` (``helper_ir``) as a ctypes function, the pool's kernel ABI."""
    drive_function()
    return _state["help"]


def sched_yield_address() -> int:
    """Address of libc's ``sched_yield`` (word 9 of a helper call's shared state), 0 if none: the
    spin-waits then never yield (they only spin)."""
    with _lock:
        if "yield" not in _state:
            try:
                _state["yield"] = ctypes.cast(ctypes.CDLL(None).sched_yield, ctypes.c_void_p).value or 0
            except (OSError, AttributeError):
                _state["yield"] = 0
        return _state["yield"]
