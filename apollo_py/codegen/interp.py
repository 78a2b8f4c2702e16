"""A reference interpreter for the loop IR (slow, scalar, exact numpy semantics).

It runs a Kernel on numpy arrays one scalar at a time, with numpy scalar arithmetic in the
kernel's dtypes, so tests can check a renderer -- or a transform that produces loop IR --
against the meaning of the IR itself rather than a hand-written numpy expression.  Meant for
small kernels (about 1e5 scalar operations per second).
"""
from __future__ import annotations

import math

import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError, InputError

_NP = {"float32": np.float32, "float64": np.float64, "float16": np.float32, "bool": np.bool_,
       **{d: np.dtype(d).type for d in L.INT_DTYPES}}

_BIN = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
    "div": lambda a, b: a / b, "floordiv": lambda a, b: a // b, "mod": lambda a, b: a % b,
    "max": np.maximum, "min": np.minimum, "pow": np.power,
    "lt": lambda a, b: a < b, "le": lambda a, b: a <= b, "gt": lambda a, b: a > b,
    "ge": lambda a, b: a >= b, "eq": lambda a, b: a == b, "ne": lambda a, b: a != b,
    "and": lambda a, b: a & b, "or": lambda a, b: a | b,
}


def _erf(a):
    return type(a)(math.erf(float(a))) if not math.isnan(a) else a


_UN = {
    "neg": np.negative, "abs": np.abs, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda a: type(a)(1) / np.sqrt(a), "reciprocal": lambda a: type(a)(1) / a,
    "tanh": np.tanh, "erf": _erf, "sigmoid": lambda a: type(a)(1) / (type(a)(1) + np.exp(-a)),
    "relu": lambda a: np.maximum(a, type(a)(0)), "not": np.invert, "floor": np.floor,
    "ceil": np.ceil, "round_f16": lambda a: np.float32(np.float16(a)),
}


_DECL = "@declared"  # env key: names declared in the innermost scope


def _merge(outer: dict, inner: dict) -> None:
    """Copy assignments made in ``inner`` to variables of ``outer`` it did not shadow."""
    for name in outer:
        if name != _DECL and name not in inner[_DECL]:
            outer[name] = inner[name]


class _Interp:
    def __init__(self, kernel: L.Kernel, arrays, lo: int, hi: int):
        self.k = kernel
        self.buffers = {p.name: a for p, a in zip(kernel.params, arrays)}
        self.lo, self.hi = lo, hi
        self.par = None

    def expr(self, e: L.Expr, env: dict):
        if isinstance(e, L.Var):
            return env[e.name]
        if isinstance(e, L.Const):
            return _NP[e.dtype](e.value)
        if isinstance(e, L.Bin):
            return _NP[e.dtype](_BIN[e.op](self.expr(e.a, env), self.expr(e.b, env)))
        if isinstance(e, L.Un):
            return _NP[e.dtype](_UN[e.op](self.expr(e.a, env)))
        if isinstance(e, L.Select):
            return self.expr(e.a, env) if self.expr(e.cond, env) else self.expr(e.b, env)
        if isinstance(e, L.Cast):
            v = self.expr(e.a, env)
            if e.dtype == "bool":
                return np.bool_(v != 0)
            if L.is_int(e.dtype) and L.is_float(L.compute_dtype(e.a.dtype)):
                return _NP[e.dtype](math.trunc(float(v)))
            return _NP[e.dtype](v)
        if isinstance(e, L.Load):
            buf = env["@buf:" + e.buf.name]
            return _NP[L.compute_dtype(e.buf.dtype)](buf[int(self.expr(e.index, env))])
        raise CompileError(f"interpreter: not an expression: {e!r}")

    def stmt(self, s: L.Stmt, env: dict) -> None:
        if isinstance(s, L.Block):
            inner = dict(env)
            inner[_DECL] = set()
            for x in s.stmts:
                self.stmt(x, inner)
            _merge(env, inner)
        elif isinstance(s, L.For):
            lo, hi = int(self.expr(s.lo, env)), int(self.expr(s.hi, env))
            if s is self.par:
                lo, hi = max(lo, self.lo), min(hi, self.hi)
            for i in range(lo, hi):
                inner = dict(env)
                inner[_DECL] = {s.var.name}
                inner[s.var.name] = _NP[s.var.dtype](i)
                self.stmt(s.body, inner)
                _merge(env, inner)
        elif isinstance(s, L.If):
            branch = s.then if self.expr(s.cond, env) else s.else_
            if branch is not None:
                self.stmt(L.Block((branch,)), env)
        elif isinstance(s, L.Local):
            env[s.name] = _NP[s.dtype](self.expr(s.init, env))
            env[_DECL].add(s.name)
        elif isinstance(s, L.Assign):
            env[s.name] = type(env[s.name])(self.expr(s.value, env))
        elif isinstance(s, L.Store):
            buf = env["@buf:" + s.buf.name]
            idx = int(self.expr(s.index, env))
            if not 0 <= idx < buf.size:
                raise InputError(f"kernel {self.k.name!r}: store to {s.buf.name!r}[{idx}] is "
                                 f"out of bounds (size {buf.size})")
            buf[idx] = self.expr(s.value, env)
        elif isinstance(s, L.Alloc):
            env["@buf:" + s.name] = np.zeros(int(s.size), _NP[s.dtype] if s.dtype != "float16"
                                             else np.float16)
        else:
            raise CompileError(f"interpreter: not a statement: {s!r}")


def interpret(kernel: L.Kernel, arrays, lo=None, hi=None) -> None:
    """Run ``kernel`` on ``arrays`` (one flat numpy array per Param) in Python.

    Same contract as a compiled kernel: outputs are written into ``arrays``; ``[lo, hi)``
    restricts the parallel loop (defaults: the whole extent).  Raises CompileError for a
    malformed kernel and InputError for mismatched arrays or out-of-bounds stores.
    """
    L.verify_kernel(kernel)
    if len(arrays) != len(kernel.params):
        raise InputError(f"kernel {kernel.name!r} takes {len(kernel.params)} arrays, "
                         f"got {len(arrays)}")
    for p, a in zip(kernel.params, arrays):
        if a.dtype != np.dtype(p.dtype if p.dtype != "bool" else np.bool_) or a.size < p.size:
            raise InputError(f"kernel {kernel.name!r}: buffer {p.name!r} needs {p.size} "
                             f"elements of {p.dtype}, got {a.size} of {a.dtype}")
    lo = 0 if lo is None else int(lo)
    hi = (kernel.parallel_extent or 0) if hi is None else int(hi)
    it = _Interp(kernel, arrays, lo, hi)
    from apollo_py.codegen.printer import Printer
    it.par = Printer.find_parallel_loop(Printer(), kernel)
    env = {"@buf:" + p.name: a.reshape(-1) for p, a in zip(kernel.params, arrays)}
    env[_DECL] = set()
    with np.errstate(all="ignore"):
        it.stmt(kernel.body, env)
