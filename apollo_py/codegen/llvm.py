"""LLVM renderer and JIT (llvmlite, MCJIT) for the loop IR.

Kernel ABI: ``void name(i8** args, i64 lo, i64 hi)``.  The exported function loads the
buffer pointers and calls ``name.impl``, whose pointer parameters are ``noalias``; the impl
is ``noinline`` so the vectoriser always sees ``noalias`` arguments.  Buffers passed to one
kernel must therefore not overlap unless none of them is written.

Choices that matter for speed (DESIGN.md section 8, measured):

* index arithmetic (load/store indices, loop bounds) uses ``add/sub/mul nsw``; integer
  arithmetic on *data* wraps like numpy.
* float ops carry ``nsz arcp contract`` -- sign of zero, reciprocal and FMA contraction may
  change the last bits.  ``afn`` is not set, and rsqrt's divide has no ``arcp`` (with both,
  1/sqrt(x) compiled to the rsqrt estimate, which gave nan at 0 and inf in the tests).
  ``nnan``/``ninf`` are never set because kernels must propagate inf/nan like numpy, and
  ``reassoc`` is never set: reductions are written with explicit lane accumulators
  (templates.py), so their order is fixed by the IR.
* ``vector`` loops carry ``llvm.loop.vectorize.enable`` and ``llvm.loop.unroll.disable``
  (see :meth:`LLVMPrinter.loop_metadata`); ``unroll`` loops ``llvm.loop.unroll.full``.
* float32 exp/log/tanh/erf/sigmoid/pow are polynomial helpers (llvm_math.py) that inline and
  vectorise; float64 uses LLVM intrinsics / libm (correct first, scalar).
* O3 through the new pass manager with loop and SLP vectorisation, target machine for the
  host CPU and features, ``prefer-vector-width=512`` when AVX-512 is present (measured on
  the Rocket Lake dev box, one thread: softmax [32768,128] 2.5 ms vs 4.4 ms with LLVM's
  default 256-bit preference; bias+GELU [1024,3072] 2.3 ms vs 7.3 ms).
* large outputs written in whole aligned vectors get a second impl ``name.impl.nt`` with
  streaming stores, chosen by the wrapper when the output pointers are 64-byte aligned
  (nontemporal.py: a memory-bound 48 MiB output 0.71x the time at 2 threads).

llvmlite is imported lazily so that importing apollo_py stays fast.
"""
from __future__ import annotations

from contextlib import contextmanager


import threading

from apollo_py.codegen import llvm_math
from apollo_py.codegen import loopir as L
from apollo_py.codegen import nontemporal
from apollo_py.codegen.compiled import CompiledKernelBase
from apollo_py.codegen.printer import Printer, expand_pow
from apollo_py.errors import CompileError

FM = "nsz arcp contract"
FM_EXACT = "nsz contract"  # no arcp: keeps 1/sqrt(x) exact at 0 and inf (no rsqrt estimate)

_LLVM_TYPES = {"float32": "float", "float64": "double", "float16": "half", "int8": "i8", "int16": "i16",
               "int32": "i32", "int64": "i64", "uint8": "i8", "uint16": "i16", "uint32": "i32",
               "uint64": "i64", "bool": "i1"}
_MEM_TYPES = dict(_LLVM_TYPES, bool="i8")
_SIZES = {"float32": 4, "float64": 8, "float16": 2, "int8": 1, "int16": 2, "int32": 4, "int64": 8,
          "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1}
_FSUFFIX = {"float32": "f32", "float64": "f64"}


def _intrinsic(name: str, nargs: int = 1):
    """Template calling ``llvm.<name>.<type suffix>`` with ``nargs`` operands."""
    def tpl(p: "LLVMPrinter", dtype: str, *ops) -> str:
        t = p.type_name(dtype)
        suffix = _FSUFFIX.get(dtype, t)
        p.declare(f"declare {t} @llvm.{name}.{suffix}({', '.join([t] * nargs)})")
        args = ", ".join(f"{t} {o}" for o in ops)
        return f"call {FM if L.is_float(dtype) else ''} {t} @llvm.{name}.{suffix}({args})"
    return tpl


def _int_intrinsic(name: str, extra: str = ""):
    def tpl(p: "LLVMPrinter", dtype: str, *ops) -> str:
        t = p.type_name(dtype)
        decl_extra = ", i1" if extra else ""
        p.declare(f"declare {t} @llvm.{name}.{t}({', '.join([t] * len(ops))}{decl_extra})")
        args = ", ".join(f"{t} {o}" for o in ops)
        return f"call {t} @llvm.{name}.{t}({args}{extra})"
    return tpl


def _math(name32: str, name64: str, libm: bool = False):
    """float32: the polynomial helper ``@ap.<name32>``; float64: intrinsic or libm call."""
    def tpl(p: "LLVMPrinter", dtype: str, *ops) -> str:
        if dtype == "float32":
            p.helpers.add(name32)
            args = ", ".join(f"float {o}" for o in ops)
            return f"call float @ap.{name32}({args})"
        if libm:
            p.declare(f"declare double @{name64}({', '.join(['double'] * len(ops))})")
            return f"call double @{name64}({', '.join(f'double {o}' for o in ops)})"
        return _intrinsic(name64, len(ops))(p, dtype, *ops)
    return tpl


def _sigmoid64(p: "LLVMPrinter", dtype: str, a: str) -> str:
    n = p.emit(f"fneg {FM} double {a}")
    e = p.emit(_intrinsic("exp")(p, dtype, n))
    d = p.emit(f"fadd {FM} double {e}, 1.0")
    return f"fdiv {FM} double 1.0, {d}"


def _float_floordiv(p: "LLVMPrinter", dtype: str, a: str, b: str) -> str:
    q = p.emit(f"fdiv {FM} {p.type_name(dtype)} {a}, {b}")
    return _intrinsic("floor")(p, dtype, q)


def _float_mod(p: "LLVMPrinter", dtype: str, a: str, b: str) -> str:
    t = p.type_name(dtype)
    f = p.emit(_float_floordiv(p, dtype, a, b))
    m = p.emit(f"fmul {FM} {t} {f}, {b}")
    return f"fsub {FM} {t} {a}, {m}"


def _unsigned_ops() -> tuple[dict, dict]:
    """Binary and unary templates for the unsigned dtypes (keyed by dtype, so they win over
    the signed ``"int"`` entries): unsigned division, remainder, min/max and compares; abs and
    relu are the identity."""
    binary, unary = {}, {}
    for d in L.UINT_DTYPES:
        binary.update({("floordiv", d): "udiv {t} {a}, {b}", ("mod", d): "urem {t} {a}, {b}",
                       ("max", d): _int_intrinsic("umax"), ("min", d): _int_intrinsic("umin"),
                       ("lt", d): "icmp ult {t} {a}, {b}", ("le", d): "icmp ule {t} {a}, {b}",
                       ("gt", d): "icmp ugt {t} {a}, {b}", ("ge", d): "icmp uge {t} {a}, {b}"})
        unary.update({("abs", d): "or {t} {a}, 0", ("relu", d): "or {t} {a}, 0"})
    return binary, unary


def _relu(p: "LLVMPrinter", dtype: str, a: str) -> str:
    t = p.type_name(dtype)
    if L.is_float(dtype):
        c = p.emit(f"fcmp olt {t} {a}, 0.0")
        return f"select i1 {c}, {t} 0.0, {t} {a}"
    c = p.emit(f"icmp slt {t} {a}, 0")
    return f"select i1 {c}, {t} 0, {t} {a}"


def _rsqrt(p: "LLVMPrinter", dtype: str, a: str) -> str:
    s = p.emit(_intrinsic("sqrt")(p, dtype, a))
    return f"fdiv {FM_EXACT} {p.type_name(dtype)} 1.0, {s}"


def _pow(p: "LLVMPrinter", dtype: str, a: str, b: str) -> str:
    return _math("powf", "pow")(p, dtype, a, b)


# ---------------------------------------------------------------------- software prefetch

PREFETCH_AHEAD_BYTES = 4096   # how far ahead of the current row a row loop prefetches
_PREFETCH_ROW_BYTES = (256, 16384)  # row sizes (bytes per iteration) that get prefetches
_PREFETCH_MAX_LINES = 64      # cache lines prefetched per iteration, at most


def prefetch_plan(loop: L.For, params) -> list:
    """Return ``(buf, affine base index, row bytes, distance)`` prefetches for a row loop.

    A loop qualifies when its body holds inner loops and reads a kernel parameter at an
    affine index whose stride in the loop variable is a row of 256 B .. 16 KiB (softmax /
    layernorm style: one row per iteration, several passes over it).  The base is the index
    with the inner loop variables at 0 and the loop variable ``distance`` iterations ahead
    (about PREFETCH_AHEAD_BYTES).  Measured on the 2-core Xeon (AVX-512) box: softmax over
    rows of 128 float32 [768,128,128], 2 threads, 4.4 ms -> 3.5 ms.
    """
    loads = [n for n in L.walk(loop.body) if isinstance(n, L.Load)]
    inner = {n.var.name for n in L.walk(loop.body) if isinstance(n, L.For)}
    if not inner:
        return []
    names = {p.name for p in params}
    var = loop.var.name
    plan, seen, lines = [], set(), 0
    for ld in loads:
        if ld.buf.name not in names:
            continue
        aff = L.affine_form(ld.index)
        if aff is None or aff.get(var, 0) <= 0:
            continue
        row = aff[var] * _SIZES[ld.buf.dtype]
        if not _PREFETCH_ROW_BYTES[0] <= row <= _PREFETCH_ROW_BYTES[1]:
            continue
        base = {k: v for k, v in aff.items() if k not in inner and v != 0}
        key = (ld.buf.name, tuple(sorted(base.items())))
        n = -(-row // 64)
        if key in seen or lines + n > _PREFETCH_MAX_LINES:
            continue
        seen.add(key)
        lines += n
        plan.append((ld.buf, base, row, max(1, -(-PREFETCH_AHEAD_BYTES // row))))
    return plan


class LLVMPrinter(Printer):
    """Renders a Kernel as an LLVM IR module (text)."""

    target = "llvm"
    supports_vector_hint = True

    binary_ops = {
        ("add", "float"): f"fadd {FM} {{t}} {{a}}, {{b}}",
        ("sub", "float"): f"fsub {FM} {{t}} {{a}}, {{b}}",
        ("mul", "float"): f"fmul {FM} {{t}} {{a}}, {{b}}",
        ("div", "float"): f"fdiv {FM} {{t}} {{a}}, {{b}}",
        ("floordiv", "float"): _float_floordiv,
        ("mod", "float"): _float_mod,
        ("max", "float"): _intrinsic("maximum", 2),
        ("min", "float"): _intrinsic("minimum", 2),
        ("pow", "float"): _pow,
        ("lt", "float"): "fcmp olt {t} {a}, {b}",
        ("le", "float"): "fcmp ole {t} {a}, {b}",
        ("gt", "float"): "fcmp ogt {t} {a}, {b}",
        ("ge", "float"): "fcmp oge {t} {a}, {b}",
        ("eq", "float"): "fcmp oeq {t} {a}, {b}",
        ("ne", "float"): "fcmp une {t} {a}, {b}",
        ("add", "int"): "add{nsw} {t} {a}, {b}",
        ("sub", "int"): "sub{nsw} {t} {a}, {b}",
        ("mul", "int"): "mul{nsw} {t} {a}, {b}",
        # floordiv/mod are defined on non-negative integers, where sdiv/srem agree
        ("floordiv", "int"): "sdiv {t} {a}, {b}",
        ("mod", "int"): "srem {t} {a}, {b}",
        ("max", "int"): _int_intrinsic("smax"),
        ("min", "int"): _int_intrinsic("smin"),
        ("lt", "int"): "icmp slt {t} {a}, {b}",
        ("le", "int"): "icmp sle {t} {a}, {b}",
        ("gt", "int"): "icmp sgt {t} {a}, {b}",
        ("ge", "int"): "icmp sge {t} {a}, {b}",
        ("eq", "int"): "icmp eq {t} {a}, {b}",
        ("ne", "int"): "icmp ne {t} {a}, {b}",
        ("and", "int"): "and {t} {a}, {b}",
        ("or", "int"): "or {t} {a}, {b}",
        ("lt", "bool"): "icmp ult i1 {a}, {b}",
        ("le", "bool"): "icmp ule i1 {a}, {b}",
        ("gt", "bool"): "icmp ugt i1 {a}, {b}",
        ("ge", "bool"): "icmp uge i1 {a}, {b}",
        ("eq", "bool"): "icmp eq i1 {a}, {b}",
        ("ne", "bool"): "icmp ne i1 {a}, {b}",
        ("and", "bool"): "and i1 {a}, {b}",
        ("or", "bool"): "or i1 {a}, {b}",
        ("max", "bool"): "or i1 {a}, {b}",
        ("min", "bool"): "and i1 {a}, {b}",
    }
    unary_ops = {
        ("neg", "float"): f"fneg {FM} {{t}} {{a}}",
        ("neg", "int"): "sub {t} 0, {a}",
        ("abs", "float"): _intrinsic("fabs"),
        ("abs", "int"): _int_intrinsic("abs", ", i1 false"),
        ("exp", "float"): _math("expf", "exp"),
        ("log", "float"): _math("logf", "log"),
        ("tanh", "float"): _math("tanhf", "tanh", libm=True),
        ("erf", "float"): _math("erff", "erf", libm=True),
        ("sigmoid", "float32"): _math("sigmoidf", ""),
        ("sigmoid", "float64"): _sigmoid64,
        ("sqrt", "float"): _intrinsic("sqrt"),
        ("rsqrt", "float"): _rsqrt,
        ("reciprocal", "float"): f"fdiv {FM} {{t}} 1.0, {{a}}",
        ("relu", "float"): _relu,
        ("relu", "int"): _relu,
        ("floor", "float"): _intrinsic("floor"),
        ("ceil", "float"): _intrinsic("ceil"),
        ("round_f16", "float32"): lambda p, d, a: f"fpext half {p.emit(f'fptrunc float {a} to half')} to float",
        ("not", "bool"): "xor i1 {a}, true",
        ("not", "int"): "xor {t} {a}, -1",
    }
    binary_ops.update(_unsigned_ops()[0])
    unary_ops.update(_unsigned_ops()[1])

    def __init__(self) -> None:
        super().__init__()
        self.decls: dict = {}
        self.helpers: set = set()
        self.lines: list = []
        self.entry: list = []
        self.metadata: list = []
        self.scope: dict = {}
        self.meta_id = 10  # !0..!9 reserved
        self.f16_exact = False
        self.params: tuple = ()
        self.prefetching = False  # inside a loop that already prefetches its rows

    def type_name(self, dtype: str) -> str:
        return _LLVM_TYPES[dtype]

    def declare(self, line: str) -> None:
        """Record a module-level declaration (deduplicated)."""
        self.decls[line] = None

    def emit(self, instr: str) -> str:
        """Append ``%r = instr`` to the current block and return ``%r``."""
        if self.f16_exact:
            instr = instr.replace(f" {FM} ", " nsz ").replace(f" {FM_EXACT} ", " nsz ")
        reg = "%" + self.fresh("r")
        self.lines.append(f"  {reg} = {instr}")
        return reg

    def label(self, name: str) -> None:
        self.lines.append(f"{name}:")

    def br(self, text: str) -> None:
        self.lines.append(f"  br {text}")

    # ------------------------------------------------------------------ expressions
    def const(self, value, dtype: str) -> str:
        if dtype == "bool":
            return "true" if value else "false"
        if L.is_int(dtype):
            return str(int(value))
        if dtype == "float64":
            return llvm_math.dconst(value)
        return llvm_math.fconst(value)

    def expr_Const(self, e: L.Const, index: bool) -> str:
        return self.const(e.value, e.dtype)

    def expr_Var(self, e: L.Var, index: bool) -> str:
        slot, dtype = self.lookup_var(e.name)
        return self.emit(f"load {self.type_name(dtype)}, ptr {slot}")

    def lookup_var(self, name: str):
        if name not in self.scope:
            raise CompileError(f"llvm renderer: variable {name!r} is not in scope")
        return self.scope[name]

    def expr_Bin(self, e: L.Bin, index: bool) -> str:
        if e.op == "pow":
            fast = expand_pow(e.a, e.b)
            if fast is not None:
                return self.expr(fast, index)
        a, b = self.expr(e.a, index), self.expr(e.b, index)
        tpl = self.lookup(self.binary_ops, e.op, e.a.dtype)
        return self.emit(self.apply(tpl, e.a.dtype, a, b, nsw=" nsw" if index else ""))

    def expr_Un(self, e: L.Un, index: bool) -> str:
        a = self.expr(e.a, index)
        if e.op == "exp" and e.upper is not None and e.upper <= 0.0 and e.a.dtype == "float32":
            self.helpers.add("expf_nonpos")   # range fact (poly/range_facts.py): no upper clamp
            return self.emit(f"call float @ap.expf_nonpos(float {a})")
        if e.op == "log" and e.a.dtype == "float32" and e.lower is not None and e.lower >= 1e-37 \
                and e.upper is not None and e.upper <= 1e37:
            self.helpers.add("logf_normal")   # range fact: a positive normal argument (or NaN)
            return self.emit(f"call float @ap.logf_normal(float {a})")
        return self.emit(self.apply(self.lookup(self.unary_ops, e.op, e.a.dtype), e.a.dtype, a))

    def expr_Select(self, e: L.Select, index: bool) -> str:
        c, a, b = self.expr(e.cond, index), self.expr(e.a, index), self.expr(e.b, index)
        t = self.type_name(e.dtype)
        return self.emit(f"select i1 {c}, {t} {a}, {t} {b}")

    def expr_Cast(self, e: L.Cast, index: bool) -> str:
        src, dst = e.a.dtype, e.dtype
        a = self.expr(e.a, index)
        if src == dst:
            return a
        ts, td = self.type_name(src), self.type_name(dst)
        if dst == "bool":
            if L.is_float(src):
                return self.emit(f"fcmp une {ts} {a}, 0.0")
            return self.emit(f"icmp ne {ts} {a}, 0")
        if L.is_float(src) and L.is_float(dst):
            op = "fpext" if _SIZES[dst] > _SIZES[src] else "fptrunc"
        elif L.is_float(src):
            op = "fptoui" if L.is_unsigned(dst) else "fptosi"
        elif L.is_float(dst):
            op = "uitofp" if src == "bool" or L.is_unsigned(src) else "sitofp"
        elif src == "bool":
            op = "zext"
        elif _SIZES[dst] == _SIZES[src]:
            return a          # int32 <-> uint32 etc.: same bits
        elif _SIZES[dst] > _SIZES[src]:
            op = "zext" if L.is_unsigned(src) else "sext"
        else:
            op = "trunc"
        return self.emit(f"{op} {ts} {a} to {td}")

    def address(self, buf, index: L.Expr) -> str:
        slot = self.lookup_var("@buf:" + buf.name)[0]
        idx = self.expr(index, True)
        if index.dtype != "int64":
            ext = "zext" if L.is_unsigned(index.dtype) else "sext"
            idx = self.emit(f"{ext} {self.type_name(index.dtype)} {idx} to i64")
        return self.emit(f"getelementptr inbounds {_MEM_TYPES[buf.dtype]}, ptr {slot}, i64 {idx}")

    def expr_Load(self, e: L.Load, index: bool) -> str:
        ptr = self.address(e.buf, e.index)
        mt = _MEM_TYPES[e.buf.dtype]
        v = self.emit(f"load {mt}, ptr {ptr}, align {_SIZES[e.buf.dtype]}")
        if e.buf.dtype == "bool":
            return self.emit(f"icmp ne i8 {v}, 0")
        if e.buf.dtype == "float16":
            return self.emit(f"fpext half {v} to float")
        return v

    # ------------------------------------------------------------------ statements
    def stmt_Block(self, s: L.Block) -> None:
        saved = dict(self.scope)
        for x in s.stmts:
            self.stmt(x)
        self.scope = saved

    def new_slot(self, name: str, dtype: str) -> str:
        slot = "%" + self.fresh("v." + name + ".")
        self.entry.append(f"  {slot} = alloca {self.type_name(dtype)}")
        self.scope[name] = (slot, dtype)
        return slot

    def stmt_Local(self, s: L.Local) -> None:
        v = self.expr(s.init)
        slot = self.new_slot(s.name, s.dtype)
        self.lines.append(f"  store {self.type_name(s.dtype)} {v}, ptr {slot}")

    def stmt_Assign(self, s: L.Assign) -> None:
        v = self.expr(s.value)
        slot, dtype = self.lookup_var(s.name)
        self.lines.append(f"  store {self.type_name(dtype)} {v}, ptr {slot}")

    def stmt_Alloc(self, s: L.Alloc) -> None:
        slot = "%" + self.fresh("a." + s.name + ".")
        self.entry.append(f"  {slot} = alloca {_MEM_TYPES[s.dtype]}, i64 {int(s.size)}, align 64")
        self.scope["@buf:" + s.name] = (slot, s.dtype)

    def stmt_Store(self, s: L.Store) -> None:
        v = self.expr(s.value)
        if s.buf.dtype == "bool":
            v = self.emit(f"zext i1 {v} to i8")
        elif s.buf.dtype == "float16":
            v = self.emit(f"fptrunc float {v} to half")
        ptr = self.address(s.buf, s.index)
        self.lines.append(f"  store {_MEM_TYPES[s.buf.dtype]} {v}, ptr {ptr}, "
                          f"align {_SIZES[s.buf.dtype]}")

    def stmt_If(self, s: L.If) -> None:
        c = self.expr(s.cond)
        n = self.fresh("if")
        has_else = s.else_ is not None
        self.br(f"i1 {c}, label %{n}.then, label %{n}.{'else' if has_else else 'end'}")
        self.label(f"{n}.then")
        self.stmt(s.then)
        self.br(f"label %{n}.end")
        if has_else:
            self.label(f"{n}.else")
            self.stmt(s.else_)
            self.br(f"label %{n}.end")
        self.label(f"{n}.end")

    def loop_metadata(self, kind: str, trip: int = 0) -> str:
        """Return the ``!llvm.loop`` suffix of a latch branch for a loop of ``kind``.

        vector loops are kept from being fully unrolled before the loop vectoriser runs:
        otherwise a 16-lane accumulator loop was unrolled first and the SLP vectoriser turned
        each lane's chain into gathers (softmax [98304,128] 9.2 ms -> 7.1 ms without them).
        A vector loop of a constant ``trip`` count in 32..128, a multiple of 16, is interleaved
        ``trip / 16`` times instead: with 16 lanes it runs as straight-line vector code (a row
        loop such as softmax's 128-wide normalisation: 8 iterations of load, op, store, counter,
        compare and branch before, and the row's temporaries now stay in registers; A/B on the
        2-core box, softmax and logsoftmax [768,128,128]: 0.89-0.90x the time).
        """
        if kind == "vector":
            props = ['!{!"llvm.loop.vectorize.enable", i1 true}', '!{!"llvm.loop.unroll.disable"}']
            if 32 <= trip <= 128 and trip % 16 == 0:
                props.append(f'!{{!"llvm.loop.interleave.count", i32 {trip // 16}}}')
        elif kind == "unroll":
            props = ['!{!"llvm.loop.unroll.full"}']
        else:
            return ""
        mid = self.meta_id
        ids = [mid + 1 + k for k in range(len(props))]
        self.meta_id += 1 + len(props)
        self.metadata.append(f"!{mid} = distinct !{{!{mid}, {', '.join(f'!{i}' for i in ids)}}}")
        self.metadata += [f"!{i} = {prop}" for i, prop in zip(ids, props)]
        return f", !llvm.loop !{mid}"

    def stmt_For(self, s: L.For) -> None:
        t = self.type_name(s.var.dtype)
        lo, hi = self.expr(s.lo, True), self.expr(s.hi, True)
        if s is self.parallel_loop:
            self.declare(f"declare {t} @llvm.smax.{t}({t}, {t})")
            self.declare(f"declare {t} @llvm.smin.{t}({t}, {t})")
            lo = self.emit(f"call {t} @llvm.smax.{t}({t} {lo}, {t} %lo)")
            hi = self.emit(f"call {t} @llvm.smin.{t}({t} {hi}, {t} %hi)")
        saved = dict(self.scope)
        slot = self.new_slot(s.var.name, s.var.dtype)
        n = self.fresh("for")
        self.lines.append(f"  store {t} {lo}, ptr {slot}")
        self.br(f"label %{n}.cond")
        self.label(f"{n}.cond")
        iv = self.emit(f"load {t}, ptr {slot}")
        c = self.emit(f"icmp slt {t} {iv}, {hi}")
        self.br(f"i1 {c}, label %{n}.body, label %{n}.end")
        self.label(f"{n}.body")
        outer = self.prefetching
        if not outer and s.kind not in ("vector", "unroll"):
            plan = [p for p in prefetch_plan(s, self.params) if all(k == "" or k in self.scope for k in p[1])]
            for buf, base, row, dist in plan:
                self.emit_prefetch(buf, base, row, dist, s.var.name)
            self.prefetching = bool(plan)
        self.stmt(s.body)
        self.prefetching = outer
        iv2 = self.emit(f"load {t}, ptr {slot}")
        nxt = self.emit(f"add nsw {t} {iv2}, 1")
        self.lines.append(f"  store {t} {nxt}, ptr {slot}")
        trip = s.hi.value - s.lo.value if isinstance(s.lo, L.Const) and isinstance(s.hi, L.Const) else 0
        self.lines.append(f"  br label %{n}.cond{self.loop_metadata(s.kind, trip)}")
        self.label(f"{n}.end")
        self.scope = saved

    def emit_prefetch(self, buf, base: dict, row: int, dist: int, var: str) -> None:
        """Prefetch (read, to L1) the ``row`` bytes at ``buf[base]`` ``dist`` iterations of
        ``var`` ahead; addresses past the buffer are harmless (a prefetch never faults),
        hence the gep without ``inbounds``."""
        self.declare("declare void @llvm.prefetch.p0(ptr nocapture readonly, i32 immarg, i32 immarg, i32 immarg)")
        const = base.get("", 0) + dist * base[var]
        idx = str(const)
        for name, coef in base.items():
            if name == "":
                continue
            v = self.emit(f"load i64, ptr {self.lookup_var(name)[0]}")
            v = self.emit(f"mul i64 {v}, {coef}")
            idx = self.emit(f"add i64 {idx}, {v}")
        off = self.emit(f"mul i64 {idx}, {_SIZES[buf.dtype]}")
        ptr = self.emit(f"getelementptr i8, ptr {self.lookup_var('@buf:' + buf.name)[0]}, i64 {off}")
        for j in range(0, row, 64):
            q = ptr if j == 0 else self.emit(f"getelementptr i8, ptr {ptr}, i64 {j}")
            self.lines.append(f"  call void @llvm.prefetch.p0(ptr {q}, i32 0, i32 3, i32 1)")

    # ------------------------------------------------------------------ kernel
    def render(self, k: L.Kernel, cpu_attrs: str = "") -> str:
        """Return the LLVM IR module text for kernel ``k``.

        ``cpu_attrs`` is extra function-attribute text (e.g. target-cpu) for the impl.
        """
        self.check_kernel(k)
        if k.vector_width:      # a per-kernel width (a tuning decision) replaces the host's
            cpu_attrs = with_vector_width(cpu_attrs, k.vector_width)
        # A kernel touching float16 buffers gets no arcp/contract: InstCombine shrinks
        # fptrunc(op(fpext a, fpext b)) to a half op, and with them a half fdiv became a
        # multiply by a half-rounded reciprocal and a half mul+add one fma -- one float16 ulp
        # off numpy, which rounds each float16 op once (measured on the fp16 attention cases).
        self.f16_exact = "float16[" in L.format_node(k)
        self.parallel_loop = self.find_parallel_loop(k)
        self.params = tuple(k.params)
        for p in k.params:
            self.scope["@buf:" + p.name] = ("%p." + p.name, p.dtype)
        # large outputs: a second impl with streaming stores (nontemporal.py), x86 only
        streamed = nontemporal.nontemporal_params(k) if "+sse2" in cpu_attrs else ()
        sep = ", " if k.params else ""
        impl = []
        for suffix, nt in ((".impl", ()), (".impl.nt", streamed))[:2 if streamed else 1]:
            self.entry, self.lines = [], []
            self.stmt(k.body)
            params = nontemporal.impl_header_params(k.params, nt)
            fence = ["  call void @llvm.x86.sse.sfence()"] if nt else []
            impl += [f"define internal void @{k.name}{suffix}({params}{sep}i64 %lo, i64 %hi) #0 {{",
                     "entry:", *self.entry, "  br label %body", "body:", *self.lines,
                     *fence, "  ret void", "}"]
        if streamed:
            self.declare("declare void @llvm.x86.sse.sfence()")
        wrapper = [f"define void @{k.name}(ptr %args, i64 %lo, i64 %hi) #2 {{", "entry:"]
        call_args = []
        for i, p in enumerate(k.params):
            wrapper.append(f"  %g{i} = getelementptr ptr, ptr %args, i64 {i}")
            wrapper.append(f"  %a{i} = load ptr, ptr %g{i}")
            call_args.append(f"ptr %a{i}")
        call_args += ["i64 %lo", "i64 %hi"]
        if streamed:
            wrapper += [*nontemporal.wrapper_dispatch(k.name, k.params, streamed, ", ".join(call_args)), "}"]
        else:
            wrapper += [f"  call void @{k.name}.impl({', '.join(call_args)})", "  ret void", "}"]
        if self.helpers:
            for decl in llvm_math.INTRINSIC_DECLS:
                self.declare(decl)
        attrs = [f"attributes #0 = {{ noinline nounwind {cpu_attrs} }}",
                 f"attributes #1 = {{ alwaysinline nounwind memory(none) {cpu_attrs} }}",
                 f"attributes #2 = {{ nounwind {cpu_attrs} }}"]
        # param dtypes in the text: int8 and uint8 kernels may render alike but must not share a
        # loaded kernel (its argument checks are per dtype); the cache key hashes this text
        parts = [f"; kernel {k.name}", f"; param dtypes {' '.join(p.dtype for p in k.params)}",
                 *([nontemporal.marker(k.name, streamed)] if streamed else []),
                 *self.decls.keys(),
                 llvm_math.render_helpers(self.helpers, scalef="+avx512f" in cpu_attrs),
                 "\n".join(impl), "\n".join(wrapper), *attrs, *self.metadata]
        return "\n".join(parts) + "\n"


def with_vector_width(cpu_attrs: str, bits: int) -> str:
    """``cpu_attrs`` with ``"prefer-vector-width"`` set to ``bits`` (LLVM's vectorisers then
    use at most that width; the text, and so the piece's cache key, changes with it)."""
    import re
    kept = re.sub(r'\s*"prefer-vector-width"="\d+"', "", cpu_attrs)
    return f'{kept} "prefer-vector-width"="{int(bits)}"'.strip()


def render_llvm(k: L.Kernel, cpu_attrs: str = "") -> str:
    """Return the (unoptimised) LLVM IR text of kernel ``k``."""
    return LLVMPrinter().render(k, cpu_attrs)


# ---------------------------------------------------------------------- JIT

_init_lock = threading.Lock()
_compile_lock = threading.Lock()
_host = None


class _Host:
    """Process-wide llvmlite state: target, CPU name and features (created once)."""

    def __init__(self):
        import llvmlite.binding as llvm
        llvm.initialize_native_target()
        llvm.initialize_native_asmprinter()
        self.llvm = llvm
        self.triple = llvm.get_process_triple()
        self.cpu = llvm.get_host_cpu_name()
        self.features = llvm.get_host_cpu_features().flatten()
        self.target = llvm.Target.from_triple(self.triple)
        self.opt_tm = self.target_machine()
        attrs = f'"target-cpu"="{self.cpu}" "target-features"="{self.features}"'
        if "+avx512f" in self.features.split(","):
            attrs += ' "prefer-vector-width"="512"'
        self.cpu_attrs = attrs

    def target_machine(self):
        return self.target.create_target_machine(cpu=self.cpu, features=self.features,
                                                 opt=3, reloc="default", codemodel="jitdefault")


def host():
    """Return the process-wide :class:`_Host` (thread-safe lazy initialisation)."""
    global _host
    if _host is None:
        with _init_lock:
            if _host is None:
                _host = _Host()
    return _host


class CompiledKernel(CompiledKernelBase):
    """A JIT-compiled kernel; keeps its MCJIT engine alive while the object lives.

    ``ir`` is the optimised LLVM IR text; ``asm`` renders assembly on first access.
    """

    def __init__(self, kernel: L.Kernel, engine, ir_text: str):
        self.engine = engine  # owns the machine code: must outlive every call
        self.ir = ir_text
        self._asm = None
        super().__init__(kernel, engine.get_function_address(kernel.name))

    @property
    def asm(self) -> str:
        """Assembly text of the optimised module (computed lazily)."""
        if self._asm is None:
            h = host()
            with _compile_lock:
                mod = h.llvm.parse_assembly(self.ir)
                self._asm = h.target_machine().emit_assembly(mod)
        return self._asm


def optimize_ir(text: str):
    """Parse LLVM IR ``text``, run O3 (loop + SLP vectorisation) and return the module.

    Must be called with ``_compile_lock`` held.  Raises CompileError if the text is invalid.
    """
    h = host()
    llvm = h.llvm
    try:
        mod = llvm.parse_assembly(text)
        mod.verify()
    except RuntimeError as exc:
        raise CompileError(f"invalid LLVM IR: {exc}") from exc
    run_o3(mod)
    return nontemporal.apply_after_o3(text, mod, llvm)


def run_o3(mod) -> None:
    """Run LLVM's O3 pipeline with loop and SLP vectorisation on module ``mod`` in place
    (caller holds ``_compile_lock``); remarks are dropped (:func:`_quiet_remarks`)."""
    h = host()
    pto = h.llvm.create_pipeline_tuning_options(speed_level=3)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pb = h.llvm.create_pass_builder(h.opt_tm, pto)
    with _quiet_remarks():
        pb.getModulePassManager().run(mod, pb)


@contextmanager
def _quiet_remarks():
    """Drop LLVM's ``remark:`` lines (e.g. a forced loop it chose not to vectorise), which it
    prints straight to file descriptor 2; any other diagnostic is passed on to stderr."""
    import os
    import sys
    import tempfile
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):   # stderr replaced by a non-file object
        yield
        return
    sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            kept = [ln for ln in tmp.read().decode(errors="replace").splitlines(True)
                    if not ln.startswith("remark:")]
            if kept:
                sys.stderr.write("".join(kept))


def compile_llvm(k: L.Kernel) -> CompiledKernel:
    """Render, optimise and JIT kernel ``k``; return a callable :class:`CompiledKernel`."""
    h = host()
    text = LLVMPrinter().render(k, h.cpu_attrs)
    with _compile_lock:
        mod = optimize_ir(text)
        mod.triple = h.triple
        ir_text = str(mod)
        engine = h.llvm.create_mcjit_compiler(mod, h.target_machine())
        engine.finalize_object()
    return CompiledKernel(k, engine, ir_text)


def emit_object(k: L.Kernel) -> bytes:
    """Render and optimise kernel ``k`` and return host object code (for a disk cache).

    The object is only valid on a machine with the same CPU name and features
    (:func:`host_signature`), which a cache key must therefore include.
    """
    h = host()
    text = LLVMPrinter().render(k, h.cpu_attrs)
    with _compile_lock:
        mod = optimize_ir(text)
        mod.triple = h.triple
        return h.target_machine().emit_object(mod)


def load_object(k: L.Kernel, data: bytes) -> CompiledKernel:
    """Load object code from :func:`emit_object` for kernel ``k`` without recompiling.

    Returns a CompiledKernel whose ``ir`` is empty; raises CompileError if the object does
    not define ``k.name``.
    """
    h = host()
    with _compile_lock:
        empty = h.llvm.parse_assembly("")
        empty.triple = h.triple
        engine = h.llvm.create_mcjit_compiler(empty, h.target_machine())
        engine.add_object_file(h.llvm.ObjectFileRef.from_data(data))
        engine.finalize_object()
    return CompiledKernel(k, engine, "")


def host_signature() -> str:
    """Return ``triple/cpu/features`` of this process's code generation target."""
    h = host()
    return f"{h.triple}/{h.cpu}/{h.features}"
