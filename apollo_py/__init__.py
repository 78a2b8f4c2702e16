"""apollo_py: a just-in-time fusion compiler for deep-learning graphs (after APOLLO, MLSys 2022).

Public API: :func:`jit` (ONNX models, Graphs, and numpy-style Python functions), :func:`grad` /
:func:`value_and_grad`, :func:`export`, :func:`cond` / :func:`fori_loop`, ``nn``,
:class:`GraphBuilder`, :class:`Graph`, :class:`Options` and the error classes.  Heavy modules
(onnx, islpy, llvmlite, pycuda) load on first use.
"""
from .errors import (ApolloError, CompileError, CompileTimeoutError, GraphError, InputError, ModelLoadError, OptionsError,
                     ResourceError, RuleError, ShapeError, TraceError, UnsupportedOpError)
from .machine import Machine
from .options import Options
from .ir import Graph, GraphBuilder, TensorType
from . import ops  # noqa: F401  (registers the op table the IR consults: ir/optable.py)
from .api import CompiledGraph, explain, jit

__version__ = "0.1.0"

__all__ = ["ApolloError", "CompileError", "CompileTimeoutError", "CompiledGraph", "Graph", "GraphBuilder", "GraphError",
           "InputError", "Machine", "ModelLoadError", "Options", "OptionsError", "ResourceError", "RuleError", "ShapeError",
           "TensorType", "TraceError", "UnsupportedOpError", "explain", "jit", "__version__"]

from .train import optim, train_step  # noqa: E402  (training API, DESIGN §12)
from .train.transforms import grad, value_and_grad  # noqa: E402
from .frontend.trace_control import cond, fori_loop, stop_gradient, where  # noqa: E402
from .frontend.jit import export  # noqa: E402
from . import nn  # noqa: E402

__all__ += ["cond", "export", "fori_loop", "grad", "nn", "optim", "stop_gradient", "train_step",
            "value_and_grad", "where"]


def __getattr__(name):
    # ``ap.distributed`` loads on first use: it needs the optional Ray extra, and
    # ``import apollo_py`` never imports Ray
    if name == "distributed":
        import importlib
        return importlib.import_module(".distributed", __name__)
    raise AttributeError(f"module 'apollo_py' has no attribute {name!r}")
