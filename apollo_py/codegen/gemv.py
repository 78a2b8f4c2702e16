"""Matrix-vector product with a constant weight: the batch-1 classifier / linear layer.

``y[1, N] = x[1, K] @ W[K, N]`` (a ``MatMul`` or ``Gemm`` at batch 1) does one multiply-add per
weight element, so its time is the time to read ``W``: MobileNetV3's ``960 x 1280`` and
``1280 x 1000``, ResNet-50's ``2048 x 1000``.  The generated GEMM ran these as a 1-row
micro-tile of its ``MR x 32`` kernel, on one thread (2.5-4.1 MFLOP is below ``SMALL_FLOPS``):
half the machine's read bandwidth at best.  Here:

* the weight is packed once into ``[panel][K][NR]`` (``NR = nv * VL`` output columns per panel,
  zero padded): a panel is one contiguous stream of ``K * NR`` floats, and a tile -- a run of
  consecutive panels -- is one contiguous stream too, which the hardware prefetcher follows;
* per k: one broadcast of ``x[k]``, ``nv`` aligned vector loads, ``nv`` FMAs; k is unrolled by
  two into two accumulator sets (independent FMA chains); a software prefetch ``prefetch``
  bytes ahead in the stream per cache line consumed is available but off (measured slower than
  the hardware prefetcher on this one contiguous stream);
* the tiles are claimed from a counter (the generated GEMM's protocol, codegen/gemm_ir.py): the
  pool's caller and its helpers take consecutive runs of panels, so both threads stream halves
  of the weight;
* after a panel's K loop the ``NR`` sums go through the GEMM's epilogue kernel
  (``gemm._epilogue_kernel`` with a ``1 x NR`` tile: bias, activations, residual operands).

Chosen by :func:`gemv_reason` when ``ENABLED`` (off by default: docs/design/gemm.md, "Matrix-vector
products", says why).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Optional

import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.compiled import CompiledKernelBase, run_claiming
from apollo_py.errors import CompileError

#: off by default: on the shared box (load 9-12, no free second core) the pool's two threads
#: took 1.0-1.2x the generated GEMM's one-thread time in MobileNetV3 (per-step trace, p10) and
#: the one-thread form the same time as the GEMM's 1-row micro-tile (docs/design/gemm.md,
#: "Matrix-vector products"); what it is for -- both cores streaming halves of a weight that
#: comes from memory -- needs an A/B on a quiet box (``benchmarks/gemv_ab.py``) before it is on
ENABLED = False
#: weights smaller than this stay on the generated GEMM (a few microseconds either way)
MIN_WEIGHT_BYTES = 64 * 1024
#: a weight of at least this many bytes is streamed by the pool's threads together; smaller
#: ones run on the calling thread (the native driver's inline step: no pool wake-up, no Python)
POOL_WEIGHT_BYTES = 1 << 20


@dataclass(frozen=True)
class GemvBlocking:
    """``vl`` floats per vector, ``nv`` vectors per panel (``nr = nv * vl`` columns), software
    prefetch ``prefetch`` bytes ahead of the weight stream (0: none), and at least
    ``tiles_per_thread * threads`` tiles when the panels allow."""

    vl: int
    nv: int = 4
    #: off: on this stream the hardware prefetcher does it (1280 x 1000, weight out of L2, one
    #: thread: 1 KiB ahead 74-88 us, 4 KiB 91-96 us, none 59-67 us; load ~9)
    prefetch: int = 0
    tiles_per_thread: int = 4

    @property
    def nr(self) -> int:
        return self.nv * self.vl


@dataclass(frozen=True)
class GemvLayout:
    npan: int           # NR-column panels
    tiles: int
    first: tuple        # first panel of each tile (and the end, npan, last)


def gemv_reason(d, target: str = "cpu") -> str:
    """Why GEMM ``d`` runs as a matrix-vector product ("" = not): a CPU matmul (not a conv, not a
    joint product) of one row by a constant weight of at least ``MIN_WEIGHT_BYTES``, A read in
    place (contiguous), C stored row-major."""
    if not ENABLED or target in ("cuda", "cuda-emu") or d.conv is not None or d.parts:
        return ""
    if d.batch != 1 or d.m != 1 or not d.b_const or d.a_view is not None or d.out_perm is not None:
        return ""
    if min(d.n, d.k) <= 0 or 4 * d.k * d.n < MIN_WEIGHT_BYTES:
        return ""
    pool = "both threads" if 4 * d.k * d.n >= POOL_WEIGHT_BYTES else "the calling thread"
    return (f"matrix-vector product: the {d.k}x{d.n} weight packed once into contiguous column panels, "
            f"streamed by {pool}")


def gemv_blocking(vl: int = 16) -> GemvBlocking:
    """The default blocking for ``vl``-float vectors: 4 vectors a panel (64 columns on AVX-512;
    8 vectors measured no faster)."""
    return GemvBlocking(vl, 4)


def gemv_layout(d, bl: GemvBlocking, threads: int) -> GemvLayout:
    """Runs of consecutive panels, as equal as the panel count allows: ``tiles_per_thread *
    threads`` of them (fewer when there are fewer panels), one tile on one thread."""
    npan = -(-d.n // bl.nr)
    tiles = max(1, min(npan, bl.tiles_per_thread * threads if threads > 1 else 1))
    first = tuple(t * npan // tiles for t in range(tiles + 1))
    return GemvLayout(npan, tiles, first)


# ------------------------------------------------------------------ IR


def _main_ir(d, bl: GemvBlocking, lay: GemvLayout, epi: str) -> str:
    from .gemm_ir import counter_ir, index_table, splat_ir, wait_all_ir, x86_decls
    vl, nv, nr, k = bl.vl, bl.nv, bl.nr, d.k
    vt = f"<{vl} x float>"
    n_extra = len(d.operands) + len(d.outputs)
    pairs = k // 2
    lines_per_pair = max(1, 2 * nr * 4 // 64)
    pf = bl.prefetch // 4       # floats ahead
    s = [f"define void @{d.name}(ptr %args, i64 %lo, i64 %hi) #0 {{", "entry:",
         "  %xs = load ptr, ptr %args",
         "  %g1 = getelementptr ptr, ptr %args, i64 1", "  %wp = load ptr, ptr %g1",
         f"  %tile = alloca [{nr} x float], align 64",
         "  %einfo = alloca [4 x i64], align 8", f"  %eargs = alloca [{2 + n_extra} x ptr], align 8",
         "  store ptr %tile, ptr %eargs",
         "  %ea1 = getelementptr ptr, ptr %eargs, i64 1", "  store ptr %einfo, ptr %ea1",
         "  store i64 0, ptr %einfo",
         "  %ei1 = getelementptr i64, ptr %einfo, i64 1", "  store i64 0, ptr %ei1",
         "  %ei2 = getelementptr i64, ptr %einfo, i64 2", "  %ei3 = getelementptr i64, ptr %einfo, i64 3"]
    for x in range(n_extra):
        s += [f"  %xg{x} = getelementptr ptr, ptr %args, i64 {2 + x}", f"  %x{x} = load ptr, ptr %xg{x}",
              f"  %eg{x} = getelementptr ptr, ptr %eargs, i64 {2 + x}", f"  store ptr %x{x}, ptr %eg{x}"]
    s += counter_ir(lay.tiles, 2 + n_extra)
    s += ["  br i1 %live, label %tcond, label %done",
          "tcond:", "  %t = atomicrmw add ptr %ctr, i64 1 monotonic",
          f"  %tc = icmp slt i64 %t, {lay.tiles}", "  br i1 %tc, label %tbody, label %done",
          "tbody:",
          f"  %fp0 = getelementptr [{lay.tiles + 1} x i64], ptr @gemv.first, i64 0, i64 %t",
          "  %p0 = load i64, ptr %fp0", "  %t1 = add i64 %t, 1",
          f"  %fp1 = getelementptr [{lay.tiles + 1} x i64], ptr @gemv.first, i64 0, i64 %t1",
          "  %p1 = load i64, ptr %fp1", "  br label %pcond",
          "pcond:", "  %p = phi i64 [%p0, %tbody], [%pn, %pepi]",
          "  %pc = icmp slt i64 %p, %p1", "  br i1 %pc, label %pbody, label %tfin",
          "pbody:", f"  %po = mul i64 %p, {k * nr}", "  %pp = getelementptr float, ptr %wp, i64 %po"]
    zero = "zeroinitializer"
    if pairs:
        s += ["  br label %kloop", "kloop:", "  %k = phi i64 [0, %pbody], [%kn, %kloop]"]
        for st in "ab":
            for v in range(nv):
                s.append(f"  %{st}{v} = phi {vt} [{zero}, %pbody], [%{st}n{v}, %kloop]")
        s += ["  %k1 = add nuw nsw i64 %k, 1", f"  %ko = mul nuw nsw i64 %k, {nr}"]
        if pf:
            for ln in range(lines_per_pair):
                s += [f"  %pfo{ln} = add nuw nsw i64 %ko, {pf + ln * 16}",
                      f"  %pfp{ln} = getelementptr float, ptr %pp, i64 %pfo{ln}",
                      f"  call void @llvm.prefetch.p0(ptr %pfp{ln}, i32 0, i32 3, i32 1)"]
        for st, kv, off in (("a", "%k", 0), ("b", "%k1", nr)):
            s += [f"  %xp{st} = getelementptr inbounds float, ptr %xs, i64 {kv}",
                  *splat_ir(f"xb{st}", f"%xp{st}", vt, vl)]
            for v in range(nv):
                s += [f"  %wo{st}{v} = add nuw nsw i64 %ko, {off + v * vl}",
                      f"  %wq{st}{v} = getelementptr inbounds float, ptr %pp, i64 %wo{st}{v}",
                      f"  %w{st}{v} = load {vt}, ptr %wq{st}{v}, align 64",
                      f"  %{st}n{v} = call {vt} @llvm.fma.v{vl}f32({vt} %xb{st}, {vt} %w{st}{v}, {vt} %{st}{v})"]
        s += ["  %kn = add nuw nsw i64 %k, 2", f"  %kc = icmp ult i64 %kn, {2 * pairs}",
              "  br i1 %kc, label %kloop, label %kend", "kend:"]
        acc = {st: [f"%{st}n{v}" for v in range(nv)] for st in "ab"}
    else:
        acc = {st: [zero] * nv for st in "ab"}
    if k % 2:       # the last k of an odd K
        s += [f"  %xpt = getelementptr inbounds float, ptr %xs, i64 {k - 1}",
              *splat_ir("xbt", "%xpt", vt, vl)]
        for v in range(nv):
            s += [f"  %wqt{v} = getelementptr inbounds float, ptr %pp, i64 {(k - 1) * nr + v * vl}",
                  f"  %wt{v} = load {vt}, ptr %wqt{v}, align 64",
                  f"  %tn{v} = call {vt} @llvm.fma.v{vl}f32({vt} %xbt, {vt} %wt{v}, {vt} {acc['a'][v]})"]
        acc["a"] = [f"%tn{v}" for v in range(nv)]
    for v in range(nv):
        s += [f"  %sum{v} = fadd {vt} {acc['a'][v]}, {acc['b'][v]}",
              f"  %tq{v} = getelementptr inbounds float, ptr %tile, i64 {v * vl}",
              f"  store {vt} %sum{v}, ptr %tq{v}, align 64"]
    s += [f"  %col0 = mul i64 %p, {nr}", f"  %nleft = sub i64 {d.n}, %col0",
          f"  %ncol = call i64 @llvm.smin.i64(i64 %nleft, i64 {nr})",
          "  store i64 %col0, ptr %ei2", "  store i64 %ncol, ptr %ei3",
          f"  call void @{epi}(ptr %eargs, i64 0, i64 1)", "  br label %pepi",
          "pepi:", "  %pn = add i64 %p, 1", "  br label %pcond",
          "tfin:", "  %fin0 = atomicrmw add ptr %ctr1, i64 1 release", "  br label %tcond",
          "done:", *wait_all_ir(lay.tiles), "}"]
    head = [f"; matrix-vector product {d.name}: {d.k}x{d.n}, panels of {nr} columns, tiles {lay.first}",
            index_table("gemv.first", lay.first),
            "declare i64 @llvm.smin.i64(i64, i64)", "declare void @llvm.prefetch.p0(ptr, i32, i32, i32)",
            *x86_decls(),
            f"declare {vt} @llvm.fma.v{vl}f32({vt}, {vt}, {vt})",
            f"declare void @{epi}(ptr, i64, i64)"]
    return "\n".join([*head, "\n".join(s)])


# ------------------------------------------------------------------ compile


class CompiledGemv:
    """Machine code of one matrix-vector product: ``run(pool, a, b, operands, outputs)`` like
    :class:`~apollo_py.codegen.gemm.CompiledGemm` (``b``, the constant weight, packed once by
    :meth:`packed_b`); ``inline``: one call on the calling thread (the native driver runs it)."""

    #: the main kernel claims its tiles from a counter (its last argument), as the GEMM's
    claims_tiles = True

    def __init__(self, desc, bl: GemvBlocking, lay: GemvLayout, engine, ir: str, main_params, inline: bool):
        self.desc, self.blocking, self.layout = desc, bl, lay
        self.engine, self.ir = engine, ir
        main = L.Kernel(desc.name, (*main_params, L.Param("tile_counter", "int64", 2)), L.Block(), "t", lay.tiles)
        self.main = CompiledKernelBase(main, engine.get_function_address(desc.name))
        self.inline = inline
        self._packed: tuple = (None, None)
        self._packed_a: tuple = (None, None)

    def packed_b(self, b: np.ndarray) -> np.ndarray:
        """``b`` (the constant weight, ``[K, N]`` or the source of ``desc.b_view``) packed once into
        ``[panel][K][NR]``, zero padded to whole panels; kept for the next call with the same array."""
        from .gemm import _aligned_zeros
        src, packed = self._packed
        if src is b:
            return packed
        d, nr, npan = self.desc, self.blocking.nr, self.layout.npan
        w = np.ascontiguousarray(b, np.float32)
        if d.b_view is not None:
            v = d.b_view
            w = np.lib.stride_tricks.as_strided(w.reshape(-1), shape=v.shape, strides=tuple(4 * s for s in v.strides))
        w = w.reshape(d.k, d.n)
        full = np.zeros((d.k, npan * nr), np.float32)
        full[:, :d.n] = w
        packed = _aligned_zeros(npan * d.k * nr)
        packed.reshape(npan, d.k, nr)[...] = full.reshape(d.k, npan, nr).transpose(1, 0, 2)
        self._packed = (b, packed)
        return packed

    def packed_a(self, a):      # the packed store's interface: A is never constant here
        raise CompileError(f"{self.desc.name}: matrix-vector product has no constant A")

    def run(self, pool, a: np.ndarray, b: np.ndarray, operands, outputs) -> None:
        arrays = [a, self.packed_b(b), *operands, *outputs, np.zeros(2, np.int64)]
        run_claiming(self.main, pool, arrays, self.inline or self.layout.tiles == 1)


@lru_cache(maxsize=None)
def _source_digest() -> str:
    import os
    from ..fsutil import files_digest
    here = os.path.dirname(__file__)
    return files_digest(os.path.join(here, f) for f in
                        ("gemv.py", "gemm.py", "gemm_ir.py", "loopir.py", "printer.py", "scalar_ops.py"))


def compile_gemv(d, threads: int, bl: Optional[GemvBlocking] = None, cache_dir: Optional[str] = None) -> CompiledGemv:
    """Generate, optimise (O3) and JIT the matrix-vector product of GEMM ``d`` (one row, a
    constant B) through the piecewise cache.  A weight under ``POOL_WEIGHT_BYTES`` runs on the
    calling thread (one tile).  Raises CompileError for a GEMM it cannot run or an epilogue op
    without a scalar lowering."""
    from .cached import compile_module
    from .gemm import Blocking, _epilogue_kernel, canonical, host_blocking, link_ir
    from .llvm import LLVMPrinter, host
    if d.conv is not None or d.m != 1 or d.batch != 1 or not d.b_const or d.a_view is not None \
            or d.out_perm is not None or d.parts or min(d.n, d.k) <= 0:
        raise CompileError(f"{d.name}: a matrix-vector product needs one row of A (contiguous), a constant B "
                           f"and a row-major C, got batch {d.batch}, {d.m}x{d.n}x{d.k}")
    named, d = d, canonical(d)
    d = replace(d, name="gemv" + d.name[4:])
    bl = bl or gemv_blocking(host_blocking().vl)
    if bl.nv < 1 or bl.vl & (bl.vl - 1) or bl.prefetch < 0:
        raise CompileError(f"{d.name}: matrix-vector blocking {bl} is not valid")
    inline = 4 * d.k * d.n < POOL_WEIGHT_BYTES or threads <= 1
    lay = gemv_layout(d, bl, 1 if inline else threads)
    epi = _epilogue_kernel(d, Blocking(bl.vl, 1, bl.nr))

    def build():
        h = host()
        main = _main_ir(d, bl, lay, epi.name)
        main += f"\nattributes #0 = {{ nounwind {h.cpu_attrs} }}\n"
        return link_ir(d.name, main, [LLVMPrinter().render(epi, h.cpu_attrs)])
    engine, ir = compile_module(repr(("gemv", d, bl, lay, _source_digest())), build, cache_dir, d.name)
    wparam = L.Param("wpk", "float32", lay.npan * d.k * bl.nr)
    aparam = L.Param("a", "float32", d.k)
    cg = CompiledGemv(d, bl, lay, engine, ir, (aparam, wparam, *epi.params[2:]), inline)
    cg.desc = named
    return cg
