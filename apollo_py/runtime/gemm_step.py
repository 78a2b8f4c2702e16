"""Runtime step of a generated GEMM (codegen/gemm.py): a matmul or conv head plus its fused
elementwise epilogue, run on the executable's thread pool.

``execute(env, pool)`` reads the head's operands and the epilogue's operands from ``env``,
writes every output value into a fresh array and binds it in ``env``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import prod
from typing import Optional

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
    # (weight array, its packed panels): a conv's constant weight is packed on the first call
    # only (a 960x160 weight is 600 KB of copying per call otherwise)
    _packed: Optional[tuple] = field(default=None, repr=False, compare=False)

    @staticmethod
    def build(spec, threads: int | None, cache_dir: str | None = None) -> "GemmStep":
        """Compile the GEMM of a lowering StepSpec (``spec.gemm`` set), through the piecewise
        cache in ``cache_dir``."""
        import os
        from ..codegen.conv_direct import DirectConvDesc, compile_direct_conv
        from ..codegen.gemm import compile_gemm
        if isinstance(spec.gemm, DirectConvDesc):
            cg = compile_direct_conv(spec.gemm, cache_dir=cache_dir)
        else:
            cg = compile_gemm(spec.gemm, int(threads or os.cpu_count() or 1), cache_dir=cache_dir)
        return GemmStep(cg, tuple(spec.inputs), tuple(spec.outputs), spec.reason,
                        tuple(getattr(spec, "const_inputs", ())))

    def execute(self, env: dict, pool) -> None:
        d = self.compiled.desc
        a_name, b_name = self.inputs[0], self.inputs[1]

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
        outs = [np.empty(d.out_shape, dt) for dt in d.out_dtypes]
        cg = self.compiled
        if not prod(d.out_shape):
            pass
        elif a_name in self.const_inputs and hasattr(cg, "pack_a"):
            p = self._packed
            if p is None or p[0] is not a:
                apk = np.empty(cg.apk_size, np.float32)
                pool.run(cg.pack_a, [apk, a])
                p = self._packed = (a, apk)
            pool.run(cg.main, [p[1], b, *ops, *outs])
        else:
            cg.run(pool, a, b, ops, outs)
        for v, o in zip(d.outputs, outs):
            env[v] = o
