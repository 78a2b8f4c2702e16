"""The printer base class shared by every renderer.

A renderer is a :class:`Printer` subclass with capability flags and two op tables
(``binary_ops`` and ``unary_ops``).  A table maps a key to a template; keys are looked up
most specific first: ``(op, dtype)``, then ``(op, dtype class)`` where the class is one of
``"float"``, ``"int"``, ``"bool"``, then plain ``op``.  A template is either a format string
(fields ``{a}``, ``{b}``, ``{t}`` for the operand type, plus whatever the renderer adds) or a
callable ``(printer, dtype, *operands) -> str``.  Subclasses override only the entries that
differ; the set of supported ops is read off the tables.
"""
from __future__ import annotations

import itertools
from typing import Callable, Union

from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError

Template = Union[str, Callable[..., str]]


def dtype_class(dtype: str) -> str:
    """Return ``"float"``, ``"int"`` or ``"bool"`` for a compute dtype."""
    if L.is_float(dtype):
        return "float"
    if L.is_int(dtype):
        return "int"
    return "bool"


def expand_pow(a: L.Expr, b: L.Expr):
    """Rewrite ``a ** b`` with a constant small-integer (or +-0.5) exponent into mul/sqrt.

    Expects float expressions; returns an equivalent Expr, or None when ``b`` is not one of
    the exact fast-path exponents (0, +-1, +-2, +-3, +-4, +-0.5).
    """
    if not isinstance(b, L.Const):
        return None
    v = float(b.value)
    one = L.Const(1.0, a.dtype)
    if v == 0.0:
        return one
    if v == 0.5:
        return L.Un("sqrt", a)
    if v == -0.5:
        return L.Un("rsqrt", a)
    if v.is_integer() and 1 <= abs(v) <= 4:
        n = int(abs(v))
        sq = L.Bin("mul", a, a)
        prod = {1: a, 2: sq, 3: L.Bin("mul", sq, a), 4: L.Bin("mul", sq, sq)}[n]
        return prod if v > 0 else L.Bin("div", one, prod)
    return None


class Printer:
    """Base renderer: op tables, capability flags, name generation and dispatch.

    Subclasses implement ``stmt_<Class>`` and ``expr_<Class>`` methods for the loop IR node
    classes and ``render(kernel) -> str``.
    """

    #: target name used in cache keys and messages
    target = "abstract"
    #: can store/load float16 buffers
    supports_float16 = True
    #: honours For kind "vector" with a vectorisation hint
    supports_vector_hint = False
    #: honours For kinds gpu_block / gpu_thread
    supports_gpu_loops = False
    binary_ops: dict = {}
    unary_ops: dict = {}

    def __init__(self) -> None:
        self._counter = itertools.count()

    # ---- tables
    @classmethod
    def supported_ops(cls) -> set:
        """Return the op names (binary and unary) that have a template in this printer."""
        ops = set()
        for table in (cls.binary_ops, cls.unary_ops):
            for key in table:
                ops.add(key[0] if isinstance(key, tuple) else key)
        return ops

    def lookup(self, table: dict, op: str, dtype: str) -> Template:
        """Return the template for ``op`` on ``dtype`` or raise CompileError."""
        for key in ((op, dtype), (op, dtype_class(dtype)), op):
            if key in table:
                return table[key]
        raise CompileError(f"{self.target} renderer has no code for op {op!r} on {dtype}")

    def apply(self, template: Template, dtype: str, *operands, **fields) -> str:
        """Instantiate ``template`` with operand strings; ``t`` is filled by ``type_name``."""
        if callable(template):
            return template(self, dtype, *operands)
        names = dict(zip("abc", operands))
        return template.format(t=self.type_name(dtype), **names, **fields)

    # ---- names
    def fresh(self, prefix: str = "t") -> str:
        """Return a new unique identifier starting with ``prefix``."""
        return f"{prefix}{next(self._counter)}"

    def type_name(self, dtype: str) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    # ---- dispatch
    def stmt(self, s: L.Stmt) -> None:
        """Emit statement ``s`` through ``stmt_<Class>``."""
        method = getattr(self, "stmt_" + type(s).__name__, None)
        if method is None:
            raise CompileError(f"{self.target} renderer cannot render {type(s).__name__}")
        method(s)

    def expr(self, e: L.Expr, index: bool = False) -> str:
        """Emit expression ``e`` through ``expr_<Class>``; ``index`` marks address arithmetic."""
        method = getattr(self, "expr_" + type(e).__name__, None)
        if method is None:
            raise CompileError(f"{self.target} renderer cannot render {type(e).__name__}")
        return method(e, index)

    def check_kernel(self, k: L.Kernel) -> None:
        """Verify ``k`` and the renderer's capabilities; raise CompileError on failure."""
        L.verify_kernel(k)
        if not self.supports_float16 and any(p.dtype == "float16" for p in k.params):
            raise CompileError(f"{self.target} renderer does not support float16 buffers "
                               f"(kernel {k.name!r})")

    def find_parallel_loop(self, k: L.Kernel):
        """Return the outermost parallel For over ``k.parallel_var`` (None if unset)."""
        if k.parallel_var is None:
            return None
        loop = L.outer_parallel_loop(k)
        if loop is None:
            raise CompileError(f"kernel {k.name!r}: no parallel loop over {k.parallel_var!r}")
        return loop

    def render(self, k: L.Kernel) -> str:  # pragma: no cover - overridden
        raise NotImplementedError
