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


@dataclass
class GemmStep:
    """One generated GEMM: ``compiled`` (CompiledGemm, or CompiledDirectConv for a direct conv) computing ``outputs`` from ``inputs``."""

    compiled: object
    inputs: tuple
    outputs: tuple
    reason: str
    const_inputs: tuple = ()

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
        consts = tuple(getattr(spec, "const_inputs", ()))
        if isinstance(spec.gemm, DirectConvDesc):
            cg = compile_direct_conv(spec.gemm, cache_dir=cache_dir)
        else:
            d = spec.gemm
            # a constant A (a conv's weight: a 960x160 weight is 600 KB of copying per call
            # otherwise) is packed on the first call only (CompiledGemm.packed_a)
            a_val = d.a_value or (spec.inputs[1] if d.conv is not None else spec.inputs[0])
            if a_val in consts and d.a_view is None:
                d = replace(d, a_const=True)
            nthreads = int(threads or os.cpu_count() or 1)
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
        outs = [np.empty(getattr(d, "stored_shape", d.out_shape), dt) for dt in d.out_dtypes]
        names = tuple(getattr(d, "stored_as", ()) or d.outputs)
        # a direct conv's fused squeeze rows / excitation (codegen/conv_direct.py)
        for v, s, dt in (d.extra_outputs() if hasattr(d, "extra_outputs") else ()):
            outs.append(np.empty(s, dt))
            names += (v,)
        if prod(d.out_shape):
            self.compiled.run(pool, a, b, ops, outs)
        for v, o in zip(names, outs):
            env[v] = o


def gemm_key(d) -> str:
    """The tuning piece key of a generated GEMM: the digest of its canonical descriptor (sizes,
    operand views and constness, epilogue; not the graph's value names), so the same product in
    every layer is one piece."""
    from ..codegen.gemm import canonical
    return "gemm:" + canonical(d).name[len("gemm_"):]


def tuned_blocking(d, decision):
    """``(Blocking or None, one thread or None)`` of GEMM ``d`` under a tuning ``decision``
    (``{"blocking": {field: value}, "threads": 1 | 2}``); ``(None, None)``: the compiler's
    defaults (codegen/gemm.py: ``default_blocking``, ``SMALL_FLOPS``).  Fields a decision names
    that this version does not know, or values the micro-kernel cannot take (``nr`` not a
    multiple of ``vl``), leave the default: a database outlives the code that wrote it."""
    if not decision:
        return None, None
    from dataclasses import fields as dc_fields
    from ..codegen.gemm import Blocking, default_blocking
    bl = None
    known = {f.name for f in dc_fields(Blocking)}     # whatever this version's Blocking has
    fields = {k: v for k, v in (decision.get("blocking") or {}).items() if k in known}
    if fields:
        cand = replace(default_blocking(d), **fields)
        sizes_ok = all(v is None or isinstance(v, bool) or (isinstance(v, int) and v >= 1) for v in fields.values())
        if sizes_ok and cand.nr >= cand.vl and cand.nr % cand.vl == 0:
            bl = cand
    t = decision.get("threads")
    return bl, (t == 1) if t in (1, 2) else None
