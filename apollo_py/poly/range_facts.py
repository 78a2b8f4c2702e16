"""Range facts on the loop IR: ``exp(x - max(x))`` never sees a positive argument, and
``log(sum(exp(x - max(x))))`` never sees one below 1.

Softmax and log-softmax compute ``exp(e(j) - m)`` after ``m`` folded ``max`` over the same
elements ``e(j)``.  Then ``e(j) <= m``, so ``e(j) - m <= 0`` (rounding is monotone and
``fl(0) = 0``), or NaN when the row holds a NaN (``max`` propagates NaN) or an inf.  This pass
proves that on the loop IR the emitter builds (before the lane rewrite) and records it as
``Un("exp", arg, upper=0.0)``; the LLVM renderer then calls an exp without the upper clamp
(llvm_math: one vector op of 17 per 16 elements, softmax [768,128,128] about 4%).  The fact
only needs ``arg <= 88.7``: an FMA contraction of a product in ``e`` may make ``arg`` a
rounding error above 0, which is harmless.

Pattern, inside one Block (the statements ``S_i`` in order):

* ``S_i = for v in [lo, hi): ... m = max(m, E(v)) ...``: an unconditional fold of ``m`` in
  the loop body (straight-line Assigns/Stores), ``E`` not reading ``m``;
* a later ``S_k = for w in [lo2, hi2)`` with ``lo <= lo2``, ``hi2 <= hi`` (constants) whose
  body is straight-line; between ``S_i`` and ``S_k`` (both included) nothing assigns ``m`` or
  a scalar ``E`` reads, nor stores to a buffer ``E`` loads (so ``E(w)`` still has the value
  that was folded);
* in ``S_k``'s body an ``exp`` of ``sub(E(w), m)`` -- directly, through a scalar assigned it
  in the same iteration, or through a buffer element stored it at the same index.

When the loop ``S_k`` covers exactly ``[lo, hi)`` and ``m`` was set to -inf right before
``S_i``, a sum ``s = s + exp(E(w) - m)`` in ``S_k`` (``s = 0`` before it) includes exp(0) = 1
for the maximum, so ``1 <= s <= hi - lo`` or NaN: a later ``log(s)`` gets ``lower=1.0,
upper=hi-lo`` (LLVM: log without its zero, negative, subnormal and inf cases; log-softmax).

Anything else is left as it is.
"""
from __future__ import annotations

from ..codegen import loopir as L


def _sub(e, name: str, rep):
    """Expression ``e`` with Var ``name`` replaced by ``rep`` (None: ``e`` holds a node this
    pass does not know)."""
    if isinstance(e, L.Var):
        return rep if e.name == name else e
    if isinstance(e, L.Const):
        return e
    if isinstance(e, L.Bin):
        a, b = _sub(e.a, name, rep), _sub(e.b, name, rep)
        return None if a is None or b is None else L.Bin(e.op, a, b)
    if isinstance(e, L.Un):
        a = _sub(e.a, name, rep)
        return None if a is None else L.Un(e.op, a, e.upper, e.lower)
    if isinstance(e, L.Select):
        p = [_sub(x, name, rep) for x in (e.cond, e.a, e.b)]
        return None if None in p else L.Select(*p)
    if isinstance(e, L.Cast):
        a = _sub(e.a, name, rep)
        return None if a is None else L.Cast(e.dtype_, a)
    if isinstance(e, L.Load):
        i = _sub(e.index, name, rep)
        return None if i is None else L.Load(e.buf, i)
    return None


def _reads(e, vars_: set, bufs: set) -> None:
    """Collect the Var names and buffer names expression ``e`` reads."""
    for n in L.walk(e):
        if isinstance(n, L.Var):
            vars_.add(n.name)
        elif isinstance(n, L.Load):
            bufs.add(n.buf.name)


def _writes(s, vars_: set, bufs: set) -> None:
    """Collect the scalar names statement ``s`` (recursively) assigns and buffers it stores."""
    if isinstance(s, (L.Assign, L.Local)):
        vars_.add(s.name)
    elif isinstance(s, L.Store):
        bufs.add(s.buf.name)
    elif isinstance(s, L.For):
        vars_.add(s.var.name)
        _writes(s.body, vars_, bufs)
    elif isinstance(s, L.Block):
        for x in s.stmts:
            _writes(x, vars_, bufs)
    elif isinstance(s, L.Alloc):
        pass
    elif isinstance(s, L.If):
        _writes(s.then, vars_, bufs)
        if s.else_ is not None:
            _writes(s.else_, vars_, bufs)
    else:                       # an unknown statement: assume it writes everything
        vars_.add("*")
        bufs.add("*")


def _body(f: L.For):
    body = list(f.body.stmts) if isinstance(f.body, L.Block) else [f.body]
    return body if all(isinstance(x, (L.Assign, L.Store)) for x in body) else None


def _max_folds(f: L.For) -> list:
    """``[(m, E)]`` for the unconditional folds ``m = max(m, E(v))`` of loop ``f``."""
    body = _body(f)
    if body is None or not isinstance(f.lo, L.Const) or not isinstance(f.hi, L.Const):
        return []
    out = []
    for x in body:
        v = x.value
        if isinstance(x, L.Assign) and isinstance(v, L.Bin) and v.op == "max" \
                and isinstance(v.a, L.Var) and v.a.name == x.name and L.is_float(v.dtype):
            names, bufs = set(), set()
            _reads(v.b, names, bufs)
            if x.name not in names and sum(isinstance(y, L.Assign) and y.name == x.name
                                           for y in body) == 1:
                out.append((x.name, v.b))
    return out


class _Values:
    """Which scalars and buffer elements hold a value of a given kind (``"shifted"``:
    ``E(w) - m``, ``"exp"``: its exp) during one iteration of a straight-line loop body."""

    def __init__(self):
        self.scalars: dict = {}
        self.slots: dict = {}

    def kind(self, e):
        if isinstance(e, L.Var):
            return self.scalars.get(e.name)
        if isinstance(e, L.Load):
            return self.slots.get((e.buf.name, e.index))
        return None

    def assign(self, name: str, kind) -> None:
        self.scalars.pop(name, None)
        for q in [q for q in self.slots if name in _names(q[1])]:
            del self.slots[q]                 # an index reading ``name`` now means another slot
        if kind:
            self.scalars[name] = kind

    def store(self, buf: str, index, kind) -> None:
        for q in [q for q in self.slots if q[0] == buf]:
            del self.slots[q]
        if kind:
            self.slots[(buf, index)] = kind


def _names(e) -> set:
    names, bufs = set(), set()
    _reads(e, names, bufs)
    return names


def _mark_loop(f: L.For, m: str, elem):
    """Loop ``f`` with its ``exp(E(w) - m)`` marked ``upper=0``, and the scalars ``s`` it
    folds as ``s = s + exp(E(w) - m)``: ``(loop, sums)``."""
    body = _body(f)
    names, bufs = set(), set()
    _reads(elem, names, bufs)
    if body is None or any(isinstance(x, L.Store) and x.buf.name in bufs for x in body) \
            or any(isinstance(x, L.Assign) and x.name in names | {m} for x in body):
        return f, []
    shifted = L.Bin("sub", elem, L.Var(m, elem.dtype))
    vals = _Values()

    def kind(e):
        if e == shifted:
            return "shifted"
        if isinstance(e, L.Un) and e.op == "exp" and kind(e.a) == "shifted":
            return "exp"
        return vals.kind(e)

    def mark(e):
        if isinstance(e, L.Un):
            a = mark(e.a)
            if e.op == "exp" and e.upper is None and kind(a) == "shifted":
                return L.Un("exp", a, 0.0, e.lower)
            return e if a is e.a else L.Un(e.op, a, e.upper, e.lower)
        if isinstance(e, L.Bin):
            a, b = mark(e.a), mark(e.b)
            return e if a is e.a and b is e.b else L.Bin(e.op, a, b)
        if isinstance(e, L.Select):
            c, a, b = mark(e.cond), mark(e.a), mark(e.b)
            return e if (c, a, b) == (e.cond, e.a, e.b) else L.Select(c, a, b)
        if isinstance(e, L.Cast):
            a = mark(e.a)
            return e if a is e.a else L.Cast(e.dtype_, a)
        return e

    out, sums = [], []
    for x in body:
        v = mark(x.value)
        if isinstance(x, L.Assign):
            if isinstance(v, L.Bin) and v.op == "add" and v.a == L.Var(x.name, v.dtype) \
                    and kind(v.b) == "exp":
                sums.append(x.name)
            vals.assign(x.name, kind(v))
            out.append(L.Assign(x.name, v))
        else:
            vals.store(x.buf.name, x.index, kind(v))
            out.append(L.Store(x.buf, x.index, v))
    sums = [n for n in sums if sum(isinstance(x, L.Assign) and x.name == n for x in body) == 1]
    return L.For(f.var, f.lo, f.hi, L.Block(tuple(out)), f.kind), sums


def _last_write_is(stmts: list, upto: int, name: str, value) -> bool:
    """Whether the last statement before ``stmts[upto]`` that writes scalar ``name`` is
    ``name = value``."""
    for x in reversed(stmts[:upto]):
        wv, wb = set(), set()
        _writes(x, wv, wb)
        if name in wv or "*" in wv:
            return isinstance(x, L.Assign) and x.name == name and x.value == value
    return False


def _mark_log_of_sum(stmts: list, k: int, sums: list) -> None:
    """``stmts[k]`` is a loop over the whole range of a max fold of ``m`` started from -inf,
    folding ``s = s + exp(E(w) - m)`` for each ``s`` in ``sums``: with ``s = 0`` before the
    loop, ``s`` holds exp(0) = 1 for the element equal to the max, so ``1 <= s <= n`` (n
    terms, each <= 1) or NaN.  Marks ``log(s)`` in the statements after the loop (until ``s``
    is written) with ``lower=1.0, upper=n``."""
    g = stmts[k]
    n = float(g.hi.value - g.lo.value)
    for name in sums:
        if n < 1 or not _last_write_is(stmts, k, name, L.Const(0.0, "float32")):
            continue
        target = L.Un("log", L.Var(name, "float32"))
        for j in range(k + 1, len(stmts)):
            x = stmts[j]
            if isinstance(x, (L.Assign, L.Store)) and x.value == target:
                fact = L.Un("log", target.a, n, 1.0)
                stmts[j] = L.Assign(x.name, fact) if isinstance(x, L.Assign) \
                    else L.Store(x.buf, x.index, fact)
            wv, wb = set(), set()
            _writes(stmts[j], wv, wb)
            if name in wv or "*" in wv:
                break


def _mark_block(stmts: list) -> list:
    stmts = [mark_shifted_exp(x) for x in stmts]
    for i, f in enumerate(stmts):
        if not isinstance(f, L.For):
            continue
        for m, elem in _max_folds(f):
            names, bufs = set(), set()
            _reads(elem, names, bufs)
            names.discard(f.var.name)
            wv, wb = set(), set()
            _writes(f, wv, wb)
            wv -= {f.var.name, m}                # the fold loop itself may write these
            for k in range(i + 1, len(stmts)):
                g = stmts[k]
                if isinstance(g, L.For) and isinstance(g.lo, L.Const) and isinstance(g.hi, L.Const) \
                        and f.lo.value <= g.lo.value and g.hi.value <= f.hi.value \
                        and g.var.dtype == f.var.dtype:
                    e2 = _sub(elem, f.var.name, g.var)
                    if e2 is not None and not wv & names and not wb & bufs and "*" not in wv:
                        stmts[k], sums = _mark_loop(g, m, e2)
                        if sums and (g.lo, g.hi) == (f.lo, f.hi) and _last_write_is(
                                stmts, i, m, L.Const(float("-inf"), elem.dtype)):
                            _mark_log_of_sum(stmts, k, sums)
                _writes(g, wv, wb)
                if isinstance(g, L.For):
                    wv.discard(g.var.name)
                if m in wv or wv & names or wb & bufs or "*" in wv:
                    break
    return stmts


def mark_shifted_exp(stmt: L.Stmt) -> L.Stmt:
    """``stmt`` with every ``exp(E(w) - m)`` that follows a ``max`` fold of ``m`` over
    ``E`` marked ``Un("exp", ..., upper=0.0)`` (module docstring); expects the emitter's loop
    IR (loops with constant bounds, straight-line innermost bodies) and returns the same
    structure."""
    if isinstance(stmt, L.Block):
        return L.Block(tuple(_mark_block(list(stmt.stmts))))
    if isinstance(stmt, L.For):
        body = mark_shifted_exp(stmt.body)
        return stmt if body is stmt.body else L.For(stmt.var, stmt.lo, stmt.hi, body, stmt.kind)
    if isinstance(stmt, L.If):
        then = mark_shifted_exp(stmt.then)
        else_ = None if stmt.else_ is None else mark_shifted_exp(stmt.else_)
        return L.If(stmt.cond, then, else_)
    return stmt
