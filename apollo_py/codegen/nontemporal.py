"""Non-temporal (streaming) stores of large kernel outputs, LLVM back end (x86).

An ordinary store to a line that is not in cache first reads the line (read-for-ownership),
so a kernel writing a large output moves 3 bytes per byte written (read in, RFO, write back)
instead of 2.  Streaming stores (``movntps``) write whole lines without reading them.

How a kernel gets them (all in the renderer; the runtime is unchanged):

1. :func:`nontemporal_params` picks the params to stream: outputs of at least
   ``NT_MIN_BYTES`` (or ``NT_MIN_OUTPUT_BYTES`` when the kernel moves ``NT_MIN_BYTES`` in
   all) that the kernel never reads, every store to which sits directly in an innermost
   ``vector`` (or serial) loop at an index ``base + i`` (``i`` that loop's variable, bounds and
   ``base`` multiples of one 64-byte vector), so every widened store covers whole lines,
   and whose loop computes no transcendental (streaming slows those loops down, measured at
   _EXPENSIVE_OPS).
2. The renderer emits a second impl ``<name>.impl.nt`` whose streamed pointer params carry
   ``align 64`` and which ends with ``sfence`` (streaming stores are weakly ordered and another
   thread reads the output next).  The wrapper calls it only when every streamed pointer is
   64-byte aligned at run time (:func:`wrapper_dispatch`), else the ordinary impl -- a user's
   ``out=`` array may be only 16-byte aligned, and there the ``align 64`` would be false.
3. LLVM's loop vectoriser refuses a scalar ``!nontemporal`` store whose alignment is below
   the vector's (X86 ``isLegalNTStore``), so the IR is rendered without it; after O3,
   :func:`mark_nontemporal` adds ``!nontemporal`` to the vector stores of the NT impl whose
   pointer derives only from streamed params and whose alignment (proved by LLVM from the
   ``align 64`` params and the index) is at least the vector's size (or 64 bytes).  The
   metadata is a hint: it changes no value, only how the x86 back end stores.

Measured on the 2-core Xeon (AVX-512) box: a memory-bound kernel with a 48 MiB output runs
0.63x (1 thread) / 0.71x (2 threads) the time of ordinary stores (see NT_MIN_BYTES).  Softmax
[768,128,128] gains nothing measurable (2 threads, interleaved medians, ordinary -> streamed:
3.32 -> 3.36 ms; logsoftmax 3.74 -> 3.67 ms):
its kernel is bound by vector-port throughput (one thread runs 0.46 ns/element whether its rows
are in L2 or not), not by the read-for-ownership traffic streaming removes.
"""
from __future__ import annotations

import hashlib
import re
from functools import lru_cache

from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError

# Outputs smaller than this are left to ordinary stores: a kernel's working set that fits
# in cache is rewritten there (and the next kernel re-reads it from there), which streaming
# would send to memory instead.  Measured on the 2-core Xeon box (L2 4 MiB/core, L3 shared
# and virtualised), o = (a + b[j]) * c[i] over rows of 128 float32, aligned, NT/plain time,
# 1 and 2 threads: 8 MiB out 1.03 / 1.07, 16 MiB 1.01 / 0.98, 24 MiB 0.96 / 1.04,
# 32 MiB 0.88 / 0.96, 48 MiB 0.63 / 0.71, 192 MiB 0.67 / 0.42.
NT_MIN_BYTES = 32 << 20
# ... and outputs of at least NT_MIN_OUTPUT_BYTES stream when the kernel moves at least
# NT_MIN_BYTES in all (its params, read and written): a working set past the last-level cache
# (32 MiB on the 2-core EPYC, Zen 5, 1 MiB L2/core) that the kernel streams through evicts the
# oldest lines first, so the next kernel, reading the output from its start, finds none of it
# in cache whether it was stored ordinarily or not -- the read-for-ownership only costs.
# Measured on that box (2 threads, load 4-5, per-call interleaved medians of 150 calls,
# NT/plain time): LayerNorm [8192, 768] (24 MiB out, 48 MiB moved) 0.68 / 0.71 in two runs,
# and the plain row's time there was 2.4x the streamed one at times (the read-for-ownership
# shares the memory bus with the neighbours); x * s + b over [8192, 768] 0.70 / 0.82.  Under
# the cache size it does not pay (x * s + b: 12 MiB out, 24 moved 1.00; 8 MiB out 1.02).
NT_MIN_OUTPUT_BYTES = 8 << 20
# A loop that stores while it computes a transcendental per element is slowed down by
# streaming on this box, though the same loop with ordinary stores is memory-bound (1 thread,
# o = f(a), rows of 3072 float32, 48 MiB, NT/plain time): 2x 0.58, x/(x*x+1) 0.61, a degree-8
# polynomial 0.77, exp 0.85-0.90, exp(x)*poly 0.96, but exp(x)/(x*x+1) 1.30, sigmoid 1.33,
# tanh 1.58, GELU(tanh) 2.08, log 2.17, exp(exp) 2.56.  Such loops keep ordinary stores.
# (Softmax's store loop only scales the exp values of its row, computed in an earlier loop.)
_EXPENSIVE_OPS = frozenset({"exp", "log", "tanh", "erf", "sigmoid", "pow"})
VECTOR_BYTES = 64          # one AVX-512 register, one cache line: the alignment NT impls need
_SIZES = {"float32": 4, "float64": 8, "float16": 2, "int16": 2, "int32": 4, "int64": 8,
          "uint16": 2, "uint32": 4, "uint64": 8}


@lru_cache(maxsize=None)
def source_digest() -> str:
    """sha256 prefix of this module's source: the rendered text carries it, so a change to
    the post-O3 rewrite changes the piece cache keys of every kernel it applies to."""
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:12]


# ---------------------------------------------------------------------- choosing params

def _stores(s: L.Stmt, loop, guarded: bool, out: list) -> None:
    """Collect ``(store, innermost enclosing For or None, under an If inside that loop)``."""
    if isinstance(s, L.Store):
        out.append((s, loop, guarded))
    elif isinstance(s, L.Block):
        for x in s.stmts:
            _stores(x, loop, guarded, out)
    elif isinstance(s, L.For):
        _stores(s.body, s, False, out)
    elif isinstance(s, L.If):
        _stores(s.then, loop, True, out)
        if s.else_ is not None:
            _stores(s.else_, loop, True, out)


def _expensive(node) -> bool:
    """True when ``node`` (a Stmt/Expr tree) applies an op in _EXPENSIVE_OPS."""
    return any(isinstance(n, (L.Un, L.Bin)) and n.op in _EXPENSIVE_OPS for n in L.walk(node))


def _streamable(store: L.Store, loop, guarded: bool) -> bool:
    """True when every widened store of ``store`` covers whole 64-byte-aligned vectors and
    the loop around it computes no transcendental (see _EXPENSIVE_OPS)."""
    size = _SIZES.get(store.buf.dtype)
    if size is None or loop is None or guarded or _expensive(loop.body):
        return False
    # an innermost serial loop too (LayerNorm's scaling loop keeps private scalars, so it is
    # not marked ``vector``, and LLVM vectorises it all the same): if LLVM leaves it scalar,
    # mark_nontemporal finds no vector store to mark and the stores stay ordinary
    if loop.kind not in ("vector", "serial") or (loop.kind == "serial" and any(
            isinstance(n, L.For) for n in L.walk(loop.body))):
        return False
    vec = VECTOR_BYTES // size
    if not (isinstance(loop.lo, L.Const) and isinstance(loop.hi, L.Const)):
        return False
    if loop.lo.value % vec or loop.hi.value % vec or loop.hi.value <= loop.lo.value:
        return False
    aff = L.affine_form(store.index)
    if aff is None or aff.get(loop.var.name) != 1:
        return False
    return all(c % vec == 0 for name, c in aff.items() if name != loop.var.name)


def nontemporal_params(k: L.Kernel, min_bytes: int | None = None) -> tuple:
    """Names of the params of ``k`` whose stores should stream (in param order).

    A param qualifies when it holds at least ``min_bytes`` (default NT_MIN_BYTES), or at least
    NT_MIN_OUTPUT_BYTES in a kernel whose params hold NT_MIN_BYTES in all (``min_bytes`` given:
    that threshold alone), is never loaded by ``k``, is stored at least once, and every store
    to it is streamable (see the module docstring).  Returns ``()`` when none does.
    """
    limit = NT_MIN_BYTES if min_bytes is None else min_bytes
    if min_bytes is None and sum(p.size * _SIZES.get(p.dtype, 0) for p in k.params) >= NT_MIN_BYTES:
        limit = NT_MIN_OUTPUT_BYTES
    loaded = {n.buf.name for n in L.walk(k.body) if isinstance(n, L.Load)}
    stores: list = []
    _stores(k.body, None, False, stores)
    out = []
    for p in k.params:
        size = _SIZES.get(p.dtype)
        mine = [s for s in stores if s[0].buf.name == p.name]
        if size is None or p.size * size < limit or p.name in loaded or not mine:
            continue
        if all(_streamable(*s) for s in mine):
            out.append(p.name)
    return tuple(out)


# ---------------------------------------------------------------------- rendering

def impl_header_params(params, streamed) -> str:
    """The parameter list of an impl: ``align 64`` on the streamed pointers (legal only because
    :func:`wrapper_dispatch` calls the NT impl with 64-byte-aligned ones)."""
    return ", ".join(f"ptr noalias nocapture{' align %d' % VECTOR_BYTES if p.name in streamed else ''}"
                     f" %p.{p.name}" for p in params)


def wrapper_dispatch(name: str, params, streamed, call_args: str) -> list:
    """Wrapper lines (after the ``%aI`` pointer loads) calling ``name.impl.nt`` when every
    streamed pointer is VECTOR_BYTES-aligned and ``name.impl`` otherwise."""
    lines, acc = [], "0"
    for i, p in enumerate(params):
        if p.name in streamed:
            lines.append(f"  %nt.i{i} = ptrtoint ptr %a{i} to i64")
            lines.append(f"  %nt.o{i} = or i64 {acc}, %nt.i{i}")
            acc = f"%nt.o{i}"
    lines += [f"  %nt.low = and i64 {acc}, {VECTOR_BYTES - 1}",
              "  %nt.ok = icmp eq i64 %nt.low, 0",
              "  br i1 %nt.ok, label %stream, label %plain",
              "stream:", f"  call void @{name}.impl.nt({call_args})", "  ret void",
              "plain:", f"  call void @{name}.impl({call_args})", "  ret void"]
    return lines


def marker(name: str, streamed) -> str:
    """The comment line that tells :func:`apply_after_o3` which impl and params to mark."""
    return f"; nontemporal @{name}.impl.nt {','.join(streamed)} rewrite {source_digest()}"


# ---------------------------------------------------------------------- after O3

_MARKER = re.compile(r"^; nontemporal @(\S+) (\S+) rewrite \w+$", re.M)
_NAME = r"%[-\w.$]+"
_GEP = re.compile(rf"^\s*({_NAME}) = getelementptr\b[^,]*, ptr ({_NAME})")
_PHI = re.compile(rf"^\s*({_NAME}) = phi ptr (.*)$")
_SELECT = re.compile(rf"^\s*({_NAME}) = select i1 [^,]+, ptr ({_NAME}), ptr ({_NAME})")
_STORE = re.compile(rf"^(\s*store <(\d+) x (\w+)> .*, ptr ({_NAME}), align (\d+))(.*)$")
_ELEM_BYTES = {"float": 4, "double": 8, "half": 2, "bfloat": 2, "i8": 1, "i16": 2, "i32": 4, "i64": 8}


def _derived(body: list, roots: set) -> set:
    """Pointer values of ``body`` derived only from ``roots`` through getelementptr, phi and
    select (the greatest such set: start from every candidate and drop any with another
    source until nothing changes)."""
    sources: dict = {}
    for ln in body:
        m = _GEP.match(ln)
        if m:
            sources[m.group(1)] = [m.group(2)]
            continue
        m = _SELECT.match(ln)
        if m:
            sources[m.group(1)] = [m.group(2), m.group(3)]
            continue
        m = _PHI.match(ln)
        if m:
            sources[m.group(1)] = re.findall(r"\[\s*([^,\s]+)\s*,", m.group(2))
    keep = set(sources) | roots
    changed = True
    while changed:
        changed = False
        for v, src in sources.items():
            if v in keep and not all(s in keep for s in src):
                keep.discard(v)
                changed = True
    return keep


def mark_nontemporal(ir: str, fn: str, streamed) -> tuple:
    """Add ``!nontemporal`` to the vector stores of function ``@fn`` in optimised IR text
    ``ir`` whose pointer derives only from the params ``%p.<name>`` (name in ``streamed``)
    and whose alignment is at least min(vector bytes, 64).  Returns ``(text, stores marked)``;
    the text is unchanged when the function is absent or no store qualifies.
    """
    lines = ir.split("\n")
    head = re.compile(rf"^define .*@\"?{re.escape(fn)}\"?\(")
    start = next((i for i, ln in enumerate(lines) if head.match(ln)), None)
    if start is None:
        return ir, 0
    end = next(i for i in range(start, len(lines)) if lines[i] == "}")
    roots = {f"%p.{n}" for n in streamed}
    ok = _derived(lines[start + 1:end], roots)
    md = 1 + max((int(x) for x in re.findall(r"^!(\d+) = ", ir, re.M)), default=-1)
    count = 0
    for i in range(start + 1, end):
        m = _STORE.match(lines[i])
        if not m or "!nontemporal" in m.group(6) or m.group(4) not in ok:
            continue
        nbytes = int(m.group(2)) * _ELEM_BYTES.get(m.group(3), 0)
        if nbytes < 16 or nbytes % 16 or int(m.group(5)) < min(nbytes, VECTOR_BYTES):
            continue
        lines[i] = f"{m.group(1)}, !nontemporal !{md}{m.group(6)}"
        count += 1
    if not count:
        return ir, 0
    return "\n".join(lines) + f"\n!{md} = !{{i32 1}}\n", count


def apply_after_o3(rendered: str, mod, llvm):
    """Return ``mod`` (an optimised llvmlite module of ``rendered``) with the NT impl's stores
    marked, re-parsed, when the rendered text carries a :func:`marker`; else ``mod`` itself."""
    m = _MARKER.search(rendered)
    if m is None:
        return mod
    text, n = mark_nontemporal(str(mod), m.group(1), m.group(2).split(","))
    if not n:
        return mod
    try:
        out = llvm.parse_assembly(text)
        out.verify()
    except RuntimeError as exc:
        raise CompileError(f"non-temporal store rewrite of @{m.group(1)} gave invalid IR: {exc}") from exc
    return out
