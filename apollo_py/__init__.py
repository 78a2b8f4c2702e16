"""apollo_py: a just-in-time fusion compiler for deep-learning graphs (after APOLLO, MLSys 2022).

Public API: :func:`jit`, :class:`GraphBuilder`, :class:`Graph`, :class:`Options` and the
error classes.  Heavy modules (onnx, islpy, llvmlite, pycuda) load on first use.
"""
from .errors import (ApolloError, CompileError, GraphError, InputError, ModelLoadError, OptionsError, ResourceError,
                     RuleError, ShapeError, UnsupportedOpError)
from .machine import Machine
from .options import Options
from .ir import Graph, GraphBuilder, TensorType
from . import ops  # noqa: F401  (registers the op table the IR consults: ir/optable.py)
from .api import CompiledGraph, explain, jit

__version__ = "0.1.0"

__all__ = ["ApolloError", "CompileError", "CompiledGraph", "Graph", "GraphBuilder", "GraphError",
           "InputError", "Machine", "ModelLoadError", "Options", "OptionsError", "ResourceError", "RuleError", "ShapeError", "TensorType",
           "UnsupportedOpError", "explain", "jit", "__version__"]

from .train import grad, optim, train_step  # noqa: E402  (training API, DESIGN §12)

__all__ += ["grad", "optim", "train_step"]
