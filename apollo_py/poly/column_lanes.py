"""Column lanes: a fold over non-adjacent axes with the kept loop moved inside the fold.

A reduction that keeps a middle axis (seed listing 3: ``y[n, h] = sum_{c, w} x[n, c, h, w]``)
comes out of isl as::

    for k:                          # kept axis (h), one output element per k
        y[i(k)] = init
        for j:                      # outer reduced axis (c)
            for l:                  # inner reduced axis (w), W iterations
                y[i(k)] = y[i(k)] op e(k, j, l)

which :func:`~apollo_py.poly.ast_to_loopir.lane_reductions` gives ``W`` lanes per ``k``: for
every ``k`` the nest reads ``J`` rows of ``W`` elements that lie ``H*W`` elements apart, so a
kernel streams ``J`` rows at once (64 streams 16 KiB apart in listing 3), more than the
hardware prefetchers track.  :func:`rewrite_columns` moves ``k`` inside ``j``::

    for k: y[i(k)] = init
    for k: for l: lanes[k, l] = (y[i(k)] if l == 0 else identity)
    for j: for k: for l: lanes[k, l] = lanes[k, l] op e(k, j, l)     # one contiguous block per j
    for k: acc = lanes[k, 0] op lanes[k, 1] op ... (left to right); y[i(k)] = acc; <after>

with a ``K x W`` lane block (at most ``max_lanes`` elements, so it stays in L1).  Every lane
folds the same values in the same order as the per-``k`` nest lanes did, and the lanes fold
left to right as they did, so the results are bit-identical to the kernel without the
rewrite; only the order of the memory accesses changes.
"""
from __future__ import annotations

from typing import Callable

from apollo_py.codegen import loopir as L

_FOLD_OPS = ("add", "mul", "max", "min")


def _stmts(s) -> list:
    return list(s.stmts) if isinstance(s, L.Block) else [s]


def _vars(e) -> set:
    return {x.name for x in L.walk(e) if isinstance(x, L.Var)}


def _const_bounds(f: L.For) -> bool:
    return isinstance(f.lo, L.Const) and isinstance(f.hi, L.Const)


def _fold(body: list, k: str, j: str, l: str, pre: list):
    """The fold of ``body``: ``buf[i] = buf[i] op e`` (``i`` depends on ``k`` and on neither
    ``j`` nor ``l``; ``buf`` read nowhere else in the body, no other store in it; ``pre`` only
    stores to ``buf[i]``), or ``s = s op e`` into a scalar (no store in the body; ``pre`` is
    ``s = <constant>``).  None otherwise."""
    stores = [x for x in body if isinstance(x, L.Store)]
    if len(stores) == 1:
        s = stores[0]
        v = s.value
        if not (isinstance(v, L.Bin) and v.op in _FOLD_OPS and isinstance(v.a, L.Load)
                and v.a.buf == s.buf and v.a.index == s.index):
            return None
        aff = L.affine_form(s.index)
        if aff is None or not aff.get(k) or aff.get(j) or aff.get(l):
            return None                      # distinct k must fold into distinct elements
        loads = sum(1 for x in body for n in L.walk(x) if isinstance(n, L.Load) and n.buf == s.buf)
        if loads != 1 or L.compute_dtype(s.buf.dtype) != s.buf.dtype:
            return None
        if not all(isinstance(x, L.Store) and x.buf == s.buf and x.index == s.index
                   and not any(isinstance(n, L.Load) and n.buf == s.buf for n in L.walk(x.value))
                   for x in pre):
            return None
        return s
    if stores:
        return None
    folds = [x for x in body if isinstance(x, L.Assign) and isinstance(x.value, L.Bin)
             and x.value.op in _FOLD_OPS and isinstance(x.value.a, L.Var) and x.value.a.name == x.name
             and x.name not in _vars(x.value.b)]
    if len(folds) != 1 or sum(isinstance(x, L.Assign) and x.name == folds[0].name for x in body) != 1:
        return None
    if len(pre) != 1 or not (isinstance(pre[0], L.Assign) and pre[0].name == folds[0].name
                             and isinstance(pre[0].value, L.Const)):
        return None
    if any(folds[0].name in _vars(x.value) for x in body if x is not folds[0]):
        return None                          # the partial value read inside the nest
    return folds[0]


def rewrite_columns(f: L.For, lanes: int, max_lanes: int, counter: list, allocs: list,
                    identity: Callable[[str, str], L.Expr]):
    """``f`` (the kept loop ``k`` above) with its fold nest's loops swapped as in the module
    docstring, or None when ``f`` is not such a loop: constant bounds, serial loops, the nest
    perfect with an inner extent ``W`` a multiple of ``lanes``, ``K * W <= max_lanes``, every
    load that moves with the inner loop reading ``l + W * k + ...`` (so that the swap makes
    the reads contiguous), before the nest only the fold's initialisation, after it no loop and
    nothing the nest reads written, and the nest body only private scalars and the fold (into
    a buffer element of ``k`` or into a scalar, :func:`_fold`).  New Allocs and Locals go to
    ``allocs``; ``counter`` numbers them; ``identity(op, dtype)`` is a fold's identity element."""
    if f.kind != "serial" or not _const_bounds(f):
        return None
    body = _stmts(f.body)
    loops = [n for n, x in enumerate(body) if isinstance(x, L.For)]
    if len(loops) != 1:
        return None
    pre, nest, post = body[:loops[0]], body[loops[0]], body[loops[0] + 1:]
    inner = _stmts(nest.body)
    if len(inner) != 1 or not isinstance(inner[0], L.For):
        return None
    inner = inner[0]
    if any(g.kind != "serial" or not _const_bounds(g) for g in (nest, inner)):
        return None
    ibody = _stmts(inner.body)
    if not all(isinstance(x, (L.Assign, L.Store)) for x in ibody):
        return None
    K, J = f.hi.value - f.lo.value, nest.hi.value - nest.lo.value
    W = inner.hi.value - inner.lo.value
    if K < 2 or J < 2 or W % lanes or not lanes <= W or K * W > max_lanes:
        return None
    k, j, l = f.var.name, nest.var.name, inner.var.name
    fold = _fold(ibody, k, j, l, pre)
    if fold is None:
        return None
    to_buf = isinstance(fold, L.Store)
    # only where it makes the reads contiguous: every load that moves with l reads element
    # l + W*k + (something of j): one block of K*W elements per j (a reduction over the
    # trailing axes, already contiguous per k, stays as it is)
    for x in ibody:
        for n in L.walk(x):
            if isinstance(n, L.Load) and (not to_buf or n.buf != fold.buf) and l in _vars(n.index):
                aff = L.affine_form(n.index)
                if aff is None or aff.get(l) != 1 or aff.get(k) != W:
                    return None
    # private scalars only: each written in the iteration before it is read
    written = {x.name for x in ibody if isinstance(x, L.Assign) and x is not fold}
    seen: set = set()
    for x in ibody:
        used = _vars(x.value) | (_vars(x.index) if isinstance(x, L.Store) else set())
        if used & (written - seen):
            return None
        if isinstance(x, L.Assign):
            seen.add(x.name)
    read_nest = set().union(*(_vars(x.value) | (_vars(x.index) if isinstance(x, L.Store) else set())
                              for x in ibody))
    loaded = {n.buf.name for x in ibody for n in L.walk(x) if isinstance(n, L.Load)}
    for x in post:
        if any(isinstance(n, L.For) for n in L.walk(x)):
            return None
        if any(isinstance(n, L.Assign) and n.name in read_nest for n in L.walk(x)):
            return None
        if any(isinstance(n, L.Store) and n.buf.name in loaded for n in L.walk(x)):
            return None
    op = fold.value.op
    dt = fold.buf.dtype if to_buf else fold.value.a.dtype
    counter[0] += 1
    tag = f"{fold.buf.name if to_buf else fold.name}_{counter[0]}"
    block = L.Alloc(f"cols_{tag}", dt, K * W)
    lane = L.Var(f"cl_{tag}")
    allocs.append(block)
    if to_buf:
        acc = L.Local(f"colacc_{tag}", dt, L.as_expr(0, dt))
        allocs.append(acc)
        acc_name, first, last = acc.name, L.Load(fold.buf, fold.index), [L.Store(fold.buf, fold.index, acc.var)]
    else:
        acc_name, first, last = fold.name, pre[0].value, []
    kv, lv = f.var, inner.var
    krow = (kv - f.lo.value) * W if f.lo.value else kv * W
    slot = krow + (lv - inner.lo.value if inner.lo.value else lv)
    out = []
    if pre and to_buf:
        out.append(L.For(kv, f.lo, f.hi, L.block(*pre), "serial"))
    out.append(L.For(kv, f.lo, f.hi, L.For(lane, L.Const(0), L.Const(W), L.Store(
        block, krow + lane, L.Select(L.eq(lane, 0), first, identity(op, dt))), "vector"), "serial"))
    new_ibody = [L.Store(block, slot, L.Bin(op, L.Load(block, slot), fold.value.b)) if x is fold else x
                 for x in ibody]
    out.append(L.For(nest.var, nest.lo, nest.hi, L.For(kv, f.lo, f.hi, L.For(
        lv, inner.lo, inner.hi, L.block(*new_ibody), "vector"), "serial"), "serial"))
    out.append(L.For(kv, f.lo, f.hi, L.block(
        L.Assign(acc_name, L.Load(block, krow)),
        L.For(lane, L.Const(1), L.Const(W),
              L.Assign(acc_name, L.Bin(op, L.Var(acc_name, dt), L.Load(block, krow + lane))), "serial"),
        *last, *post), "serial"))
    return L.Block(tuple(out))
