"""Front ends: turn user models (ONNX, builder graphs, traced functions) into programs.

A :class:`Program` is a model whose input shapes may still be symbolic; ``specialize`` returns
the primitive :class:`~apollo_py.ir.Graph` for concrete input shapes (:mod:`.program`).
"""
from .program import GraphProgram, InputSpec, Program
from . import onnx_op  # noqa: F401  (registers the onnx_op primitive the ONNX front end emits)

__all__ = ["GraphProgram", "InputSpec", "Program"]
