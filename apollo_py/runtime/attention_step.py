"""Runtime step of a fused attention (codegen/attention.py), run on the executable's pool.

``execute(env, pool)`` reads Q, K^T (or the buffer it is a view of), V and the score
transform's operands from ``env`` and binds the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import numpy as np

from ..errors import InputError


@dataclass
class AttentionStep:
    """One fused attention: ``compiled`` (CompiledAttention) computing ``outputs`` from ``inputs``."""

    compiled: object
    inputs: tuple
    outputs: tuple
    reason: str
    const_inputs: tuple = ()

    @staticmethod
    def build(spec, threads: int | None, cache_dir: str | None = None) -> "AttentionStep":
        import os
        from ..codegen.attention import compile_attention
        ca = compile_attention(spec.gemm, int(threads or os.cpu_count() or 1), cache_dir=cache_dir)
        return AttentionStep(ca, tuple(spec.inputs), tuple(spec.outputs), spec.reason)

    def execute(self, env: dict, pool) -> None:
        d = self.compiled.desc

        def arr(v, dtype=None):
            a = env[v]
            if not isinstance(a, np.ndarray) or not a.flags.c_contiguous:
                a = np.ascontiguousarray(a)
            if dtype is not None and a.dtype != dtype:
                raise InputError(f"fused attention {d.name}: {v!r} must be {dtype}, got {a.dtype}")
            return a
        q, kt, v = (arr(x, np.float32) for x in (d.q_value, d.k_value, d.v_value))
        ops = [arr(o.value) for o in d.operands]
        # the runtime's buffer (an arena slot: mapped and in cache) where it bound one, as a
        # GEMM step's; a fresh array otherwise
        out = env.get(d.output)
        if type(out) is not np.ndarray or out.dtype != np.float32 or out.size != prod(d.stored_shape) \
                or not out.flags.c_contiguous:
            out = env[d.output] = np.empty(d.stored_shape, np.float32)
        self.compiled.run(pool, q, kt, v, ops, out)

    @property
    def writes_buffers(self) -> bool:
        """True: the runtime binds the output buffer before :meth:`execute` (runtime/cpu.py)."""
        return True
