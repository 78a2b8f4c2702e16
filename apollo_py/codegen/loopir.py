"""A small immutable loop IR shared by the CPU (LLVM, C) and GPU renderers.

Buffers are flat, contiguous and row-major; every index is an int64 expression.  All nodes
are frozen dataclasses, so they hash and compare structurally; :func:`structural_key` is a
sha256 over the canonical printed form (:func:`format_node`).

dtypes are strings: ``float32``, ``float64``, ``float16``, the signed integers ``int8/16/32/64``,
the unsigned ``uint8/16/32/64`` (renderers pick unsigned compares, divisions and casts for these),
and ``bool``.
``float16`` is a storage type only: loading a float16 buffer yields a float32 value and
storing converts back, so expressions never have dtype float16.  ``Un("round_f16", x)`` rounds
a float32 value to the nearest float16 and back (what numpy does after every float16 op);
kernels apply it to float16 intermediates that live in registers (see poly/ast_to_loopir.py).

Expressions support Python operators (``i * 4 + j``, ``-x``, ``a / b``, ``a // b``, ``a % b``)
with plain ints/floats coerced to :class:`Const` of the other operand's dtype; comparisons
and logic use the helper functions (:func:`lt`, :func:`maximum`, ...) so that ``==`` stays
structural equality.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Union

from apollo_py.errors import CompileError

DTYPES = ("float32", "float64", "float16", "int8", "int16", "int32", "int64",
          "uint8", "uint16", "uint32", "uint64", "bool")
FLOAT_DTYPES = ("float32", "float64", "float16")
UINT_DTYPES = ("uint8", "uint16", "uint32", "uint64")
INT_DTYPES = ("int8", "int16", "int32", "int64") + UINT_DTYPES

BINARY_OPS = ("add", "sub", "mul", "div", "floordiv", "mod", "max", "min", "pow",
              "lt", "le", "gt", "ge", "eq", "ne", "and", "or")
COMPARE_OPS = ("lt", "le", "gt", "ge", "eq", "ne")
UNARY_OPS = ("neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "erf",
             "sigmoid", "relu", "not", "floor", "ceil", "round_f16")
FLOAT_ONLY_UNARY = ("exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "erf", "sigmoid",
                    "floor", "ceil", "round_f16")
FOR_KINDS = ("serial", "parallel", "vector", "unroll", "gpu_block", "gpu_thread")
ALLOC_SCOPES = ("local", "shared")


def check_name(name: str, what: str) -> None:
    """Raise CompileError unless ``name`` is a Python/C identifier (renderers use it as is)."""
    if not isinstance(name, str) or not name.isidentifier():
        raise CompileError(f"{what} name {name!r} is not an identifier")


def compute_dtype(dtype: str) -> str:
    """Return the dtype values of storage type ``dtype`` have in registers (float16 -> float32)."""
    if dtype not in DTYPES:
        raise CompileError(f"unknown dtype {dtype!r}; expected one of {DTYPES}")
    return "float32" if dtype == "float16" else dtype


def is_float(dtype: str) -> bool:
    """True for the floating dtypes (storage or compute)."""
    return dtype in FLOAT_DTYPES


def is_int(dtype: str) -> bool:
    """True for the integer dtypes, signed and unsigned (not bool)."""
    return dtype in INT_DTYPES


def is_unsigned(dtype: str) -> bool:
    """True for uint8/16/32/64."""
    return dtype in UINT_DTYPES


# --------------------------------------------------------------------------- expressions


class Expr:
    """Base class of expressions; provides operator overloading.

    Every subclass has a ``dtype`` (a field for Var, Const and Cast, a property otherwise)
    holding its compute dtype; it is not declared here so that it can be a dataclass field.
    """

    __slots__ = ()

    def __add__(self, o): return Bin("add", self, as_expr(o, self.dtype))
    def __radd__(self, o): return Bin("add", as_expr(o, self.dtype), self)
    def __sub__(self, o): return Bin("sub", self, as_expr(o, self.dtype))
    def __rsub__(self, o): return Bin("sub", as_expr(o, self.dtype), self)
    def __mul__(self, o): return Bin("mul", self, as_expr(o, self.dtype))
    def __rmul__(self, o): return Bin("mul", as_expr(o, self.dtype), self)
    def __truediv__(self, o): return Bin("div", self, as_expr(o, self.dtype))
    def __rtruediv__(self, o): return Bin("div", as_expr(o, self.dtype), self)
    def __floordiv__(self, o): return Bin("floordiv", self, as_expr(o, self.dtype))
    def __rfloordiv__(self, o): return Bin("floordiv", as_expr(o, self.dtype), self)
    def __mod__(self, o): return Bin("mod", self, as_expr(o, self.dtype))
    def __rmod__(self, o): return Bin("mod", as_expr(o, self.dtype), self)
    def __neg__(self): return Un("neg", self)


def as_expr(value, dtype: str = "int64") -> Expr:
    """Return ``value`` unchanged if it is an Expr, else a Const of ``dtype``.

    Python bools become bool constants, floats force a float dtype (float32 if ``dtype`` is
    not a float dtype).
    """
    if isinstance(value, Expr):
        return value
    if isinstance(value, bool):
        return Const(value, "bool")
    if isinstance(value, float) and not is_float(dtype):
        return Const(value, "float32")
    if isinstance(value, (int, float)):
        return Const(value, compute_dtype(dtype))
    raise CompileError(f"cannot use {value!r} of type {type(value).__name__} as an expression")


@dataclass(frozen=True, eq=True)
class Var(Expr):
    """A scalar variable: a loop index or a Local."""

    name: str
    dtype: str = "int64"

    def __post_init__(self):
        check_name(self.name, "variable")
        object.__setattr__(self, "dtype", compute_dtype(self.dtype))


@dataclass(frozen=True, eq=True)
class Const(Expr):
    """A literal; ``value`` is normalised to bool/int/float according to ``dtype``."""

    value: Union[bool, int, float]
    dtype: str = "int64"

    def __post_init__(self):
        d = compute_dtype(self.dtype)
        object.__setattr__(self, "dtype", d)
        if d == "bool":
            object.__setattr__(self, "value", bool(self.value))
        elif is_int(d):
            if isinstance(self.value, float) and not self.value.is_integer():
                raise CompileError(f"integer constant of dtype {d} has value {self.value!r}")
            object.__setattr__(self, "value", int(self.value))
        else:
            object.__setattr__(self, "value", float(self.value))


@dataclass(frozen=True, eq=True)
class Bin(Expr):
    """A binary op; operands must share one dtype (comparisons return bool)."""

    op: str
    a: Expr
    b: Expr

    def __post_init__(self):
        if self.op not in BINARY_OPS:
            raise CompileError(f"unknown binary op {self.op!r}")
        if self.a.dtype != self.b.dtype:
            raise CompileError(f"binary op {self.op!r} on mismatched dtypes "
                               f"{self.a.dtype} and {self.b.dtype}: insert a Cast")
        if self.op == "div" and not is_float(self.a.dtype):
            raise CompileError(f"'div' needs float operands, got {self.a.dtype}; use floordiv")
        if self.op in ("and", "or") and is_float(self.a.dtype):
            raise CompileError(f"{self.op!r} needs bool or integer operands, got {self.a.dtype}")
        if self.op == "pow" and not is_float(self.a.dtype):
            raise CompileError(f"'pow' needs float operands, got {self.a.dtype}")

    @property
    def dtype(self) -> str:
        return "bool" if self.op in COMPARE_OPS else self.a.dtype


@dataclass(frozen=True, eq=True)
class Un(Expr):
    """A unary op (math functions need float operands; ``not`` needs bool or int).

    ``upper`` / ``lower`` are range facts proved by the producer (poly/range_facts.py): the
    operand is ``<= upper`` (``>= lower``) or NaN, up to rounding.  Renderers may use them to
    drop range checks (LLVM: ``exp`` without its upper clamp, ``log`` without its zero,
    negative, subnormal and inf cases); semantics do not change, so others ignore them."""

    op: str
    a: Expr
    upper: Optional[float] = None
    lower: Optional[float] = None

    def __post_init__(self):
        if (self.upper is not None or self.lower is not None) and not is_float(self.a.dtype):
            raise CompileError(f"unary op {self.op!r}: a range fact needs a float operand")
        if self.op not in UNARY_OPS:
            raise CompileError(f"unknown unary op {self.op!r}")
        if self.op in FLOAT_ONLY_UNARY and not is_float(self.a.dtype):
            raise CompileError(f"unary op {self.op!r} needs a float operand, got {self.a.dtype}")
        if self.op == "not" and is_float(self.a.dtype):
            raise CompileError("'not' needs a bool or integer operand")

    @property
    def dtype(self) -> str:
        return self.a.dtype


@dataclass(frozen=True, eq=True)
class Select(Expr):
    """``cond ? a : b`` evaluated without branches (both sides are computed)."""

    cond: Expr
    a: Expr
    b: Expr

    def __post_init__(self):
        if self.cond.dtype != "bool":
            raise CompileError(f"Select condition must be bool, got {self.cond.dtype}")
        if self.a.dtype != self.b.dtype:
            raise CompileError(f"Select arms have dtypes {self.a.dtype} and {self.b.dtype}")

    @property
    def dtype(self) -> str:
        return self.a.dtype


@dataclass(frozen=True, eq=True)
class Cast(Expr):
    """Convert ``a`` to ``dtype`` (float->int truncates toward zero; x->bool is x != 0)."""

    dtype: str
    a: Expr

    def __post_init__(self):
        object.__setattr__(self, "dtype", compute_dtype(self.dtype))


@dataclass(frozen=True, eq=True)
class Param:
    """A buffer argument of a kernel: ``size`` elements of ``dtype``."""

    name: str
    dtype: str
    size: int

    def __post_init__(self):
        check_name(self.name, "buffer")
        compute_dtype(self.dtype)
        if int(self.size) < 0:
            raise CompileError(f"buffer {self.name!r} has negative size {self.size}")

    def __getitem__(self, index) -> "Load":
        return Load(self, as_expr(index))


@dataclass(frozen=True, eq=True)
class Load(Expr):
    """Read ``buf[index]``; ``buf`` is a Param or an Alloc."""

    buf: Union[Param, "Alloc"]
    index: Expr

    def __post_init__(self):
        _check_index(self.index, f"load from {self.buf.name!r}")

    @property
    def dtype(self) -> str:
        return compute_dtype(self.buf.dtype)


def _check_index(index: Expr, where: str) -> None:
    if not isinstance(index, Expr) or not is_int(index.dtype):
        got = getattr(index, "dtype", type(index).__name__)
        raise CompileError(f"{where}: index must be an integer expression, got {got}")


# --------------------------------------------------------------------------- statements


class Stmt:
    """Base class of statements."""

    __slots__ = ()


@dataclass(frozen=True, eq=True)
class Block(Stmt):
    """A sequence of statements; Locals and Allocs are visible to the statements after them."""

    stmts: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "stmts", tuple(self.stmts))


@dataclass(frozen=True, eq=True)
class For(Stmt):
    """``for var in [lo, hi)`` with step 1; ``kind`` is a scheduling hint for the renderer."""

    var: Var
    lo: Expr
    hi: Expr
    body: Stmt
    kind: str = "serial"

    def __post_init__(self):
        if self.kind not in FOR_KINDS:
            raise CompileError(f"loop {self.var.name!r} has unknown kind {self.kind!r}")
        vd = self.var.dtype
        if not is_int(vd):
            raise CompileError(f"loop {self.var.name!r} needs an integer variable, got {vd}")
        for attr in ("lo", "hi"):
            b = as_expr(getattr(self, attr), vd)
            if isinstance(b, Const) and b.dtype != vd and is_int(b.dtype):
                b = Const(b.value, vd)
            if b.dtype != vd:
                raise CompileError(f"loop {self.var.name!r} ({vd}) has a {attr} bound of "
                                   f"dtype {b.dtype}: insert a Cast")
            object.__setattr__(self, attr, b)
        if isinstance(self.body, (list, tuple)):
            object.__setattr__(self, "body", Block(tuple(self.body)))


@dataclass(frozen=True, eq=True)
class If(Stmt):
    """Branch on a bool condition."""

    cond: Expr
    then: Stmt
    else_: Optional[Stmt] = None

    def __post_init__(self):
        if self.cond.dtype != "bool":
            raise CompileError(f"If condition must be bool, got {self.cond.dtype}")
        for attr in ("then", "else_"):
            v = getattr(self, attr)
            if isinstance(v, (list, tuple)):
                object.__setattr__(self, attr, Block(tuple(v)))


@dataclass(frozen=True, eq=True)
class Local(Stmt):
    """Declare a mutable scalar ``name`` initialised to ``init`` (read it with ``Var``)."""

    name: str
    dtype: str
    init: Expr

    def __post_init__(self):
        check_name(self.name, "local")
        d = compute_dtype(self.dtype)
        object.__setattr__(self, "dtype", d)
        object.__setattr__(self, "init", as_expr(self.init, d))
        if self.init.dtype != d:
            raise CompileError(f"Local {self.name!r} of dtype {d} initialised with "
                               f"{self.init.dtype}")

    @property
    def var(self) -> Var:
        return Var(self.name, self.dtype)


@dataclass(frozen=True, eq=True)
class Assign(Stmt):
    """Assign ``value`` to the Local ``name`` (a str or the Local's Var)."""

    name: Union[str, Var]
    value: Expr

    def __post_init__(self):
        if isinstance(self.name, Var):
            object.__setattr__(self, "name", self.name.name)


@dataclass(frozen=True, eq=True)
class Store(Stmt):
    """Write ``value`` to ``buf[index]`` (converted to float16 when ``buf`` stores float16)."""

    buf: Union[Param, "Alloc"]
    index: Expr
    value: Expr

    def __post_init__(self):
        object.__setattr__(self, "index", as_expr(self.index))
        _check_index(self.index, f"store to {self.buf.name!r}")
        want = compute_dtype(self.buf.dtype)
        object.__setattr__(self, "value", as_expr(self.value, want))
        if self.value.dtype != want:
            raise CompileError(f"store of {self.value.dtype} into {self.buf.name!r} of "
                               f"dtype {self.buf.dtype}: insert a Cast")


@dataclass(frozen=True, eq=True)
class Alloc(Stmt):
    """Declare a small fixed-size scratch array (tile); address it with Load/Store."""

    name: str
    dtype: str
    size: int
    scope: str = "local"

    def __post_init__(self):
        check_name(self.name, "Alloc")
        compute_dtype(self.dtype)
        if self.scope not in ALLOC_SCOPES:
            raise CompileError(f"Alloc {self.name!r} has unknown scope {self.scope!r}")
        if int(self.size) <= 0:
            raise CompileError(f"Alloc {self.name!r} needs a positive size, got {self.size}")

    def __getitem__(self, index) -> Load:
        return Load(self, as_expr(index))


@dataclass(frozen=True, eq=True)
class Kernel:
    """A kernel: buffer params, a body, and optionally the parallel loop the runtime splits.

    If ``parallel_var`` is set, the outermost ``For`` over that variable with kind
    ``parallel`` runs only over the chunk ``[lo, hi)`` handed to the kernel (intersected with
    its own bounds); ``parallel_extent`` is the full extent the runtime splits.
    ``vector_width``: the widest vectors (bits) LLVM should prefer for this kernel (None: the
    host's choice, codegen/llvm.py); a tuning decision (tuning/db.py, ``kernel:`` pieces).
    """

    name: str
    params: tuple
    body: Stmt
    parallel_var: Optional[str] = None
    parallel_extent: Optional[int] = None
    vector_width: Optional[int] = None

    def __post_init__(self):
        object.__setattr__(self, "params", tuple(self.params))
        if isinstance(self.body, (list, tuple)):
            object.__setattr__(self, "body", Block(tuple(self.body)))
        if not self.name.isidentifier():
            raise CompileError(f"kernel name {self.name!r} is not an identifier")
        if (self.parallel_var is None) != (self.parallel_extent is None):
            raise CompileError(f"kernel {self.name!r}: parallel_var and parallel_extent "
                               "must be given together")
        if self.vector_width not in (None, 128, 256, 512):
            raise CompileError(f"kernel {self.name!r}: vector_width must be None, 128, 256 or 512 bits, "
                               f"got {self.vector_width!r}")

    def replace(self, **changes) -> "Kernel":
        """Return a copy with ``changes`` applied."""
        return replace(self, **changes)

    def structural_key(self) -> str:
        """sha256 hex digest of the canonical printed form."""
        return structural_key(self)


# --------------------------------------------------------------------------- helpers


def outer_parallel_loop(k: "Kernel"):
    """The outermost (breadth-first) parallel For over ``k.parallel_var``; None when the kernel
    has no parallel var or no such loop."""
    if k.parallel_var is None:
        return None
    stack = [k.body]
    while stack:
        s = stack.pop(0)
        if isinstance(s, For):
            if s.kind == "parallel" and s.var.name == k.parallel_var:
                return s
            stack.append(s.body)
        elif isinstance(s, Block):
            stack.extend(s.stmts)
        elif isinstance(s, If):
            stack.extend(x for x in (s.then, s.else_) if x is not None)
    return None


def _b(op, a, b) -> Bin:
    if not isinstance(a, Expr):
        a = as_expr(a, b.dtype if isinstance(b, Expr) else "int64")
    return Bin(op, a, as_expr(b, a.dtype))


def lt(a, b) -> Bin: return _b("lt", a, b)
def le(a, b) -> Bin: return _b("le", a, b)
def gt(a, b) -> Bin: return _b("gt", a, b)
def ge(a, b) -> Bin: return _b("ge", a, b)
def eq(a, b) -> Bin: return _b("eq", a, b)
def ne(a, b) -> Bin: return _b("ne", a, b)
def land(a, b) -> Bin: return _b("and", a, b)
def lor(a, b) -> Bin: return _b("or", a, b)
def maximum(a, b) -> Bin: return _b("max", a, b)
def minimum(a, b) -> Bin: return _b("min", a, b)
def power(a, b) -> Bin: return _b("pow", a, b)


def call(op: str, a: Expr) -> Un:
    """Unary op by name, e.g. ``call("exp", x)``."""
    return Un(op, a)


def for_(name: str, lo, hi, body, kind: str = "serial") -> For:
    """Build ``For(Var(name), lo, hi, body, kind)``; ``body`` may be a list of statements."""
    return For(Var(name, "int64"), as_expr(lo), as_expr(hi), body, kind)


def block(*stmts) -> Block:
    """Block of ``stmts``, flattening nested lists/tuples."""
    out = []
    for s in stmts:
        if isinstance(s, (list, tuple)):
            out.extend(block(*s).stmts)
        else:
            out.append(s)
    return Block(tuple(out))


# --------------------------------------------------------------------------- printing


def _fmt_const(c: Const) -> str:
    if c.dtype == "bool":
        return "true" if c.value else "false"
    if is_int(c.dtype):
        return f"{c.value}:{c.dtype}"
    return f"{float(c.value)!r}:{c.dtype}"


def walk(node):
    """Every Stmt and Expr under ``node`` (a Stmt, an Expr or a list/tuple of them), ``node``
    first, depth first through the dataclass fields (a For's variable included)."""
    if isinstance(node, (list, tuple)):
        for x in node:
            yield from walk(x)
    elif isinstance(node, (Stmt, Expr)):
        yield node
        for f in fields(node):
            v = getattr(node, f.name)
            if isinstance(v, (Stmt, Expr, list, tuple)):
                yield from walk(v)


def map_nodes(node, fn):
    """``node`` rebuilt bottom up with ``fn`` applied to every Stmt, Expr and Param in it
    (``fn`` returns its argument to keep it); unchanged subtrees are returned as they are."""
    if isinstance(node, tuple):
        t = tuple(map_nodes(x, fn) for x in node)
        return t if any(a is not b for a, b in zip(t, node)) else node
    if isinstance(node, (Stmt, Expr, Param)):
        changes = {}
        for f in fields(node):
            v = getattr(node, f.name)
            if isinstance(v, (Stmt, Expr, Param, tuple)):
                nv = map_nodes(v, fn)
                if nv is not v:
                    changes[f.name] = nv
        return fn(replace(node, **changes) if changes else node)
    return node


def rename_params(k: "Kernel", names) -> "Kernel | None":
    """``k`` with its params named ``names`` (in order, already valid identifiers), every
    reference in the body renamed with them; None when a new name is taken by a local, a
    scratch buffer or a loop variable of ``k`` (the renaming would capture it)."""
    names = list(names)
    if len(names) != len(k.params):
        return None
    if all(p.name == n for p, n in zip(k.params, names)):
        return k
    scratch = {x.name for x in walk(k.body) if isinstance(x, (Alloc, Local))} | \
        {x.var.name for x in walk(k.body) if isinstance(x, For)}
    if scratch & set(names):
        return None
    mapping = {p.name: Param(n, p.dtype, p.size) for p, n in zip(k.params, names)}
    body = map_nodes(k.body, lambda x: mapping.get(x.name, x) if isinstance(x, Param) else x)
    return k.replace(params=tuple(mapping[p.name] for p in k.params), body=body)


def format_expr(e: Expr) -> str:
    """Canonical one-line text of an expression."""
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Const):
        return _fmt_const(e)
    if isinstance(e, Bin):
        return f"{e.op}({format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Un):
        fact = ("" if e.lower is None else f", >={float(e.lower)!r}") + \
            ("" if e.upper is None else f", <={float(e.upper)!r}")
        return f"{e.op}({format_expr(e.a)}{fact})"
    if isinstance(e, Select):
        return f"select({format_expr(e.cond)}, {format_expr(e.a)}, {format_expr(e.b)})"
    if isinstance(e, Cast):
        return f"cast<{e.dtype}>({format_expr(e.a)})"
    if isinstance(e, Load):
        return f"{e.buf.name}[{format_expr(e.index)}]"
    raise CompileError(f"not an expression: {e!r}")


def format_stmt(s: Stmt, indent: int = 0) -> str:
    """Canonical multi-line text of a statement."""
    pad = "  " * indent
    if isinstance(s, Block):
        return "".join(format_stmt(x, indent) for x in s.stmts)
    if isinstance(s, For):
        head = (f"{pad}for {s.var.name} in [{format_expr(s.lo)}, {format_expr(s.hi)}) "
                f"{s.kind}:\n")
        return head + format_stmt(s.body, indent + 1)
    if isinstance(s, If):
        out = f"{pad}if {format_expr(s.cond)}:\n" + format_stmt(s.then, indent + 1)
        if s.else_ is not None:
            out += f"{pad}else:\n" + format_stmt(s.else_, indent + 1)
        return out
    if isinstance(s, Local):
        return f"{pad}local {s.name}: {s.dtype} = {format_expr(s.init)}\n"
    if isinstance(s, Assign):
        return f"{pad}{s.name} = {format_expr(s.value)}\n"
    if isinstance(s, Store):
        return f"{pad}{s.buf.name}[{format_expr(s.index)}] = {format_expr(s.value)}\n"
    if isinstance(s, Alloc):
        return f"{pad}alloc {s.name}: {s.dtype}[{s.size}] {s.scope}\n"
    raise CompileError(f"not a statement: {s!r}")


def format_node(node) -> str:
    """Canonical text of a Kernel, statement or expression (the input of structural_key)."""
    if isinstance(node, Kernel):
        params = ", ".join(f"{p.name}: {p.dtype}[{p.size}]" for p in node.params)
        par = ""
        if node.parallel_var is not None:
            par = f" parallel {node.parallel_var} extent {node.parallel_extent}"
        if node.vector_width:
            par += f" vector_width {node.vector_width}"
        return f"kernel {node.name}({params}){par}:\n" + format_stmt(node.body, 1)
    if isinstance(node, Stmt):
        return format_stmt(node)
    return format_expr(node)


def structural_key(node) -> str:
    """sha256 hex digest of :func:`format_node` of ``node``."""
    return hashlib.sha256(format_node(node).encode()).hexdigest()


# --------------------------------------------------------------------------- verification


def verify_kernel(k: Kernel) -> None:
    """Check scoping, buffer references and the parallel loop; raise CompileError if bad.

    Expects a Kernel; returns None.  Every Var must be a loop variable or a Local in scope,
    every buffer a param or an Alloc in scope, and, if ``parallel_var`` is set, a ``parallel``
    For over that variable must exist.
    """
    names = [p.name for p in k.params]
    if len(set(names)) != len(names):
        raise CompileError(f"kernel {k.name!r} has duplicate parameter names {names}")
    found = []

    def expr(e: Expr, scope: dict, bufs: dict) -> None:
        if isinstance(e, Var):
            if scope.get(e.name) != e.dtype:
                raise CompileError(f"kernel {k.name!r}: variable {e.name!r} ({e.dtype}) is "
                                   "not in scope with that dtype")
        elif isinstance(e, Bin):
            expr(e.a, scope, bufs), expr(e.b, scope, bufs)
        elif isinstance(e, (Un, Cast)):
            expr(e.a, scope, bufs)
        elif isinstance(e, Select):
            expr(e.cond, scope, bufs), expr(e.a, scope, bufs), expr(e.b, scope, bufs)
        elif isinstance(e, Load):
            if bufs.get(e.buf.name) != e.buf:
                raise CompileError(f"kernel {k.name!r}: buffer {e.buf.name!r} not in scope")
            expr(e.index, scope, bufs)

    def stmt(s: Stmt, scope: dict, bufs: dict, depth_par: bool) -> None:
        if isinstance(s, Block):
            scope, bufs = dict(scope), dict(bufs)
            for x in s.stmts:
                stmt(x, scope, bufs, depth_par)
        elif isinstance(s, For):
            expr(s.lo, scope, bufs), expr(s.hi, scope, bufs)
            if s.kind == "parallel" and s.var.name == k.parallel_var and not depth_par:
                found.append(s)
                depth_par = True
            inner = dict(scope)
            inner[s.var.name] = s.var.dtype
            stmt(s.body, inner, dict(bufs), depth_par)
        elif isinstance(s, If):
            expr(s.cond, scope, bufs)
            stmt(s.then, dict(scope), dict(bufs), depth_par)
            if s.else_ is not None:
                stmt(s.else_, dict(scope), dict(bufs), depth_par)
        elif isinstance(s, Local):
            expr(s.init, scope, bufs)
            scope[s.name] = s.dtype
        elif isinstance(s, Assign):
            if s.name not in scope:
                raise CompileError(f"kernel {k.name!r}: assignment to undeclared {s.name!r}")
            if scope[s.name] != s.value.dtype:
                raise CompileError(f"kernel {k.name!r}: assigning {s.value.dtype} to "
                                   f"{s.name!r} of dtype {scope[s.name]}")
            expr(s.value, scope, bufs)
        elif isinstance(s, Store):
            if bufs.get(s.buf.name) != s.buf:
                raise CompileError(f"kernel {k.name!r}: buffer {s.buf.name!r} not in scope")
            expr(s.index, scope, bufs), expr(s.value, scope, bufs)
        elif isinstance(s, Alloc):
            bufs[s.name] = s
        else:
            raise CompileError(f"kernel {k.name!r}: not a statement: {s!r}")

    stmt(k.body, {}, {p.name: p for p in k.params}, False)
    if k.parallel_var is not None and not found:
        raise CompileError(f"kernel {k.name!r}: no parallel loop over {k.parallel_var!r}")


def affine_form(e: Expr):
    """``{var name: coefficient, "": constant}`` of an int64 index expression built from
    constants, variables, ``+``, ``-`` and ``*`` by a constant; None for anything else."""
    if isinstance(e, Const):
        return {"": int(e.value)} if e.dtype == "int64" else None
    if isinstance(e, Var):
        return {e.name: 1} if e.dtype == "int64" else None
    if isinstance(e, Bin) and e.op in ("add", "sub", "mul") and e.dtype == "int64":
        a, b = affine_form(e.a), affine_form(e.b)
        if a is None or b is None:
            return None
        if e.op == "mul":
            if set(a) <= {""}:
                a, b = b, a
            if not set(b) <= {""}:
                return None
            return {k: v * b.get("", 0) for k, v in a.items()}
        out, sign = dict(a), (1 if e.op == "add" else -1)
        for k, v in b.items():
            out[k] = out.get(k, 0) + sign * v
        return out
    return None
