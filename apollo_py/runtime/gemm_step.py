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
    #: outputs written into buffers the runtime binds (env's arena views) instead of fresh arrays:
    #: concat inputs placed in their slice of the concat output (runtime/concat.py)
    bound: frozenset = frozenset()

    @staticmethod
    def build(spec, threads: int | None, cache_dir: str | None = None) -> "GemmStep":
        """Compile the GEMM of a lowering StepSpec (``spec.gemm`` set), through the piecewise
        cache in ``cache_dir``."""
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
            cg = compile_gemm(d, int(threads or os.cpu_count() or 1), cache_dir=cache_dir)
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
        names = tuple(getattr(d, "stored_as", ()) or d.outputs)
        shape = getattr(d, "stored_shape", d.out_shape)
        bound = self.bound
        outs = [env[v].reshape(shape) if v in bound else np.empty(shape, dt) for v, dt in zip(names, d.out_dtypes)]
        # a direct conv's fused squeeze rows / excitation (codegen/conv_direct.py)
        for v, s, dt in (d.extra_outputs() if hasattr(d, "extra_outputs") else ()):
            outs.append(env[v].reshape(s) if v in bound else np.empty(s, dt))
            names += (v,)
        if prod(d.out_shape):
            self.compiled.run(pool, a, b, ops, outs)
        for v, o in zip(names, outs):
            env[v] = o
