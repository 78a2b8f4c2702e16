"""Runtime step of a generated GEMM (codegen/gemm.py): a matmul or conv head plus its fused
elementwise epilogue, run on the executable's thread pool.

``execute(env, pool)`` reads the head's operands and the epilogue's operands from ``env``,
writes every output value into a fresh array and binds it in ``env``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod

import numpy as np

from ..errors import InputError


#: the stand-in tile-counter argument of a generated GEMM run by the native driver
_COUNTER_KEY = "\0tile_counter"
_NO_COUNTER = np.zeros(2, np.int64)
#: the stand-in argument of a row-reading conv's padded copy (a per-arena buffer, runtime/drive.py)
PAD_KEY = "\0conv_pad"
#: ... and of a row-reading conv's side copy (its last, partial panel's columns)
SIDE_KEY = "\0conv_side"
_NO_SIDE_KEY = "\0no_side"
#: a generated matmul below this many flops is run by the native driver on a 2-thread pool even
#: when it is too large for the calling thread alone (``CompiledGemm.inline``): as a step that
#: the segment's helper thread shares (runtime/drive.py), the two threads claiming tiles from
#: one counter, instead of a pool dispatch from Python between segments.  DLRM's products of
#: 6.5-17 MFLOP (25-60 us on one core) paid the pool's wake-up and ~10 us of Python each, so
#: they ran no faster on two threads than on one (docs/design/gemm.md, "Small products").
#: Larger products keep the pool: its dispatch is a smaller part of their time, and where the
#: helper is off for the call (``drive.HELPER == "auto"`` on a busy machine) a shared step runs
#: on one thread where the pool would still use two (T5's 33.5 and Swin's 57.8 MFLOP products
#: measured either way beyond the shared box's noise).
SHARED_MAX_FLOPS = 1 << 25
#: ... and from this many flops (~2 us on one core): below, one thread does it before the
#: helper has claimed a tile
SHARED_MIN_FLOPS = 1 << 19
#: convs too (the implicit GEMM, the channel-vector and the row-reading kernels claim tiles from
#: a counter like the generated matmul): False keeps every conv a one-thread step or a pool
#: dispatch (A/B: benchmarks/helper_ab.py --share)
SHARE_CONVS = True


@dataclass
class GemmStep:
    """One generated GEMM: ``compiled`` (CompiledGemm, or CompiledDirectConv for a direct conv) computing ``outputs`` from ``inputs``."""

    compiled: object
    inputs: tuple
    outputs: tuple
    reason: str
    const_inputs: tuple = ()
    #: outputs written into buffers the runtime binds (env's arena views) instead of fresh arrays:
    #: concat inputs placed in their slice of the concat output (runtime/concat.py)
    bound: frozenset = frozenset()

    @staticmethod
    def build(spec, threads: int | None, cache_dir: str | None = None, tuned=None) -> "GemmStep":
        """Compile the GEMM of a lowering StepSpec (``spec.gemm`` set), through the piecewise
        cache in ``cache_dir``.  ``tuned``: the tuning database's decisions for this machine
        (tuning/db.py); a ``gemm:`` piece's decision (:func:`tuned_blocking`) sets the
        blocking and the thread count of a generated GEMM."""
        import os
        from ..codegen.attention import AttentionDesc
        from ..codegen.conv_direct import DirectConvDesc, compile_direct_conv
        if isinstance(spec.gemm, AttentionDesc):     # layers/attention.py: one fused attention
            from .attention_step import AttentionStep
            return AttentionStep.build(spec, threads, cache_dir)
        from ..codegen.gemm import compile_gemm
        from ..codegen.small_dot import compile_small_dot, dot_plan
        from ..errors import CompileError
        consts = tuple(getattr(spec, "const_inputs", ()))
        if isinstance(spec.gemm, DirectConvDesc):
            d, inline = spec.gemm, None
            if tuned:       # a conv: piece's decision (tuning/convs.py): flat or row form, threads
                from ..tuning.convs import apply_direct, direct_key
                d, inline = apply_direct(d, tuned.get(direct_key(d)))
            cg = compile_direct_conv(d, cache_dir=cache_dir)
            if inline is not None:
                cg.inline = inline
        else:
            d = spec.gemm
            # a constant A (a conv's weight: a 960x160 weight is 600 KB of copying per call
            # otherwise) is packed on the first call only (CompiledGemm.packed_a)
            a_val = d.a_value or (spec.inputs[1] if d.conv is not None else spec.inputs[0])
            if a_val in consts and d.a_view is None:
                d = replace(d, a_const=True)
            if d.conv is None and dot_plan(d)[0] is not None:
                # tiny batched products (DLRM's interaction): dot products, batches in the lanes
                return GemmStep(compile_small_dot(d, cache_dir=cache_dir), tuple(spec.inputs), tuple(spec.outputs),
                                spec.reason, consts)
            nthreads = int(threads or os.cpu_count() or 1)
            from ..codegen.conv_cvec import compile_conv_cvec, cvec_reason
            from ..codegen.conv_rows import compile_conv_rows, rows_blocking, rows_reason
            from ..codegen.gemv import compile_gemv, gemv_reason
            if d.conv is not None and d.a_const and cvec_reason(d):
                cg = compile_conv_cvec(d, nthreads, cache_dir=cache_dir)    # not tuned (yet)
            elif d.conv is not None and d.a_const and rows_reason(d):
                # a gemm: piece too (tuning/space.py: rows_candidates); never inline
                bl, _ = tuned_blocking(d, tuned.get(gemm_key(d)) if tuned else None, rows_blocking(d))
                try:
                    cg = compile_conv_rows(d, nthreads, bl, cache_dir=cache_dir)
                except CompileError:
                    if bl is None:
                        raise
                    cg = compile_conv_rows(d, nthreads, cache_dir=cache_dir)    # a decision it cannot take
            elif d.conv is None and gemv_reason(d):
                cg = compile_gemv(d, nthreads, cache_dir=cache_dir)     # not tuned (yet)
            else:
                bl, one_thread = tuned_blocking(d, tuned.get(gemm_key(d)) if tuned else None)
                cg = compile_gemm(d, 1 if one_thread else nthreads, bl, cache_dir=cache_dir)
                if one_thread is not None:      # the decision overrides the SMALL_FLOPS rule
                    cg.inline = one_thread
        return GemmStep(cg, tuple(spec.inputs), tuple(spec.outputs), spec.reason, consts)

    def const_operands(self) -> tuple:
        """``(("a" | "b", value name), ...)``: the head operands that the GEMM packs once because
        they are constants (``GemmDesc.a_const`` / ``b_const``; a direct conv packs nothing)."""
        d = self.compiled.desc
        a_name, b_name = getattr(d, "a_value", "") or self.inputs[0], getattr(d, "b_value", "") or self.inputs[1]
        if getattr(d, "conv", None) is not None:
            a_name, b_name = b_name, a_name
        return tuple((op, v) for op, v, const in (("a", a_name, getattr(d, "a_const", False)),
                                                  ("b", b_name, getattr(d, "b_const", False))) if const)

    def adopt_packed(self, op: str, src: np.ndarray, packed: np.ndarray) -> None:
        """Use ``packed`` (read from the model cache's packed store) as the packed form of the
        constant ``src`` for operand ``op``: the GEMM does not pack ``src`` on its first call."""
        if op == "a":
            self.compiled._packed_a = (src, packed)
        else:
            self.compiled._packed = (src, packed)

    def head_names(self) -> tuple:
        """``(A value, B value)`` as the compiled kernel takes them (a conv: weight, input)."""
        d = self.compiled.desc
        a_name, b_name = getattr(d, "a_value", "") or self.inputs[0], getattr(d, "b_value", "") or self.inputs[1]
        return (b_name, a_name) if d.conv is not None else (a_name, b_name)

    def shares_tiles(self, big: bool = False) -> bool:
        """True for a tile-claiming kernel the driver may run as one step shared with a helper
        thread (see ``SHARED_MAX_FLOPS``): a generated matmul, or (``SHARE_CONVS``) a conv on
        the implicit GEMM, the channel-vector or the row-reading kernel (their copies made by
        a kernel step first, :meth:`copy_call`), of at least two tiles and ``SHARED_MIN_FLOPS``
        flops; a matmul below ``SHARED_MAX_FLOPS``, a conv only when ``inline`` -- any size
        when ``big``: the program of the calls that get the helper, runtime/drive.py)."""
        from ..codegen.conv_cvec import CompiledConvCvec
        from ..codegen.conv_rows import CompiledConvRows
        from ..codegen.gemm import CompiledGemm
        cg = self.compiled
        if type(cg) not in (CompiledGemm, CompiledConvCvec, CompiledConvRows) \
                or (cg.desc.conv is not None and not SHARE_CONVS):
            return False
        if cg.layout.tiles < 2:
            return False
        d = cg.desc
        flops = 2 * d.batch * d.m * d.n * d.k
        # (a small channel-vector conv with a padded copy: one thread from Python today)
        inline = getattr(cg, "inline", False) or getattr(cg, "small", False)
        if d.conv is not None:
            # a conv the pool would run stays a pool dispatch in the program of calls without
            # a helper (on a busy machine the pool still gives it two threads)
            return flops >= SHARED_MIN_FLOPS and (inline or big)
        return flops >= SHARED_MIN_FLOPS and (inline or big or flops < SHARED_MAX_FLOPS)

    def driver_call(self, constants: dict, types: dict, shared: bool = False, big: bool = False):
        """What the native driver (runtime/drive.py) needs to run this step as one kernel call
        on the calling thread: ``(address, extent, args, packed)`` where ``args`` names the
        kernel's buffers in order (graph values, or keys of ``packed``: the constant operands
        packed now, once; a conv's copies are :data:`PAD_KEY` / :data:`SIDE_KEY`, per-arena
        buffers, :meth:`scratch_buffers`) -- or None when the step must run from Python: it runs on the thread
        pool, writes a value the runtime does not bind, or reads a value that is not float32.
        ``shared``: the caller will share the step with a helper thread, so a step that
        :meth:`shares_tiles` (``big``: of any size) qualifies even if it is not ``inline``."""
        cg = self.compiled
        d = cg.desc
        if not (getattr(cg, "inline", False) or (shared and self.shares_tiles(big))) or not prod(d.out_shape):
            return None
        kernel = getattr(cg, "main", None) or getattr(cg, "kernel", None)
        a_name, b_name = self.head_names()
        args, packed = [a_name, b_name], {}
        for k, (const, pack) in enumerate(((getattr(d, "a_const", False), getattr(cg, "packed_a", None)),
                                           (getattr(d, "b_const", False), getattr(cg, "packed_b", None)))):
            if const:
                if args[k] not in constants:
                    return None
                key = f"\0packed_{'ab'[k]}:{d.name}:{args[k]}"
                packed[key] = pack(constants[args[k]])
                args[k] = key
        rows = _row_reading(cg)
        if rows:
            # the row-reading conv's padded copy (made by its calls: PAD_KEY, or the input
            # itself), its side copy (SIDE_KEY, copy_call's) and the input
            args[1:2] = [b_name if cg.in_place else PAD_KEY, SIDE_KEY if cg.tail else _NO_SIDE_KEY, b_name]
            if not cg.tail:
                packed[_NO_SIDE_KEY] = cg._no_side
        elif self.copy_call() is not None:
            args[1] = PAD_KEY       # a channel-vector conv reads its padded copy (copy_call's)
        args += [o.value for o in d.operands]
        for v, shape, dt in self._stored:
            t = types.get(v)
            if v not in self.outputs or t is None or np.dtype(t.np_dtype) != dt or prod(t.shape) != prod(shape):
                return None
            args.append(v)
        if self.claims_tiles:
            # the generated GEMM's tile counter: a call of the whole tile range keeps its own
            # on the stack (codegen/gemm_ir.py), so one never-written buffer serves every step
            # (a shared step gets a zeroed one of its own: runtime/drive.py)
            packed[_COUNTER_KEY] = _NO_COUNTER
            args.append(_COUNTER_KEY)
        if any(v not in packed and v not in (PAD_KEY, SIDE_KEY) and np.dtype(types[v].np_dtype) != np.float32 for v in args[:2]):
            return None
        if len(args) != len(kernel.params):
            return None
        return kernel.address, kernel.parallel_extent or 0, tuple(args), packed

    def counter_words(self) -> int:
        """int64 words of the kernel's shared counter (the row-reading conv's has four: its
        padded copy's chunks, then its tiles)."""
        return 4 if _row_reading(self.compiled) else 2

    def scratch_buffers(self) -> dict:
        """``{PAD_KEY | SIDE_KEY: (kind, float32 elements)}``: the per-arena buffers that the
        stand-ins in :meth:`driver_call`'s arguments name.  A row-reading conv's padded copy and
        the slack after it, which must stay zero, and its side copy (the columns past the tail
        stay zero): shared only by the convs of that same kind and size; a channel-vector
        conv's padded copy, which its pad kernel writes whole."""
        cg = self.compiled
        out = {}
        if _row_reading(cg):
            if not cg.in_place:
                out[PAD_KEY] = ("rows", cg.pad_size + cg.slack)
            if cg.tail:
                d = cg.desc
                out[SIDE_KEY] = (f"side{cg.tail}", d.batch * d.k * cg.blocking.nr)
        elif getattr(cg, "pad", None) is not None and hasattr(cg, "pad_size"):
            out[PAD_KEY] = ("cvec", cg.pad_size)
        return out

    def copy_call(self):
        """``(address, extent, stand-in)`` of the kernel the driver runs before the step, from
        the input (the second head operand) into the buffer ``stand-in`` names: a channel-vector
        conv's padded copy, a row-reading conv's side copy (the tail columns of each channel,
        :func:`side_kernel`); None: none."""
        cg = self.compiled
        if _row_reading(cg):
            if not cg.tail:
                return None
            k = self.__dict__.get("_side_kernel")
            if k is None:
                k = self.__dict__["_side_kernel"] = side_kernel(cg)
            return k.address, k.parallel_extent or 0, SIDE_KEY
        pad = getattr(cg, "pad", None)
        if pad is None or not hasattr(cg, "pad_size"):
            return None
        return pad.address, pad.parallel_extent or 0, PAD_KEY

    @property
    def claims_tiles(self) -> bool:
        """True when the kernel claims its tiles from a counter argument (the generated GEMM,
        ``CompiledGemm.claims_tiles``) instead of taking a range of them: the driver runs it as
        one call of the whole range, never in chunks."""
        return getattr(self.compiled, "claims_tiles", False)

    def work(self) -> int:
        """The larger of the step's flops and the bytes its kernel moves at least."""
        from ..codegen.conv_direct import DirectConvDesc, moved_bytes
        d = self.compiled.desc
        flops = 2 * d.batch * d.m * d.n * d.k
        if isinstance(d, DirectConvDesc):
            return max(flops, moved_bytes(d))
        return max(flops, 4 * d.batch * (d.m * d.n + d.n * d.k))

    def min_chunk(self) -> int:
        """Fewest iterations of the kernel's parallel loop worth one chunk (a matrix-vector
        conv's rows are a few hundred multiply-adds: ``MATVEC_CHUNK_MACS`` a chunk)."""
        from ..codegen.conv_direct import MATVEC_CHUNK_MACS, DirectConvDesc, is_matvec
        d = self.compiled.desc
        if isinstance(d, DirectConvDesc) and is_matvec(d.conv):
            work = d.conv.c // d.conv.group + (2 * d.excite.hw if d.excite is not None else 0)
            return -(-MATVEC_CHUNK_MACS // work)
        return 1

    def execute(self, env: dict, pool) -> None:
        d = self.compiled.desc
        # the head's operands by name (inputs are deduplicated: x @ x has one)
        a_name, b_name = getattr(d, "a_value", "") or self.inputs[0], getattr(d, "b_value", "") or self.inputs[1]

        def arr(v):
            a = env[v]
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            return a

        if d.conv is not None:      # conv: A is the weight, B the implicit im2col of the input
            a_name, b_name = b_name, a_name
        a, b = arr(a_name), arr(b_name)
        if a.dtype != np.float32 or b.dtype != np.float32:
            raise InputError(f"generated GEMM {d.name}: operands {a_name!r}, {b_name!r} must be float32, "
                             f"got {a.dtype}, {b.dtype}")
        ops = [arr(o.value) for o in d.operands]
        outs = []
        for v, shape, dt in self._stored:
            # the runtime's buffer (an arena slot or the caller's output) where it bound one
            # (writes_buffers); a fresh array for a value the runtime does not know
            o = env.get(v)
            if o is None or type(o) is not np.ndarray or o.dtype != dt or o.size != prod(shape) \
                    or not o.flags.c_contiguous:
                o = env[v] = np.empty(shape, dt)
            outs.append(o)
        if prod(d.out_shape):
            self.compiled.run(pool, a, b, ops, outs)

    @property
    def _stored(self) -> tuple:
        """``(value, shape, dtype)`` of every array the kernel writes, in its parameter order."""
        st = self.__dict__.get("_stored_cache")
        if st is None:
            d = self.compiled.desc
            st = []
            for part in getattr(d, "parts", ()) or (d,):     # a joint product: each segment's
                shape = getattr(part, "stored_shape", part.out_shape)
                names = tuple(getattr(part, "stored_as", ()) or part.outputs)
                st += [(v, tuple(shape), np.dtype(dt)) for v, dt in zip(names, part.out_dtypes)]
            # a direct conv's fused squeeze rows / excitation (codegen/conv_direct.py)
            st += [(v, tuple(s), np.dtype(dt)) for v, s, dt in
                   (d.extra_outputs() if hasattr(d, "extra_outputs") else ())]
            st = self.__dict__["_stored_cache"] = tuple(st)
        return st

    @property
    def writes_buffers(self) -> bool:
        """True: the runtime binds the output buffers before :meth:`execute` (arena slots, so
        that a GEMM's output reuses memory that is mapped and in cache instead of a fresh
        allocation per call); an output it did not bind is allocated here."""
        return True


def gemm_key(d) -> str:
    """The tuning piece key of a generated GEMM: the digest of its canonical descriptor (sizes,
    operand views and constness, epilogue; not the graph's value names), so the same product in
    every layer is one piece."""
    from ..codegen.gemm import canonical
    return "gemm:" + canonical(d).name[len("gemm_"):]


def tuned_blocking(d, decision, base=None):
    """``(Blocking or None, one thread or None)`` of GEMM ``d`` under a tuning ``decision``
    (``{"blocking": {field: value}, "threads": 1 | 2}``); ``(None, None)``: the compiler's
    defaults (codegen/gemm.py: ``default_blocking``, ``SMALL_FLOPS``).  Fields a decision names
    that this version does not know, or values the micro-kernel cannot take (``nr`` not a
    multiple of ``vl``), leave the default: a database outlives the code that wrote it.  The
    decision's fields replace those of ``base`` (default: ``default_blocking(d)``; a row-reading
    conv passes its own, ``conv_rows.rows_blocking``)."""
    if not decision:
        return None, None
    from dataclasses import fields as dc_fields
    from ..codegen.gemm import Blocking, default_blocking
    bl = None
    known = {f.name for f in dc_fields(Blocking)}     # whatever this version's Blocking has
    fields = {k: v for k, v in (decision.get("blocking") or {}).items() if k in known}
    if fields:
        cand = replace(base or default_blocking(d), **fields)
        sizes_ok = all(v is None or isinstance(v, bool) or (isinstance(v, int) and v >= 1) for v in fields.values())
        # a joint product's segments start at multiples of NR (codegen/gemm.segments)
        aligned = all(sum(p.n for p in d.parts[:q]) % cand.nr == 0 for q in range(len(getattr(d, "parts", ()))))
        if sizes_ok and cand.nr >= cand.vl and cand.nr % cand.vl == 0 and aligned:
            bl = cand
    t = decision.get("threads")
    return bl, (t == 1) if t in (1, 2) else None


def _row_reading(cg) -> bool:
    """Whether ``cg`` is a row-reading conv (codegen/conv_rows.py: padded and side copies)."""
    from ..codegen.conv_rows import CompiledConvRows
    return isinstance(cg, CompiledConvRows)


def side_kernel(cg):
    """The compiled kernel ``side[t][j] = x[t][hw - tail + j]`` (``j < tail``, ``t`` over image *
    channel) of row-reading conv ``cg`` read in place: what ``CompiledConvRows.run`` makes in
    numpy per call, for the native driver (the other ``NR - tail`` columns of the buffer stay
    zero: runtime/drive.py allocates it zeroed and nothing else writes them)."""
    from ..codegen import loopir as L
    from ..codegen.cached import compile_cached
    d, g = cg.desc, cg.desc.conv
    hw, nr, tail = g.h * g.w, cg.blocking.nr, cg.tail
    rows = d.batch * d.k
    side = L.Param("side", "float32", rows * nr)
    x = L.Param("x", "float32", rows * hw)
    t, j = L.Var("t"), L.Var("j")
    body = L.for_("t", 0, rows, L.for_("j", 0, tail, L.Store(side, t * nr + j, L.Load(x, t * hw + (hw - tail) + j)),
                                       "vector"), "parallel")
    return compile_cached(L.Kernel(f"{d.name}_side", (side, x), body, "t", rows), None)
