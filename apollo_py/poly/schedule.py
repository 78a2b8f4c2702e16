"""Fused schedules for one micro-graph, under an isl operations budget (DESIGN §5).

Primary strategy (:func:`build_fused_schedule`): build the fused schedule tree directly — a
shared outer band over the dims of the final output that every statement maps to as a
function (its parallel dims), then the statements in sequence inside, consecutive statements
sharing an inner band when their dependences are point-wise — and let isl check legality.
This gives the ideal nests: softmax/layernorm as one row loop with inner loops, bias + 2×2
max-pool in one nest (loop scaling by ``floor(h/2)``), bias + reduce over axes 1,3 with the
reduction inside the kept dims.

Fallback (:func:`isl_schedule`): the isl scheduler with ``schedule_whole_component``, then with
the defaults, each accepted only if it yields ONE group (an outer band over all statements).

Every isl call here runs under ``Options.schedule_budget`` operations; going over raises
:class:`BudgetExceeded` (the caller logs ``schedule_budget_exceeded`` and splits).  The isl
scheduler, whose work the operations counter does not fully bound, also runs under a wall-time
limit (``Options.schedule_timeout``) in a child process that is killed when it runs over
(``poly/bounded.py``); that too is BudgetExceeded.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import islpy as isl

from .bounded import ChildError, WallTimeExceeded, run_bounded
from .statements import INIT, Dependences, PolyProgram, Statement

_BUDGET_MSG = "maximal number of operations exceeded"


class BudgetExceeded(Exception):
    """The isl operations budget ran out (the scheduler or dependence analysis)."""


class NotOneGroup(Exception):
    """No schedule with one fusion group was found."""


def _exhausted(ctx: isl.Context) -> bool:
    """True when ``ctx`` is out of operations: isl then fails every further call, and some
    callers (the schedule-tree parser) report that as their own error, not as the budget."""
    try:
        isl.Set("{ [i] : 0 <= i < 2 }", context=ctx).is_empty()
        return False
    except isl.Error:
        return True


@contextmanager
def budget(ctx: isl.Context, n: int):
    """Run the body with at most ``n`` isl operations (0 = unlimited); BudgetExceeded if over."""
    ctx.set_max_operations(int(n))
    ctx.reset_operations()
    try:
        yield
    except isl.Error as e:
        if _BUDGET_MSG in str(e) or (n and _exhausted(ctx)):
            raise BudgetExceeded(str(e)) from None
        raise
    finally:
        ctx.set_max_operations(0)
        ctx.reset_operations()


@dataclass(frozen=True, eq=False)
class FusedSchedule:
    """A legal schedule with one fusion group.

    ``band`` is the number of members of the shared outer band (all coincident, permutable);
    ``strategy`` is ``"direct"`` or ``"isl"``; ``band_extents`` the extent of each outer band
    member (from the context), used to pick the parallel dim and default tiles.
    """

    schedule: isl.Schedule
    band: int
    band_extents: tuple
    strategy: str
    time_ms: float


# ----------------------------------------------------------------------------- helpers

def _ctxd(x, prog: PolyProgram):
    return x.intersect_params(prog.context)


def _project_out_all_but(m: isl.Map, keep: list[int]) -> isl.Map:
    n = m.dim(isl.dim_type.out)
    for d in reversed(range(n)):
        if d not in keep:
            m = m.project_out(isl.dim_type.out, d, 1)
    return m


def _anon_range(m: isl.Map) -> isl.Map:
    return m.reset_tuple_id(isl.dim_type.out)


def _band_tensor(prog: PolyProgram) -> str:
    """isl name of the output tensor written last in program order (the band space)."""
    outs = {prog.tensors[v] for v in prog.outputs}
    for s in reversed(prog.statements):
        t = s.write.get_tuple_name(isl.dim_type.out)
        if t in outs:
            return t
    raise NotOneGroup("no statement writes a micro-graph output")


def _to_band_space(prog: PolyProgram, band_t: str) -> dict[str, isl.Map]:
    """Statement name -> relation from its instances to the band-tensor elements they feed."""
    rel: dict[str, isl.Map] = {}
    stmts = prog.statements
    side = _side_output_maps(prog, band_t)
    for k in reversed(range(len(stmts))):
        s = stmts[k]
        w = _ctxd(s.write, prog)
        t = w.get_tuple_name(isl.dim_type.out)
        acc = None
        for c in stmts[k + 1:]:
            for r in c.reads:
                if r.get_tuple_name(isl.dim_type.out) != t or c.node is s.node:
                    continue
                part = w.apply_range(_ctxd(r, prog).reverse()).apply_range(rel[c.name])
                acc = part if acc is None else acc.union(part)
        if t == band_t:
            acc = w if acc is None else acc.union(w)
        elif t in side:
            part = w.apply_range(side[t])
            acc = part if acc is None else acc.union(part)
        if acc is None:
            raise NotOneGroup(f"statement {s.name} ({s.node.op}) does not feed the final output")
        rel[s.name] = acc.coalesce()
    return rel


def _side_output_maps(prog: PolyProgram, band_t: str) -> dict[str, isl.Map]:
    """For each other micro-graph output U: U[u...] -> O[o...] matching the leading dims of
    equal size (a side output such as the row sums next to the normalised rows), O's other
    dims ranging over O.  Legality is checked later, so this only proposes an alignment."""
    names = prog.tensor_values
    oshape = prog.types[names[band_t]].shape
    out = {}
    for v in prog.outputs:
        t = prog.tensors[v]
        if t == band_t:
            continue
        ushape = prog.types[v].shape
        m = 0
        while m < min(len(ushape), len(oshape)) and ushape[m] == oshape[m]:
            m += 1
        u = [f"u{k}" for k in range(len(ushape))]
        o = [f"o{k}" for k in range(len(oshape))]
        cons = [f"o{k} = u{k}" for k in range(m)] + \
            [f"0 <= o{k} < {oshape[k]}" for k in range(m, len(oshape))]
        text = f"{{ {t}[{', '.join(u)}] -> {band_t}[{', '.join(o)}] : {' and '.join(cons) or 'true'} }}"
        out[t] = isl.Map(text, context=prog.ctx).align_params(prog.context.get_space())
    return out


def _single_valued_dims(m: isl.Map) -> list[int]:
    n = m.dim(isl.dim_type.out)
    return [d for d in range(n) if _project_out_all_but(m, [d]).is_single_valued()]


def _extent(s: isl.Set, d: int) -> int:
    lo = s.dim_min_val(d)
    hi = s.dim_max_val(d)
    return int(hi.to_python()) - int(lo.to_python()) + 1


# ----------------------------------------------------------------------------- direct

def build_fused_schedule(prog: PolyProgram, deps: Dependences) -> tuple[isl.Schedule, int, tuple]:
    """The directly built fused schedule tree, its outer band size and band extents.

    Steps: the live instances of each statement (:func:`_live_domains`), the shared parallel
    band (:func:`_shared_band`), each statement's residual inner dims (:func:`_residual_dims`),
    statements grouped into inner loop nests (:func:`_inner_groups`), then the tree, checked
    by isl.  Raises NotOneGroup when some statement does not feed the final output, when the
    tree is not one group, or when isl finds it illegal.
    """
    band_t = _band_tensor(prog)
    rel = _to_band_space(prog, band_t)
    live = _live_domains(prog, rel)
    band_dims, extents, bmap = _shared_band(prog, rel)
    resid = {s.name: _residual_dims(prog, s, bmap[s.name] if band_dims else None) for s in prog.statements}
    groups = _inner_groups(prog, deps, band_dims, bmap, resid)
    if not band_dims and sum(1 for g in groups if resid[g[0].name]) > 1:
        raise NotOneGroup("no shared parallel band and several loop nests")
    dom = isl.UnionSet.empty(prog.context.get_space())
    for s in prog.statements:
        dom = dom.union(isl.UnionSet.from_set(live[s.name]))
    tree = _tree_text(prog, dom, band_dims, bmap, groups, resid,
                      lambda s, width: _inner_map(s, resid[s.name]))
    sched = isl.Schedule(tree, context=prog.ctx)
    if not check_legal(sched, deps, prog):
        raise NotOneGroup("the directly built fused schedule violates a dependence")
    return sched, len(band_dims), extents


def _live_domains(prog: PolyProgram, rel: dict) -> dict:
    """Statement name -> the instances to execute: all of them when every instance maps into
    the band tensor, else only those that do (dead instances, e.g. rows a strided window never
    reads); NotOneGroup when a statement writing a final output has instances outside it."""
    outs = {prog.tensors[v] for v in prog.outputs}
    live = {}
    for s in prog.statements:
        if _ctxd(s.domain, prog).is_subset(rel[s.name].domain()):
            live[s.name] = s.domain
        elif s.write.get_tuple_name(isl.dim_type.out) in outs:
            raise NotOneGroup(f"statement {s.name} computes output elements of no final output")
        else:
            live[s.name] = s.domain.intersect(rel[s.name].domain().gist_params(prog.context))
    return live


def _shared_band(prog: PolyProgram, rel: dict) -> tuple[list, tuple, dict]:
    """``(band dims, their extents, statement name -> map onto the band)``: the band tensor's
    dims that every statement fixes to one value, less those of extent 1 (keepdims dims)."""
    stmts = prog.statements
    rank = rel[stmts[-1].name].dim(isl.dim_type.out)
    band_dims = [d for d in range(rank)
                 if all(d in _single_valued_dims(rel[s.name]) for s in stmts)]
    band_set = _ctxd(rel[stmts[-1].name], prog).range()
    band_dims = [d for d in band_dims if _extent(band_set, d) > 1] or band_dims[:0]
    extents = tuple(_extent(band_set, d) for d in band_dims)
    bmap = {s.name: _anon_range(_project_out_all_but(rel[s.name], band_dims)).gist_params(prog.context)
            for s in stmts}
    return band_dims, extents, bmap


def _residual_dims(prog: PolyProgram, s: Statement, band_map: isl.Map | None) -> list[int]:
    """The domain dims of ``s`` that the band value does not fix (its inner loops)."""
    inv = band_map.reverse() if band_map is not None else None
    dom = _ctxd(s.domain, prog)
    r = []
    for d in range(s.domain.dim(isl.dim_type.set)):
        if _extent(dom, d) == 1:
            continue
        if inv is not None and _project_out_all_but(inv, [d]).is_single_valued():
            continue
        r.append(d)
    return r


def _inner_map(s: Statement, dims: list[int]) -> isl.Map:
    """``s``'s domain onto its residual dims ``dims`` (its inner loop indices)."""
    m = isl.Map.identity(s.domain.get_space().map_from_set())
    m = _project_out_all_but(m, dims)
    return _anon_range(m).intersect_domain(s.domain)


def _inner_groups(prog: PolyProgram, deps: Dependences, band_dims: list, bmap: dict,
                  resid: dict) -> list[list[Statement]]:
    """Statements (inits first) in runs that share one inner loop nest: a statement joins the
    previous run when its residual rank matches and every dependence from the run's members
    to it is satisfied point by point under the band + inner schedule."""
    validity = _ctxd(deps.validity, prog)

    def full_map(s: Statement) -> isl.Map:
        b = bmap[s.name]
        if not resid[s.name]:
            return b if band_dims else isl.Map.from_domain(_ctxd(s.domain, prog))
        i = _ctxd(_inner_map(s, resid[s.name]), prog)
        return b.range_product(i).flatten_range() if band_dims else i

    def pointwise(a: Statement, b: Statement) -> bool:
        d = validity.intersect_domain(isl.UnionSet.from_set(_ctxd(a.domain, prog))) \
            .intersect_range(isl.UnionSet.from_set(_ctxd(b.domain, prog)))
        if d.is_empty():
            return True
        dm = isl.Map.from_union_map(d)
        t = dm.apply_domain(full_map(a)).apply_range(full_map(b))
        return t.is_subset(isl.Map.lex_le(t.get_space().domain()))

    stmts = prog.statements
    ordered = [s for s in stmts if s.role == INIT] + [s for s in stmts if s.role != INIT]
    groups: list[list[Statement]] = []
    for s in ordered:
        g = groups[-1] if groups else None
        if g is not None and len(resid[g[0].name]) == len(resid[s.name]) \
                and all(pointwise(a, s) for a in g):
            g.append(s)
        else:
            groups.append([s])
    return groups


def _ser(x) -> str:
    if isinstance(x, dict):
        return "{ " + ", ".join(f"{k}: {_ser(v)}" for k, v in x.items() if v is not None) + " }"
    if isinstance(x, list):
        return "[ " + ", ".join(_ser(v) for v in x) + " ]"
    if isinstance(x, str):
        return '"' + x + '"'
    return str(x)


def _tree_text(prog, domain, band_dims, bmap, groups, resid, inner_map) -> str:
    """YAML-like text of the fused tree: band (optional) -> sequence of groups."""
    def mupa(maps) -> str:
        u = isl.UnionMap.empty(prog.context.get_space())
        for m in maps:
            u = u.union(isl.UnionMap.from_map(m))
        return str(isl.MultiUnionPwAff.from_union_map(u))

    def filt(ss) -> str:
        u = isl.UnionSet.empty(prog.context.get_space())
        for s in ss:
            u = u.union(isl.UnionSet.from_set(isl.Set.universe(s.domain.get_space())))
        return str(u)

    def group_child(g):
        seq = {"sequence": [{"filter": filt([s])} for s in g]} if len(g) > 1 else None
        w = len(resid[g[0].name])
        if w:
            return {"schedule": mupa(inner_map(s, w) for s in g), "child": seq}
        return seq

    if len(groups) == 1:
        body = group_child(groups[0])
    else:
        body = {"sequence": [{"filter": filt(g), "child": group_child(g)} for g in groups]}
    if band_dims:
        body = {"schedule": mupa(bmap[s.name] for s in prog.statements), "permutable": 1,
                "coincident": [1] * len(band_dims), "child": body}
    return _ser({"domain": str(domain), "child": body})


def check_legal(sched: isl.Schedule, deps: Dependences, prog: PolyProgram) -> bool:
    """True if every validity dependence goes forward in ``sched``'s order.

    Maps each dependence pair to its pair of schedule times and checks it is lexicographically
    increasing (cheaper than building the whole schedule's lex-order relation)."""
    m = _ctxd(sched.get_map(), prog)
    dom = sched.get_domain()
    validity = _ctxd(deps.validity.intersect_domain(dom).intersect_range(dom), prog)
    if validity.is_empty():
        return True
    times = validity.apply_domain(m).apply_range(m)
    if times.is_empty():
        return True
    t = isl.Map.from_union_map(times)
    return t.is_subset(isl.Map.lex_lt(t.get_space().domain()))


# ----------------------------------------------------------------------------- isl scheduler

def isl_schedule(prog: PolyProgram, deps: Dependences) -> tuple[isl.Schedule, int, tuple]:
    """isl's own scheduler (whole-component, then defaults); the first one-group result.

    Run it inside :func:`budget`.  Raises NotOneGroup when neither option set gives one
    outer band over all statements.
    """
    ctx = prog.ctx
    dom = prog.domain()
    v = deps.validity
    sc = isl.ScheduleConstraints.on_domain(dom).set_context(prog.context) \
        .set_validity(v).set_proximity(v).set_coincidence(v)
    old = ctx.get_schedule_whole_component()
    try:
        for whole in (1, 0):
            ctx.set_schedule_whole_component(whole)
            sched = sc.compute_schedule()
            got = _one_group(sched, prog)
            if got is not None:
                return sched, got[0], got[1]
    finally:
        ctx.set_schedule_whole_component(old)
    raise NotOneGroup("the isl scheduler split the micro-graph into several groups")


def _one_group(sched: isl.Schedule, prog: PolyProgram):
    """(members, extents) of the outer band if it is one fusion group, else None.

    One group = an outer band over all statements whose leading members are coincident
    (no dependence crosses their iterations: the statements really share those loops; a
    band that only shifts one nest after the other is sequential in its first member)."""
    node = sched.get_root().child(0)
    if node.get_type() != isl.schedule_node_type.band:
        return None
    n = 0
    while n < node.band_n_member() and node.band_member_get_coincident(n):
        n += 1
    if n == 0:
        return None
    part = _ctxd(node.band_get_partial_schedule_union_map().intersect_domain(prog.domain()), prog)
    if part.is_empty():
        return None
    rng = isl.Set.from_union_set(part.range())
    extents = tuple(_extent(rng, d) for d in range(n))
    if not any(e > 1 for e in extents):
        return None
    return n, extents


# ----------------------------------------------------------------------------- tiling

def tile_outer_band(sched: isl.Schedule, band: int, sizes) -> isl.Schedule:
    """Tile the first ``band`` members of the outer band by ``sizes`` (one per member;
    a size of 0 or None, or a missing size, leaves that member untiled)."""
    if not band or not sizes:
        return sched
    node = sched.get_root().child(0)
    if node.get_type() != isl.schedule_node_type.band:
        return sched
    n = node.band_n_member()
    if n > 1 and not node.band_get_permutable():
        return sched          # tiling a non-permutable band would be illegal
    vals = [int(s) if s else 0 for s in list(sizes)[:n]] + [0] * max(0, n - len(sizes))
    if not any(vals):
        return sched
    big = 1 << 30
    vals = [v if v > 0 else big for v in vals]
    ctx = sched.get_ctx()
    ctx.set_tile_scale_tile_loops(0)     # unit-step tile loops: the loop IR has step 1 only
    ctx.set_tile_shift_point_loops(0)
    mv = isl.MultiVal.zero(node.band_get_space())
    for k, v in enumerate(vals):
        mv = mv.set_val(k, isl.Val.int_from_si(ctx, v))
    return node.band_tile(mv).get_schedule()


def bounded_isl_schedule(prog: PolyProgram, deps: Dependences, budget_ops: int,
                         seconds: float | None) -> tuple[isl.Schedule, int, tuple]:
    """:func:`isl_schedule` under ``budget_ops`` operations and ``seconds`` of wall time (a
    child process, killed when over; None = in-process).  Raises BudgetExceeded (either limit)
    or NotOneGroup."""
    def compute() -> str:
        with budget(prog.ctx, budget_ops):
            return str(isl_schedule(prog, deps)[0])
    from ..deadline import check as check_deadline, seconds_left
    where = f"{len(prog.statements)} statements writing {list(prog.outputs)[:3]}"
    check_deadline("layer 1 fusion (isl scheduler)", where)
    left = seconds_left()
    capped = left is not None and (seconds is None or left < seconds)
    try:
        text = run_bounded(compute, max(left, 1e-3) if capped else seconds)
    except WallTimeExceeded:
        if capped:      # the compile's deadline, not the scheduler's own limit: not a split
            check_deadline("layer 1 fusion (isl scheduler)", where)
        limit = max(left, 1e-3) if capped else seconds
        raise BudgetExceeded(f"isl scheduler stopped after the {limit:g} s wall-time limit") from None
    except ChildError as e:
        if e.kind == "BudgetExceeded":
            raise BudgetExceeded(e.message) from None
        if e.kind == "NotOneGroup":
            raise NotOneGroup(e.message) from None
        raise
    sched = isl.Schedule(text, context=prog.ctx)
    got = _one_group(sched, prog)
    if got is None:
        raise NotOneGroup("the isl scheduler's schedule is not one group")
    return sched, got[0], got[1]


def schedule_program(prog: PolyProgram, deps_fn, budget_ops: int, seconds: float | None = None,
                     use_isl: bool = True) -> tuple[FusedSchedule, Dependences]:
    """Dependences + one-group schedule of ``prog``, each step within ``budget_ops`` isl
    operations (the counter is reset before each step, as for each isl call in DESIGN §5),
    the isl scheduler also within ``seconds`` of wall time.

    ``deps_fn(prog)`` computes the dependences.  Tries the direct construction, then (unless
    ``use_isl`` is False) the isl scheduler.  Raises BudgetExceeded or NotOneGroup.
    """
    t0 = time.perf_counter()
    with budget(prog.ctx, budget_ops):
        deps = deps_fn(prog)
    try:
        with budget(prog.ctx, budget_ops):
            sched, nb, ext = build_fused_schedule(prog, deps)
        strategy = "direct"
    except NotOneGroup:
        if not use_isl:
            raise
        sched, nb, ext = bounded_isl_schedule(prog, deps, budget_ops, seconds)
        strategy = "isl"
    return FusedSchedule(sched, nb, ext, strategy, (time.perf_counter() - t0) * 1e3), deps
