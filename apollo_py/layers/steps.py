"""The lowering's result: :class:`StepSpec`, what one runtime step computes.

Made by :func:`~apollo_py.layers.lowering.lower_micro_graphs` and by the GEMM and BLAS passes
beside it (``gemm_lowering.py``, ``blas_fold.py``), read by the runtime and by the plan; a module
of its own so that those passes and the lowering do not import each other.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CompileError


@dataclass(frozen=True)
class StepSpec:
    """What one runtime step computes: ``fused`` (FusedKernel) or reference ``nodes`` + reason."""

    inputs: tuple
    outputs: tuple
    fused: object = None
    nodes: tuple = ()
    reason: str = ""
    micro_graphs: tuple = field(default=())
    gemm: object = None     # codegen.gemm.GemmDesc: the generated GEMM runs ``nodes``
    blas: object = None     # blas_fold.BlasDesc: one cblas ?gemm call runs ``nodes`` (blas_fold.py)
    const_inputs: tuple = ()    # inputs that are graph constants (a GEMM packs them once)

    def to_dict(self) -> dict:
        if self.blas is not None:
            return {"kind": "blas", "call": self.blas.formula(), "ops": [n.op for n in self.nodes],
                    "inputs": list(self.inputs), "outputs": list(self.outputs), "reason": self.reason,
                    "micro_graphs": list(self.micro_graphs)}
        if self.gemm is not None:
            return {"kind": "gemm", "name": self.gemm.name, "ops": [n.op for n in self.nodes],
                    "inputs": list(self.inputs), "outputs": list(self.outputs), "reason": self.reason,
                    "micro_graphs": list(self.micro_graphs)}
        if self.fused is not None:
            d = self.fused.to_dict()
            d["kind"] = "kernel"
            d["micro_graphs"] = list(self.micro_graphs)
            return d
        return {"kind": "reference", "ops": [n.op for n in self.nodes], "inputs": list(self.inputs),
                "outputs": list(self.outputs), "reason": self.reason, "micro_graphs": list(self.micro_graphs)}

    # --- plan.kernels[i] attributes (DESIGN §9): zeros / empty for numpy steps ---
    @property
    def parallel_dims(self) -> int:
        """Depth of the outer band split across threads (0 for a numpy step)."""
        return self.fused.parallel_dims if self.fused is not None else 0

    @property
    def tile_sizes(self) -> tuple:
        """Tiles applied to the parallel band (``()`` = untiled or a numpy step)."""
        return tuple(self.fused.tile_sizes) if self.fused is not None else ()

    @property
    def flops(self) -> int:
        """Estimated floating-point operations of a generated kernel or a BLAS call (0 for a
        numpy step)."""
        if self.blas is not None:
            return self.blas.flops
        return self.fused.flops if self.fused is not None else 0

    @property
    def bytes(self) -> int:
        """Estimated compulsory bytes a generated kernel moves (0 for a numpy step)."""
        return self.fused.bytes if self.fused is not None else 0

    def source(self, kind: str = "llvm") -> str:
        """Generated source of this step: ``"llvm"`` (unoptimised LLVM IR) or ``"c"`` text.

        A numpy step has no generated source; the text says which numpy reference runs instead.
        """
        if kind not in ("llvm", "c"):
            raise CompileError(f"source kind must be 'llvm' or 'c', not {kind!r}")
        if self.gemm is not None:
            if kind == "c":
                return f"; generated GEMM {self.gemm.name} has LLVM source only ({self.reason})"
            from ..codegen.attention import AttentionDesc, render_attention
            if isinstance(self.gemm, AttentionDesc):
                return render_attention(self.gemm)
            from ..codegen.conv_direct import DirectConvDesc, render_direct_conv
            if isinstance(self.gemm, DirectConvDesc):
                return render_direct_conv(self.gemm)
            from ..codegen.gemm import render_gemm
            return render_gemm(self.gemm)
        if self.blas is not None:
            return f"; cblas ?gemm call, no generated code: {self.blas.formula()} ({self.reason})"
        if self.fused is None:
            return f"; numpy step, no generated code: {' '.join(n.op for n in self.nodes)} ({self.reason})"
        if kind == "c":
            from ..codegen.c import render_c
            return render_c(self.fused.loop)
        from ..codegen.llvm import render_llvm
        return render_llvm(self.fused.loop)

    def describe(self) -> str:
        if self.blas is not None:
            return f"blas   {self.blas.formula()}: {' '.join(n.op for n in self.nodes)}  ({self.reason})"
        if self.gemm is not None:
            return f"gemm   {self.gemm.name}: {' '.join(n.op for n in self.nodes)}  ({self.reason})"
        if self.fused is not None:
            f = self.fused
            return (f"kernel {f.name}: {' '.join(n.op for n in f.nodes)}  [parallel dims {f.parallel_dims}, "
                    f"{f.strategy}]")
        return f"numpy  {' '.join(n.op for n in self.nodes)}  ({self.reason})"
