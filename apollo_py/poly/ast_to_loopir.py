"""isl AST -> apollo_py loop IR, with the statement bodies filled in from the primitives.

:func:`to_loop_ir` generates the AST of a fused schedule (``isl.AstBuild.from_context``) and
walks it: isl ``for`` / ``if`` / ``block`` / ``user`` nodes become ``For`` / ``If`` / ``Block`` /
the statement's body.  A statement body loads its operands through the op's access relations
(affine in the statement's domain dims, which the AST's call arguments express in loop
iterators), computes the op's ``scalar`` operation (or folds with its ``reducer``) and stores
into the output's storage: a kernel buffer (``Param``), a scalar (``Local``) or a tile
(``Alloc``, indexed ``idx mod extent``) — see :mod:`apollo_py.poly.storage`.  Locals and
tiles are declared at the top of the kernel, so each call (one chunk of the parallel loop)
has its own.  The outermost loop of the shared band is ``parallel`` and becomes the kernel's
``parallel_var``.
"""
from __future__ import annotations

import math
import re
from typing import Mapping

import islpy as isl
import numpy as np

from ..codegen import loopir as L
from ..codegen.scalar_ops import scalar_op
from .column_lanes import rewrite_columns
from .range_facts import mark_shifted_exp
from ..errors import CompileError
from .statements import COMPUTE, INIT, UPDATE, PolyProgram, Statement
from .storage import PARAM, SCALAR, TILE, Storage

_OT = isl.ast_expr_op_type


def _ident(name: str, taken: set) -> str:
    base = re.sub(r"\W", "_", name) or "v"
    if base[0].isdigit():
        base = "v_" + base
    out, k = base, 1
    while out in taken:
        out = f"{base}_{k}"
        k += 1
    taken.add(out)
    return out


def identity_value(reducer: str, dtype: str):
    """The identity of ``reducer`` ('sum', 'prod', 'max', 'min') for ``dtype``."""
    if reducer == "sum":
        return 0
    if reducer == "prod":
        return 1
    if dtype in ("float32", "float64", "float16"):
        return -math.inf if reducer == "max" else math.inf
    if dtype == "bool":
        return reducer == "min"
    info = np.iinfo(np.dtype(dtype))
    return int(info.min) if reducer == "max" else int(info.max)


_REDUCE_OP = {"sum": "add", "prod": "mul", "max": "max", "min": "min"}


def _floordiv(a: L.Expr, b: L.Expr) -> L.Expr:
    """floor(a / b) for b > 0 (loop IR floordiv is defined on non-negative operands)."""
    if isinstance(a, L.Const) and isinstance(b, L.Const):
        return L.Const(a.value // b.value, "int64")
    neg = (a - (b - 1)) // b
    return L.Select(L.lt(a, 0), neg, a // b)


def _mod(a: L.Expr, b: L.Expr) -> L.Expr:
    return a - _floordiv(a, b) * b


def _simplify_add(a: L.Expr, b: L.Expr) -> L.Expr:
    if isinstance(a, L.Const) and a.value == 0:
        return b
    if isinstance(b, L.Const) and b.value == 0:
        return a
    if isinstance(a, L.Const) and isinstance(b, L.Const):
        return L.Const(a.value + b.value, "int64")
    return a + b


def _simplify_mul(c: int, e: L.Expr) -> L.Expr:
    if c == 0:
        return L.Const(0, "int64")
    if c == 1:
        return e
    if isinstance(e, L.Const):
        return L.Const(c * e.value, "int64")
    return e * c


class Emitter:
    """Converts one isl AST to loop IR for one program and storage plan."""

    def __init__(self, prog: PolyProgram, storage: Mapping[str, Storage], consts=None,
                 param_order=None):
        self.prog = prog
        self.storage = storage
        self.consts = dict(consts or {})
        taken: set = set()
        self.params: dict[str, L.Param] = {}
        order = list(param_order) if param_order is not None else \
            [v for v in list(prog.inputs) + list(prog.outputs)]
        for v in order:
            if v in self.consts or v in self.params:
                continue
            t = prog.types[v]
            self.params[v] = L.Param(_ident(v, taken), t.dtype, max(1, t.size))
        self.locals_: dict[str, L.Local] = {}
        self.tiles: dict[str, L.Alloc] = {}
        for v, st in storage.items():
            t = prog.types[v]
            if st.kind == SCALAR:
                dt = L.compute_dtype(t.dtype)
                self.locals_[v] = L.Local(_ident("s_" + v, taken), dt, L.as_expr(0, dt))
            elif st.kind == TILE:
                self.tiles[v] = L.Alloc(_ident("t_" + v, taken), t.dtype, st.size)
        self.iters: set[str] = set()
        self._acc: dict = {}
        self.stmts = {s.name: s for s in prog.statements}

    # ----------------------------------------------------------------- expressions
    def expr(self, e: isl.AstExpr) -> L.Expr:
        t = e.get_type()
        if t == isl.ast_expr_type.int:
            return L.Const(int(e.get_val().to_python()), "int64")
        if t == isl.ast_expr_type.id:
            name = e.get_id().get_name()
            if name in self.iters:
                return L.Var(name, "int64")
            if name in self.prog.params:
                return L.Const(self.prog.params[name], "int64")
            raise CompileError(f"isl AST refers to unknown identifier {name!r}")
        op = e.get_op_type()
        args = [self.expr(e.get_op_arg(k)) for k in range(e.get_op_n_arg())]
        if op == _OT.add:
            return _simplify_add(args[0], args[1])
        if op == _OT.sub:
            return args[0] - args[1]
        if op == _OT.mul:
            if isinstance(args[0], L.Const):
                return _simplify_mul(args[0].value, args[1])
            return args[0] * args[1]
        if op == _OT.minus:
            return -args[0]
        if op in (_OT.div, _OT.pdiv_q):
            return args[0] // args[1]
        if op == _OT.fdiv_q:
            return _floordiv(args[0], args[1])
        if op in (_OT.pdiv_r, _OT.zdiv_r):
            return _mod(args[0], args[1])
        if op == _OT.max:
            out = args[0]
            for a in args[1:]:
                out = L.maximum(out, a)
            return out
        if op == _OT.min:
            out = args[0]
            for a in args[1:]:
                out = L.minimum(out, a)
            return out
        if op in (_OT.and_, _OT.and_then):
            return L.land(args[0], args[1])
        if op in (_OT.or_, _OT.or_else):
            return L.lor(args[0], args[1])
        if op in (_OT.cond, _OT.select):
            return L.Select(args[0], args[1], args[2])
        cmp = {_OT.eq: L.eq, _OT.le: L.le, _OT.lt: L.lt, _OT.ge: L.ge, _OT.gt: L.gt}
        if op in cmp:
            return cmp[op](args[0], args[1])
        raise CompileError(f"isl AST expression {e.to_C_str()!r} is not supported")

    # ----------------------------------------------------------------- accesses
    def _index(self, s: Statement, m: isl.Map, dom: list) -> list:
        key = (s.name, str(m))
        ma = self._acc.get(key)
        if ma is None:
            g = m.intersect_params(self.prog.context).gist_domain(m.domain())
            g = g.gist_params(self.prog.context)
            pma = isl.PwMultiAff.from_map(g)
            if pma.n_piece() != 1:
                raise CompileError(f"access {m} of {s.name} is not a single affine function")
            try:
                ma = pma.as_multi_aff()
            except isl.Error:   # one piece on a domain gist keeps (a pad's border slab)
                pieces: list = []
                pma.foreach_piece(lambda _set, piece: pieces.append(piece))
                ma = pieces[0]
            self._acc[key] = ma
        out = []
        for j in range(ma.dim(isl.dim_type.out)):
            out.append(self._aff(ma.get_at(j), dom))
        return out

    def _aff(self, a: isl.Aff, dom: list) -> L.Expr:
        if a.dim(isl.dim_type.div):
            raise CompileError(f"access expression {a} has integer divisions")
        den = int(a.get_denominator_val().to_python())
        e: L.Expr = L.Const(int((a.get_constant_val() * den).to_python()), "int64")
        for k in range(a.dim(isl.dim_type.in_)):
            c = int((a.get_coefficient_val(isl.dim_type.in_, k) * den).to_python())
            if c:
                e = _simplify_add(e, _simplify_mul(c, dom[k]))
        for k in range(a.dim(isl.dim_type.param)):
            c = int((a.get_coefficient_val(isl.dim_type.param, k) * den).to_python())
            if c:
                name = a.get_dim_name(isl.dim_type.param, k)
                e = _simplify_add(e, L.Const(c * self.prog.params[name], "int64"))
        if den != 1:
            e = _floordiv(e, L.Const(den, "int64"))
        return e

    def _flat(self, idx: list, shape) -> L.Expr:
        e: L.Expr = L.Const(0, "int64")
        stride = 1
        for x, d in reversed(list(zip(idx, shape))):
            if d != 1:
                e = _simplify_add(e, _simplify_mul(stride, x))
            stride *= d
        return e

    def _tile_index(self, v: str, idx: list) -> L.Expr:
        st = self.storage[v]
        parts = []
        for x, d, ext in zip(idx, st.shape, st.extents):
            if ext == 1:
                parts.append(L.Const(0, "int64"))
            elif ext >= d:
                parts.append(x)
            else:
                parts.append(x % ext)   # indices are non-negative here
        return self._flat(parts, st.extents)

    def load(self, v: str, idx: list, accumulate: bool = False) -> L.Expr:
        """The value of ``v`` at ``idx``.  A float16 value kept in a register (a SCALAR local
        computes in float32) is rounded to float16 where it is read, as numpy rounds every
        float16 result; ``accumulate`` (a reduction reading its own accumulator) keeps the
        float32 sum, as numpy's float16 add.reduce does (pairwise, in float32)."""
        if v in self.consts:
            return L.Const(self.consts[v], L.compute_dtype(self.prog.types[v].dtype))
        kind = self.storage[v].kind
        if kind == SCALAR:
            if self.prog.types[v].dtype == "float16" and not accumulate:
                return L.Un("round_f16", self.locals_[v].var)
            return self.locals_[v].var
        if kind == TILE:
            return L.Load(self.tiles[v], self._tile_index(v, idx))
        return L.Load(self.params[v], self._flat(idx, self.prog.types[v].shape))

    def store(self, v: str, idx: list, value: L.Expr) -> L.Stmt:
        kind = self.storage[v].kind
        if kind == SCALAR:
            return L.Assign(self.locals_[v].name, value)
        if kind == TILE:
            return L.Store(self.tiles[v], self._tile_index(v, idx), value)
        return L.Store(self.params[v], self._flat(idx, self.prog.types[v].shape), value)

    # ----------------------------------------------------------------- statements
    def body(self, s: Statement, dom: list) -> L.Stmt:
        n = s.node
        out = s.out
        out_idx = self._index(s, s.write, dom)
        odt = L.compute_dtype(self.prog.types[out].dtype)
        if s.role == INIT:
            return self.store(out, out_idx, L.as_expr(identity_value(s.reducer, odt), odt))
        args = [self.load(v, self._index(s, r, dom)) for v, r in zip(n.inputs, s.reads)]
        if s.role == UPDATE:
            acc = self.load(out, out_idx, accumulate=True)
            value = L.Bin(_REDUCE_OP[s.reducer], acc, args[0])
            if self.prog.types[out].dtype == "float16" and s.reducer in ("sum", "prod") and \
                    not _contiguous_reduction(self.prog.types[n.inputs[0]].shape, n.attrs["axes"]):
                value = L.Un("round_f16", value)
            return self.store(out, out_idx, value)
        return self.store(out, out_idx, scalar_op(n, args, dom, odt))

    # ----------------------------------------------------------------- AST walk
    def node(self, nd: isl.AstNode) -> L.Stmt:
        t = nd.get_type()
        if t == isl.ast_node_type.for_:
            it = nd.for_get_iterator().get_id().get_name()
            self.iters.add(it)
            lo = self.expr(nd.for_get_init())
            cond = nd.for_get_cond()
            inc = nd.for_get_inc()
            if inc.get_type() != isl.ast_expr_type.int or inc.get_val().to_python() != 1:
                raise CompileError(f"loop {it} has a non-unit step")
            if cond.get_type() != isl.ast_expr_type.op or cond.get_op_n_arg() != 2 or \
                    cond.get_op_arg(0).get_type() != isl.ast_expr_type.id or \
                    cond.get_op_arg(0).get_id().get_name() != it:
                raise CompileError(f"loop {it} has an unsupported condition {cond.to_C_str()}")
            hi = self.expr(cond.get_op_arg(1))
            if cond.get_op_type() == _OT.le:
                hi = _simplify_add(hi, L.Const(1, "int64"))
            elif cond.get_op_type() != _OT.lt:
                raise CompileError(f"loop {it} has an unsupported condition {cond.to_C_str()}")
            body = self.node(nd.for_get_body())
            return L.For(L.Var(it, "int64"), lo, hi, body, "serial")
        if t == isl.ast_node_type.if_:
            cond = self.expr(nd.if_get_cond())
            then = self.node(nd.if_get_then_node())
            els = self.node(nd.if_get_else_node()) if nd.if_has_else_node() else None
            return L.If(cond, then, els)
        if t == isl.ast_node_type.block:
            lst = nd.block_get_children()
            return L.block(*[self.node(lst.get_at(k)) for k in range(lst.n_ast_node())])
        if t == isl.ast_node_type.mark:
            return self.node(nd.mark_get_node())
        if t == isl.ast_node_type.user:
            e = nd.user_get_expr()
            name = e.get_op_arg(0).get_id().get_name()
            dom = [self.expr(e.get_op_arg(k)) for k in range(1, e.get_op_n_arg())]
            return self.body(self.stmts[name], dom)
        raise CompileError(f"isl AST node type {t} is not supported")


def _contiguous_reduction(shape, axes) -> bool:
    """Whether numpy folds a reduction over ``axes`` of a C-contiguous ``shape`` in one inner
    loop: the reduced axes (size-1 axes aside) are the trailing ones.  numpy's float16 sum and
    prod accumulate such a loop in float32 and round once (a kernel keeps a float32
    accumulator, :func:`_promote_store_reductions`); over any other axes it adds float16
    arrays elementwise, rounding every step (a kernel rounds each update)."""
    big = [k for k, d in enumerate(shape) if d != 1]
    red = [k for k in big if k in set(axes)]
    return red == big[len(big) - len(red):]


def mark_loops(stmt: L.Stmt, parallel: bool):
    """Mark the outermost loop parallel (returns (stmt, var, extent)) and innermost
    assignment-free loops ``vector``."""
    par = {"var": None, "extent": None}

    def inner(s):
        if isinstance(s, L.Block):
            return L.Block(tuple(inner(x) for x in s.stmts))
        if isinstance(s, L.If):
            return L.If(s.cond, inner(s.then), inner(s.else_) if s.else_ is not None else None)
        if isinstance(s, L.For):
            body = inner(s.body)
            kind = s.kind
            if kind == "serial" and not _has(body, L.For) and _per_iteration(body) \
                    and all(_mentions(st.index, s.var.name) for st in _stores(body)):
                kind = "vector"
            return L.For(s.var, s.lo, s.hi, body, kind)
        return s

    out = inner(stmt)
    if parallel:
        top = out
        while isinstance(top, L.Block) and len(top.stmts) == 1:
            top = top.stmts[0]
        if isinstance(top, L.For) and isinstance(top.hi, L.Const) and isinstance(top.lo, L.Const) \
                and top.hi.value - top.lo.value > 1:
            new = L.For(top.var, top.lo, top.hi, top.body, "parallel")
            out = new
            par["var"], par["extent"] = top.var.name, int(top.hi.value)
    return out, par["var"], par["extent"]


_MATH = ("exp", "log", "tanh", "erf", "sigmoid")


def _per_iteration(body) -> bool:
    """Whether every Assign in loop ``body`` (no inner loops) sets a temporary of the current
    iteration: the body is Assigns and Stores only, and no statement reads a local that the body
    assigns before the body has assigned it (that would carry a value across iterations, like
    an accumulator).  Such a loop vectorises like one without locals (the direct strategy's
    elementwise chains keep their intermediate values in them)."""
    stmts = body.stmts if isinstance(body, L.Block) else (body,)
    if not all(isinstance(x, (L.Assign, L.Store)) for x in stmts):
        return False
    # a chain through a polynomial math function (bias + GELU's tanh, erf, exp) keeps LLVM's own
    # choice: forced, bias_gelu_tanh[8192,3072] took 2x the time (8.0 against 4.1-5.0 ms, 2 threads)
    if any(isinstance(v, L.Un) and v.op in _MATH for x in stmts for v in L.walk(x.value)):
        return False
    pending = {x.name for x in stmts if isinstance(x, L.Assign)}
    for x in stmts:
        exprs = (x.value,) if isinstance(x, L.Assign) else (x.index, x.value)
        if any(isinstance(v, L.Var) and v.name in pending for e in exprs for v in L.walk(e)):
            return False
        if isinstance(x, L.Assign):
            pending.discard(x.name)
    return True


def _stores(s) -> list:
    """The Stores under ``s`` (callers pass loop bodies without inner loops)."""
    return [x for x in L.walk(s) if isinstance(x, L.Store)]


def _mentions(e, name: str) -> bool:
    return any(isinstance(x, L.Var) and x.name == name for x in L.walk(e))


def _has(s, cls) -> bool:
    """Whether statement ``s`` is or contains a ``cls`` statement."""
    return any(isinstance(x, cls) for x in L.walk(s))


def to_loop_ir(prog: PolyProgram, schedule: isl.Schedule, storage: Mapping[str, Storage], name: str,
               parallel: bool = True, consts=None, param_order=None, lanes: int = 16) -> L.Kernel:
    """Generate the AST of ``schedule`` and convert it into a loop-IR Kernel called ``name``.

    Params are the micro-graph inputs then outputs (or ``param_order``), minus inlined
    single-element constants ``consts`` (value -> number).  Innermost loops that fold into
    scalars get ``lanes`` partial accumulators (:func:`lane_reductions`; ``lanes=1`` keeps the
    sequential order).
    """
    build = isl.AstBuild.from_context(prog.context)
    ast = build.node_from_schedule(schedule)
    em = Emitter(prog, storage, consts, param_order)
    body = mark_shifted_exp(em.node(ast))
    lane_allocs = []
    if lanes > 1:
        body, lane_allocs = lane_reductions(body, {l.name for l in em.locals_.values()}, lanes)
    body, pvar, pext = mark_loops(body, parallel)
    decls = [em.locals_[v] for v in em.locals_] + [em.tiles[v] for v in em.tiles] + lane_allocs
    kernel = L.Kernel(name, tuple(em.params.values()), L.block(*decls, body), pvar, pext)
    L.verify_kernel(kernel)
    return kernel


# ----------------------------------------------------------------------------- lane reductions

def subst(node, name: str, rep: L.Expr):
    """``node`` (expression or statement) with the variable ``name`` replaced by ``rep``."""
    if isinstance(node, L.Var):
        return rep if node.name == name else node
    if isinstance(node, L.Const):
        return node
    if isinstance(node, L.Bin):
        return L.Bin(node.op, subst(node.a, name, rep), subst(node.b, name, rep))
    if isinstance(node, L.Un):
        return L.Un(node.op, subst(node.a, name, rep), node.upper, node.lower)
    if isinstance(node, L.Select):
        return L.Select(subst(node.cond, name, rep), subst(node.a, name, rep), subst(node.b, name, rep))
    if isinstance(node, L.Cast):
        return L.Cast(node.dtype, subst(node.a, name, rep))
    if isinstance(node, L.Load):
        return L.Load(node.buf, subst(node.index, name, rep))
    if isinstance(node, L.Store):
        return L.Store(node.buf, subst(node.index, name, rep), subst(node.value, name, rep))
    if isinstance(node, L.Assign):
        return L.Assign(node.name, subst(node.value, name, rep))
    if isinstance(node, L.Block):
        return L.Block(tuple(subst(s, name, rep) for s in node.stmts))
    if isinstance(node, L.If):
        return L.If(subst(node.cond, name, rep), subst(node.then, name, rep),
                    None if node.else_ is None else subst(node.else_, name, rep))
    if isinstance(node, L.For):
        return L.For(node.var, subst(node.lo, name, rep), subst(node.hi, name, rep),
                     node.body if node.var.name == name else subst(node.body, name, rep), node.kind)
    if isinstance(node, L.Local):
        return L.Local(node.name, node.dtype, subst(node.init, name, rep))
    return node


def _vars(e) -> set:
    """Names of the variables expression ``e`` reads."""
    return {x.name for x in L.walk(e) if isinstance(x, L.Var)}


_LANE_OPS = {"add": "sum", "mul": "prod", "max": "max", "min": "min"}


def _lane_identity(op: str, dt: str) -> L.Expr:
    return L.as_expr(identity_value(_LANE_OPS[op], dt), dt)


# Column lanes (poly/column_lanes.py) of at most this many elements: a 16 KiB block of float32
# lanes, a third of the 48 KiB L1 of the EPYC box (the block and the streamed rows share it).
COLUMN_LANES = 4096


def lane_reductions(stmt: L.Stmt, locals_: set, lanes: int = 16, nest_lanes: int = 256,
                    column_lanes: int = COLUMN_LANES):
    """Rewrite innermost loops that fold into scalar Locals (``s = s op e``) with ``lanes``
    partial accumulators, so that LLVM vectorises them without ``reassoc``.

    Lane ``l`` folds the iterations ``lo + l, lo + l + lanes, ...`` of the full blocks in order,
    the tail iterations go to lanes ``0..``, then the lanes fold into the scalar as a halving
    tree (:func:`_fold_lanes`; ``codegen.templates.lane_reduce`` folds left to right).  A fold straight into a buffer
    element (``buf[i] = buf[i] op e``, ``i`` fixed in the loop) is first moved into a scalar
    accumulator (:func:`_promote_store_reductions`), so it gets the same lanes.  A perfect
    two-loop fold ``for j: for l: s = s op e(j, l)`` whose inner extent ``W`` is a multiple of
    ``lanes`` and at most ``nest_lanes`` gets ``W`` lanes instead: lane ``l`` (lane 0 starting
    from ``s``) folds ``e(j, l)`` over ``j`` in order, then the ``W`` lanes are folded left to
    right into ``s`` -- one horizontal fold per nest instead of one per row (a reduction over
    non-adjacent axes, seed listing 3, streams its rows without it).  Such a nest under a
    kept loop ``k`` that folds into one output element per ``k`` gets ``K x W`` lanes (at most
    ``column_lanes``, 0 = never) with ``k`` moved inside the nest's outer loop
    (:func:`~apollo_py.poly.column_lanes.rewrite_columns`: contiguous reads, same results).  Returns
    ``(stmt, allocs)``; the lane buffers and accumulators ``allocs`` must be declared at the
    top of the kernel.
    """
    rw = _LaneRewriter(locals_, lanes, nest_lanes, column_lanes)
    return rw.visit(stmt), rw.allocs


class _LaneRewriter:
    """The steps of :func:`lane_reductions`; ``allocs`` collects the lane buffers and promoted
    accumulators it declares, ``counter`` numbers them (shared with
    :func:`_promote_store_reductions`), ``locals_`` the scalar Locals a fold may target."""

    def __init__(self, locals_: set, lanes: int, nest_lanes: int, column_lanes: int = 0):
        self.allocs: list = []
        self.counter = [0]
        self.locals_ = set(locals_)
        self.lanes, self.nest_lanes, self.column_lanes = lanes, nest_lanes, column_lanes

    def visit(self, s, inside: bool = False):
        """``s`` with every innermost fold loop rewritten (nests first tried as a whole);
        ``inside``: under a loop (the outermost loop becomes the parallel one, which must stay
        a kept dim: column lanes never swap it)."""
        if isinstance(s, L.Block):
            return L.Block(tuple(self.visit(x, inside) for x in s.stmts))
        if isinstance(s, L.If):
            return L.If(s.cond, self.visit(s.then, inside),
                        None if s.else_ is None else self.visit(s.else_, inside))
        if isinstance(s, L.For):
            if _has(s.body, L.For):
                nest = self.rewrite_nest(s) if self.nest_lanes else None
                if nest is None and self.column_lanes and inside:
                    nest = rewrite_columns(s, self.lanes, self.column_lanes, self.counter, self.allocs,
                                           _lane_identity)
                if nest is not None:
                    return nest
                return L.For(s.var, s.lo, s.hi, self.visit(s.body, True), s.kind)
            return self.rewrite_loop(s)
        return s

    def new_lanes(self, var: str, reds: dict, width: int):
        """A fresh tag, one ``width``-lane Alloc per fold of ``reds`` (declared via ``allocs``),
        and the lane index Var."""
        self.counter[0] += 1
        tag = f"{var}_{self.counter[0]}"
        bufs = {}
        for name, (op, dt) in reds.items():
            bufs[name] = L.Alloc(f"lanes_{name}_{self.counter[0]}", dt, width)
            self.allocs.append(bufs[name])
        return tag, bufs, L.Var(f"l_{tag}")

    def rewrite_nest(self, f: L.For):
        """``for j: for l: s = s op e(j, l)`` (a perfect two-loop fold, the inner extent a
        multiple of ``lanes`` up to ``nest_lanes``): one lane per inner iteration ``l``, each
        folding over ``j`` in order, then the lanes folded left to right -- no per-row
        horizontal fold (listing 3's sum over axes 1 and 3).  None when ``f`` is not such a nest."""
        lanes, allocs, locals_ = self.lanes, self.allocs, self.locals_
        inner = f.body.stmts[0] if isinstance(f.body, L.Block) and len(f.body.stmts) == 1 else f.body
        if not isinstance(inner, L.For) or _has(inner.body, L.For):
            return None
        for g in (f, inner):
            if g.kind != "serial" or not (isinstance(g.lo, L.Const) and isinstance(g.hi, L.Const)):
                return None
        width = inner.hi.value - inner.lo.value
        if width % lanes or not lanes <= width <= self.nest_lanes or f.hi.value - f.lo.value < 2:
            return None
        pre, inner2, post = _promote_store_reductions(inner, allocs, self.counter, (f.var.name,))
        if pre:
            locals_.update(x.name for x in allocs if isinstance(x, L.Local))
        body = list(inner2.body.stmts) if isinstance(inner2.body, L.Block) else [inner2.body]
        reds = _fold_targets(body, inner2.var.name, locals_)
        if not reds or any(u in reds for u in (_vars(f.lo) | _vars(f.hi))):
            if pre:      # undo: the plain path handles the store fold on the inner loop
                del allocs[len(allocs) - len(pre):]
            return None
        tag, bufs, lane = self.new_lanes(inner.var.name, reds, width)
        lo = inner.lo.value
        stmts = list(pre)
        for name, (op, dt) in reds.items():
            a = bufs[name]
            ident = L.as_expr(identity_value(_LANE_OPS[op], dt), dt)
            stmts.append(L.For(lane, L.Const(0), L.Const(width),
                               L.Store(a, lane, L.Select(L.eq(lane, 0), L.Var(name, dt), ident)), "vector"))
        new_body = []
        for x in body:
            if isinstance(x, L.Assign) and x.name in reds:
                a = bufs[x.name]
                slot = _simplify_add(inner2.var, L.Const(-lo, "int64"))
                new_body.append(L.Store(a, slot, L.Bin(x.value.op, L.Load(a, slot), x.value.b)))
            else:
                new_body.append(x)
        stmts.append(L.For(f.var, f.lo, f.hi, L.Block((
            L.For(inner2.var, inner2.lo, inner2.hi, L.Block(tuple(new_body)), "vector"),)), "serial"))
        for name, (op, dt) in reds.items():
            stmts.extend(_fold_lanes(name, op, dt, bufs[name], lane, width, "serial"))
        stmts.extend(post)
        return L.Block(tuple(stmts))

    def rewrite_loop(self, f: L.For):
        """An innermost loop: folds into buffer elements promoted to scalars, then lanes."""
        if f.kind != "serial" or not (isinstance(f.lo, L.Const) and isinstance(f.hi, L.Const)):
            return f
        pre, f, post = _promote_store_reductions(f, self.allocs, self.counter)
        if pre:
            self.locals_.update(x.name for x in self.allocs if isinstance(x, L.Local))
        out = self.rewrite_scalar(f)
        return L.Block((*pre, out, *post)) if pre else out

    def rewrite_scalar(self, f: L.For):
        """An innermost loop folding into scalar Locals, with lanes when it is long enough."""
        extent = f.hi.value - f.lo.value
        if extent < 2 * self.lanes:
            return f
        body = list(f.body.stmts) if isinstance(f.body, L.Block) else [f.body]
        reds = _fold_targets(body, f.var.name, self.locals_)
        if not reds:
            return f
        return self.rewrite_lanes(f, body, reds, _order_free_lanes(reds, self.lanes, extent))

    def rewrite_lanes(self, f: L.For, body: list, reds: dict, lanes: int):
        """``f`` as lane initialisation, full blocks of ``lanes`` iterations (vectorisable), the
        tail, and the folds of the lanes into their scalars."""
        tag, bufs, lane = self.new_lanes(f.var.name, reds, lanes)
        blk = L.Var(f"b_{tag}")
        tail = L.Var(f"t_{tag}")
        lo, hi = f.lo.value, f.hi.value
        nfull = (hi - lo) // lanes
        base = lo + nfull * lanes

        def lane_body(idx: L.Expr, slot: L.Expr):
            out = []
            for x in body:
                if isinstance(x, L.Assign) and x.name in reds:
                    op = x.value.op
                    a = bufs[x.name]
                    e = subst(x.value.b, f.var.name, idx)
                    out.append(L.Store(a, slot, L.Bin(op, L.Load(a, slot), e)))
                else:
                    out.append(subst(x, f.var.name, idx))
            return L.Block(tuple(out))

        stmts = []
        for name, (op, dt) in reds.items():
            a = bufs[name]
            ident = L.as_expr(identity_value(_LANE_OPS[op], dt), dt)
            stmts.append(L.For(lane, L.Const(0), L.Const(lanes),
                               L.Store(a, lane, L.Select(L.eq(lane, 0), L.Var(name, dt), ident)),
                               "unroll"))
        stmts.append(L.For(blk, L.Const(0), L.Const(nfull), L.Block((
            L.For(lane, L.Const(0), L.Const(lanes),
                  lane_body(_simplify_add(L.Const(lo, "int64"), blk * lanes + lane), lane),
                  "vector" if lanes <= 16 else "unroll"),)), "serial"))
        if base < hi:
            stmts.append(L.For(tail, L.Const(base), L.Const(hi),
                               lane_body(tail, tail - base), "serial"))
        for name, (op, dt) in reds.items():
            stmts.extend(_fold_lanes(name, op, dt, bufs[name], lane, lanes, "unroll", tree=True))
        return L.Block(tuple(stmts))


def _order_free_lanes(reds: dict, lanes: int, extent: int, widen: int = 4) -> int:
    """Lane count for the folds ``reds`` of a loop of ``extent`` iterations: up to ``widen``
    times ``lanes`` when every fold is a max or min (whose value does not depend on the
    order, so more independent accumulators only shorten the dependence chain: one NaN-aware
    vector max per 16 elements is latency-bound), else ``lanes`` (sums keep their documented
    order)."""
    if not all(op in ("max", "min") for op, _ in reds.values()):
        return lanes
    n = lanes
    while n < lanes * widen and 4 * n <= extent:
        n *= 2
    return n


def _fold_lanes(name: str, op: str, dt: str, a: L.Alloc, lane: L.Var, width: int, kind: str,
                tree: bool = False) -> list:
    """Fold the ``width`` lanes of ``a`` into the scalar ``name``.

    When ``width`` is a power of two, max and min (associative and commutative: NaN-
    propagating, -0 < +0 as llvm.maximum), and with ``tree`` also sums and products, fold as a
    halving tree, ``a[l] = op(a[l], a[l + h])`` for h = width/2, ... 1: log2(width) vector
    steps (a 16-lane float sum in order was 15 dependent scalar adds and 15 shuffles, a serial
    chain at the end of every softmax row).  Otherwise left to right, ``((a0 op a1) op a2)``.
    """
    if (tree or op in ("max", "min")) and width & (width - 1) == 0 and width > 1:
        out = []
        h = width // 2
        while h >= 1:
            out.append(L.For(lane, L.Const(0), L.Const(h),
                             L.Store(a, lane, L.Bin(op, L.Load(a, lane), L.Load(a, lane + h))), "unroll"))
            h //= 2
        return out + [L.Assign(name, L.Load(a, L.Const(0)))]
    return [L.Assign(name, L.Load(a, L.Const(0))),
            L.For(lane, L.Const(1), L.Const(width),
                  L.Assign(name, L.Bin(op, L.Var(name, dt), L.Load(a, lane))), kind)]


def _fold_targets(body: list, loop_var: str, locals_: set):
    """The scalar folds ``s = s op e`` of a loop body that the lane rewrite may split into
    partial accumulators, as ``{name: (op, dtype)}``; None (or empty) when the body is not
    only Assigns and Stores, a partial value is read inside the loop, or a private scalar is
    read before it is written in the iteration."""
    if not all(isinstance(x, (L.Assign, L.Store)) for x in body):
        return None
    reds, assigned = {}, set()
    for x in body:
        if isinstance(x, L.Assign):
            v = x.value
            if isinstance(v, L.Bin) and v.op in _LANE_OPS and isinstance(v.a, L.Var) \
                    and v.a.name == x.name and x.name not in _vars(v.b):
                if x.name in reds or x.name in assigned:
                    return None
                reds[x.name] = (v.op, v.a.dtype)
                continue
        used = _vars(x.value) | (_vars(x.index) if isinstance(x, L.Store) else set())
        if used & set(reds):
            return None                       # a partial sum read inside the loop
        if any(u in locals_ and u not in assigned for u in used if u != loop_var) \
                and any(u in reds for u in used):
            return None
        if isinstance(x, L.Assign):
            if x.name in reds:
                return None
            assigned.add(x.name)
    # a private scalar must be written before it is read in the same iteration
    seen = set()
    for x in body:
        used = _vars(x.value) | (_vars(x.index) if isinstance(x, L.Store) else set())
        if isinstance(x, L.Assign) and x.name in reds:
            used = _vars(x.value.b)
        if any(u in assigned and u not in seen for u in used):
            return None
        if isinstance(x, L.Assign):
            seen.add(x.name)
    return reds


def _loads_of(node, buf) -> int:
    """How many Loads of ``buf`` occur in expression or statement ``node``."""
    if isinstance(node, L.Load):
        return (node.buf == buf) + _loads_of(node.index, buf)
    if isinstance(node, L.Store):
        return _loads_of(node.index, buf) + _loads_of(node.value, buf)
    if isinstance(node, L.Assign):
        return _loads_of(node.value, buf)
    if isinstance(node, L.Block):
        return sum(_loads_of(x, buf) for x in node.stmts)
    return sum(_loads_of(getattr(node, f), buf) for f in ("a", "b", "cond")
               if isinstance(getattr(node, f, None), L.Expr))


def _promote_store_reductions(f: L.For, decls: list, counter: list, outer_vars=()):
    """Turn ``buf[i] = buf[i] op e`` in the innermost loop ``f`` (``i`` independent of the loop
    variable, ``buf`` not otherwise read or written in the loop) into a scalar accumulator of
    the compute dtype: ``acc = buf[i]`` before the loop, ``acc = acc op e`` in it and
    ``buf[i] = acc`` after it.  A float16 ``buf`` so accumulates in float32 and rounds once, as
    numpy's contiguous float16 sum does (a fold numpy rounds at every step carries a
    ``round_f16`` and does not match).  The fold order is unchanged (the accumulator starts
    from the stored initial value and folds the iterations in order); the lane rewrite then
    applies as for any scalar fold.  Returns ``(before, loop, after)``; new Locals go to
    ``decls``."""
    body = list(f.body.stmts) if isinstance(f.body, L.Block) else [f.body]
    if not all(isinstance(x, (L.Assign, L.Store)) for x in body):
        return [], f, []
    pre, post, new_body = [], [], list(body)
    for k, x in enumerate(body):
        if not isinstance(x, L.Store):
            continue
        v = x.value
        if not (isinstance(v, L.Bin) and v.op in _LANE_OPS and isinstance(v.a, L.Load)
                and v.a.buf == x.buf and v.a.index == x.index):
            continue
        if {f.var.name, *outer_vars} & _vars(x.index):
            continue
        if any(isinstance(y, L.Store) and y.buf == x.buf for j, y in enumerate(body) if j != k):
            continue
        if sum(_loads_of(y, x.buf) for y in body) != 1 or _loads_of(x.index, x.buf):
            continue
        if any(isinstance(y, L.Assign) and y.name in _vars(x.index) for y in body):
            continue
        counter[0] += 1
        dt = L.compute_dtype(x.buf.dtype)
        acc = L.Local(f"acc_{x.buf.name}_{counter[0]}", dt, L.as_expr(0, dt))
        decls.append(acc)
        pre.append(L.Assign(acc.name, v.a))
        new_body[k] = L.Assign(acc.name, L.Bin(v.op, acc.var, v.b))
        post.append(L.Store(x.buf, x.index, acc.var))
    if not pre:
        return [], f, []
    return pre, L.For(f.var, f.lo, f.hi, L.Block(tuple(new_body)), f.kind), post
