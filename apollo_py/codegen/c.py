"""C99 renderer of the loop IR, and a helper that builds it with the system C compiler.

Kernel ABI: ``void name(void **args, int64_t lo, int64_t hi)`` -- the same as the LLVM
back end, so the thread pool runs either.  Buffer pointers are ``restrict``.  Math uses
<math.h>; max/min propagate NaN like numpy; float16 buffers use ``_Float16`` (GCC/Clang on
x86-64 and AArch64).  ``vector`` loops get ``#pragma GCC ivdep``.
"""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile

from apollo_py.codegen import loopir as L
from apollo_py.codegen.compiled import CompiledKernelBase
from apollo_py.codegen.printer import Printer, expand_pow
from apollo_py.errors import CompileError

_C_TYPES = {"float32": "float", "float64": "double", "float16": "_Float16", "bool": "bool",
            **{d: d + "_t" for d in L.INT_DTYPES}}
#: integer dtypes narrower than int: C promotes them, so wrapping ops cast back explicitly
_NARROW = ("int8", "int16", "uint8", "uint16")
_SUFFIX = {"float32": "f", "float64": ""}


def _m(name: str):
    """Template calling the <math.h> function ``name`` (``namef`` for float32)."""
    def tpl(p: "CPrinter", dtype: str, *ops) -> str:
        return f"{name}{_SUFFIX[dtype]}({', '.join(ops)})"
    return tpl


def _as_block(s: L.Stmt) -> L.Block:
    return s if isinstance(s, L.Block) else L.Block((s,))


def _lit(dtype: str, v: float) -> str:
    return f"{v!r}{'f' if dtype == 'float32' else ''}"


class CPrinter(Printer):
    """Renders a Kernel as a C99 translation unit."""

    target = "c"
    supports_vector_hint = True

    binary_ops = {
        "add": "({a} + {b})",
        "sub": "({a} - {b})",
        "mul": "({a} * {b})",
        "div": "({a} / {b})",
        ("floordiv", "float"): lambda p, d, a, b: f"{_m('floor')(p, d, f'({a} / {b})')}",
        ("mod", "float"): lambda p, d, a, b: (
            f"({a} - {_m('floor')(p, d, f'({a} / {b})')} * {b})"),
        # floordiv/mod are defined on non-negative integers, where C's / and % agree
        ("floordiv", "int"): "({a} / {b})",
        ("mod", "int"): "({a} % {b})",
        ("max", "float"): "AP_MAX({a}, {b})",
        ("min", "float"): "AP_MIN({a}, {b})",
        "max": "({a} > {b} ? {a} : {b})",
        "min": "({a} < {b} ? {a} : {b})",
        ("pow", "float"): _m("pow"),
        "lt": "({a} < {b})",
        "le": "({a} <= {b})",
        "gt": "({a} > {b})",
        "ge": "({a} >= {b})",
        "eq": "({a} == {b})",
        "ne": "({a} != {b})",
        ("and", "bool"): "({a} && {b})",
        ("or", "bool"): "({a} || {b})",
        ("and", "int"): "({a} & {b})",
        ("or", "int"): "({a} | {b})",
    }
    unary_ops = {
        "neg": "(-{a})",
        ("abs", "float"): _m("fabs"),
        ("abs", "int"): "(({a}) < 0 ? -({a}) : ({a}))",
        ("exp", "float"): _m("exp"),
        ("log", "float"): _m("log"),
        ("sqrt", "float"): _m("sqrt"),
        ("rsqrt", "float"): lambda p, d, a: f"({_lit(d, 1.0)} / {_m('sqrt')(p, d, a)})",
        ("reciprocal", "float"): lambda p, d, a: f"({_lit(d, 1.0)} / {a})",
        ("tanh", "float"): _m("tanh"),
        ("erf", "float"): _m("erf"),
        ("sigmoid", "float"): lambda p, d, a: (
            f"({_lit(d, 1.0)} / ({_lit(d, 1.0)} + {_m('exp')(p, d, f'(-{a})')}))"),
        ("relu", "float"): "(({a}) < 0 ? 0 : ({a}))",
        ("relu", "int"): "(({a}) < 0 ? 0 : ({a}))",
        **{(op, d): "({a})" for op in ("abs", "relu") for d in L.UINT_DTYPES},
        ("floor", "float"): _m("floor"),
        ("ceil", "float"): _m("ceil"),
        ("round_f16", "float32"): "((float)(_Float16)({a}))",
        ("not", "bool"): "(!{a})",
        ("not", "int"): "(~{a})",
    }

    def __init__(self) -> None:
        super().__init__()
        self.lines: list = []
        self.depth = 1
        self.parallel_loop = None

    def type_name(self, dtype: str) -> str:
        return _C_TYPES[dtype]

    def line(self, text: str) -> None:
        self.lines.append("    " * self.depth + text)

    # ---- expressions: C expressions are nested strings; operands are bound to names
    # with a statement-level temp only where a template uses an operand twice.
    def bind(self, code: str, dtype: str) -> str:
        """Return a name holding ``code`` (a fresh const temporary unless already simple)."""
        if code.replace("_", "").isalnum():
            return code
        name = self.fresh("t")
        self.line(f"const {self.type_name(dtype)} {name} = {code};")
        return name

    def expr_Const(self, e: L.Const, index: bool) -> str:
        if e.dtype == "bool":
            return "true" if e.value else "false"
        if e.dtype == "int64":
            return f"INT64_C({e.value})"
        if L.is_unsigned(e.dtype):
            return f"(({self.type_name(e.dtype)}){e.value}ULL)"
        if L.is_int(e.dtype):
            return f"(({self.type_name(e.dtype)}){e.value})"
        v = float(e.value)
        if v != v:
            return "((float)NAN)" if e.dtype == "float32" else "((double)NAN)"
        if v in (float("inf"), float("-inf")):
            sign = "-" if v < 0 else ""
            return f"({sign}({self.type_name(e.dtype)})INFINITY)"
        return f"(({self.type_name(e.dtype)}){_lit(e.dtype, v)})"

    def expr_Var(self, e: L.Var, index: bool) -> str:
        return e.name

    def expr_Bin(self, e: L.Bin, index: bool) -> str:
        if e.op == "pow":
            fast = expand_pow(e.a, e.b)
            if fast is not None:
                return self.expr(fast, index)
        a, b = self.expr(e.a, index), self.expr(e.b, index)
        if e.op in ("max", "min", "mod"):
            a, b = self.bind(a, e.a.dtype), self.bind(b, e.b.dtype)
        code = self.apply(self.lookup(self.binary_ops, e.op, e.a.dtype), e.a.dtype, a, b)
        if e.a.dtype in _NARROW and e.op in ("add", "sub", "mul"):
            code = f"(({self.type_name(e.a.dtype)}){code})"   # wrap like numpy and LLVM
        return code

    def expr_Un(self, e: L.Un, index: bool) -> str:
        a = self.expr(e.a, index)
        if e.op in ("abs", "relu"):
            a = self.bind(a, e.a.dtype)
        code = self.apply(self.lookup(self.unary_ops, e.op, e.a.dtype), e.a.dtype, a)
        if e.a.dtype in _NARROW and e.op in ("neg", "abs", "not"):
            code = f"(({self.type_name(e.a.dtype)}){code})"
        return code

    def expr_Select(self, e: L.Select, index: bool) -> str:
        return f"({self.expr(e.cond)} ? {self.expr(e.a)} : {self.expr(e.b)})"

    def expr_Cast(self, e: L.Cast, index: bool) -> str:
        a = self.expr(e.a, index)
        if e.dtype == "bool":
            return f"(({a}) != 0)"
        return f"(({self.type_name(e.dtype)})({a}))"

    def expr_Load(self, e: L.Load, index: bool) -> str:
        ref = f"{e.buf.name}[{self.expr(e.index, True)}]"
        return f"((float){ref})" if e.buf.dtype == "float16" else ref

    # ---- statements
    def stmt_Block(self, s: L.Block) -> None:
        self.line("{")
        self.depth += 1
        for x in s.stmts:
            self.stmt(x)
        self.depth -= 1
        self.line("}")

    def stmt_Local(self, s: L.Local) -> None:
        self.line(f"{self.type_name(s.dtype)} {s.name} = {self.expr(s.init)};")

    def stmt_Assign(self, s: L.Assign) -> None:
        self.line(f"{s.name} = {self.expr(s.value)};")

    def stmt_Store(self, s: L.Store) -> None:
        v = self.expr(s.value)
        if s.buf.dtype == "float16":
            v = f"(_Float16)({v})"
        self.line(f"{s.buf.name}[{self.expr(s.index, True)}] = {v};")

    def stmt_Alloc(self, s: L.Alloc) -> None:
        self.line(f"{self.type_name(s.dtype)} {s.name}[{int(s.size)}];")

    def stmt_If(self, s: L.If) -> None:
        self.line(f"if ({self.expr(s.cond)})")
        self.stmt(_as_block(s.then))
        if s.else_ is not None:
            self.line("else")
            self.stmt(_as_block(s.else_))

    def stmt_For(self, s: L.For) -> None:
        v, t = s.var.name, self.type_name(s.var.dtype)
        self.line("{")
        self.depth += 1
        lo, hi = self.expr(s.lo, True), self.expr(s.hi, True)
        if s is self.parallel_loop:
            lo, hi = f"AP_IMAX({lo}, lo)", f"AP_IMIN({hi}, hi)"
        self.line(f"const {t} {v}_lo = {lo}, {v}_hi = {hi};")
        if s.kind == "vector":
            self.line("#pragma GCC ivdep")
        elif s.kind == "unroll":
            self.line("#pragma GCC unroll 16")
        self.line(f"for ({t} {v} = {v}_lo; {v} < {v}_hi; ++{v})")
        self.stmt(_as_block(s.body))
        self.depth -= 1
        self.line("}")

    def render(self, k: L.Kernel) -> str:
        """Return the C99 source of kernel ``k`` (one exported function ``k.name``)."""
        self.check_kernel(k)
        self.parallel_loop = self.find_parallel_loop(k)
        head = ["#include <math.h>", "#include <stdint.h>", "#include <stdbool.h>", "",
                "#define AP_MAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))",
                "#define AP_MIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))",
                "#define AP_IMAX(a, b) ((a) > (b) ? (a) : (b))",
                "#define AP_IMIN(a, b) ((a) < (b) ? (a) : (b))", "",
                f"void {k.name}(void **args, int64_t lo, int64_t hi)", "{",
                "    (void)lo; (void)hi;"]
        for i, p in enumerate(k.params):
            head.append(f"    {self.type_name(p.dtype)} *restrict {p.name} = "
                        f"({self.type_name(p.dtype)} *)args[{i}];")
        self.stmt(_as_block(k.body))
        return "\n".join(head + self.lines + ["}", ""])


def render_c(k: L.Kernel) -> str:
    """Return the C99 source of kernel ``k``."""
    return CPrinter().render(k)


def find_cc():
    """Return the path of the system C compiler (``cc``, ``gcc`` or ``clang``) or None."""
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CompiledC(CompiledKernelBase):
    """A kernel compiled to a shared library with the system C compiler."""

    def __init__(self, kernel: L.Kernel, lib: ctypes.CDLL, source: str, path: str):
        self.lib = lib  # keeps the library mapped
        self.source = source
        self.path = path
        fn = getattr(lib, kernel.name)
        super().__init__(kernel, ctypes.cast(fn, ctypes.c_void_p).value)


def compile_c(k: L.Kernel, cc=None, flags=("-O2",), workdir=None) -> CompiledC:
    """Render kernel ``k`` as C, build a shared library with ``cc`` and load it.

    ``cc`` defaults to :func:`find_cc`; ``flags`` are extra compiler flags; the library is
    written under ``workdir`` (a new temporary directory by default).  Raises CompileError
    if there is no C compiler or compilation fails (the message carries the compiler output).
    """
    cc = cc or find_cc()
    if cc is None:
        raise CompileError("no C compiler (cc, gcc or clang) found on PATH")
    source = render_c(k)
    workdir = workdir or tempfile.mkdtemp(prefix="apollo_c_")
    src = os.path.join(workdir, f"{k.name}.c")
    lib = os.path.join(workdir, f"{k.name}.so")
    with open(src, "w") as f:
        f.write(source)
    cmd = [cc, "-std=c99", "-fPIC", "-shared", *flags, src, "-o", lib, "-lm"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CompileError(f"C compile of kernel {k.name!r} failed ({' '.join(cmd)}):\n"
                           f"{proc.stderr}")
    return CompiledC(k, ctypes.CDLL(lib), source, lib)
