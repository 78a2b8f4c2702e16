"""The apollo_py exception hierarchy.

Every error a user can cause is an :class:`ApolloError` subclass whose message names the
offending node, tensor or input.  Library code never uses ``assert`` for user input.
"""
from __future__ import annotations


class ApolloError(Exception):
    """Base class of every error apollo_py raises on purpose."""


class ModelLoadError(ApolloError):
    """A model file or proto could not be read (malformed, truncated, unsafe external data)."""


class UnsupportedOpError(ApolloError):
    """An op has neither a lowering nor a reference implementation."""

    def __init__(self, op_type: str, node: str = "", detail: str = ""):
        self.op_type = op_type
        self.node = node
        where = f"node {node!r} " if node else ""
        msg = f"{where}has unsupported op type {op_type!r}"
        if detail:
            msg += f": {detail}"
        super().__init__(msg)


class ShapeError(ApolloError):
    """Shapes or dtypes of an op's operands are inconsistent."""


class InputError(ApolloError):
    """A call passed inputs that do not match the compiled graph (name, count, shape, dtype)."""


class CompileError(ApolloError):
    """A compile step failed for a reason that is not the user's input."""


class GraphError(ApolloError):
    """A graph violates an IR invariant (cycle, double assignment, dangling value)."""


class RuleError(ApolloError):
    """A partition rule table or user overlay is malformed."""


class ResourceError(ApolloError):
    """A model needs more memory than ``Options.max_memory`` allows (raised at compile time,
    before the memory is allocated); the message names the node or value."""


class FeedbackError(ApolloError):
    """A feedback log or rule overlay revision that cannot be used (missing file or revision,
    unreadable overlay)."""


class OptionsError(ApolloError):
    """An ``Options`` field (or a value it names, such as a machine preset) is invalid."""


class TraceError(ApolloError):
    """A traced Python function did something tracing cannot record: a Python branch on a
    traced value, an in-place update, a tracer used outside its trace (the message names the
    file and line of the user's code and what to write instead)."""


class CudaUnavailableError(ApolloError):
    """target="cuda" was asked for but pycuda, cuBLAS or a CUDA driver / GPU is missing."""


class CompileTimeoutError(ApolloError):
    """A compile ran past ``Options.compile_timeout``; the message names the stage and the
    micro-graph or kernel it was in (apollo_py/deadline.py also sets the attributes ``stage``,
    ``where`` and ``seconds``)."""

    stage: str = ""
    where: str = ""
    seconds: float = 0.0
