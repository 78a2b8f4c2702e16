"""isl statements and dependences of a micro-graph (DESIGN §5).

Each primitive becomes one statement (elementwise / broadcast ops), or two (reductions and
window reductions: an ``init`` statement writing the identity and an ``update`` statement
folding one input element into the accumulator).  Domains use *symbolic* sizes: every distinct
bound ``d`` of a registry domain becomes a parameter ``N<d>``, and :attr:`PolyProgram.context`
fixes the parameters' values — the scheduler is much faster that way than with literal sizes.

Statement names are ``S<k>`` (compute / update of node k) and ``I<k>`` (init of node k);
tensors are ``T<k>`` in order of first appearance.  Every isl object is made in the program's
own context (one context per compile job; contexts are not thread-safe).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import islpy as isl

from ..errors import CompileError
from ..ir.graph import Node
from ..ir.types import TensorType
from ..ops.registry import COMPUTED, get_op

COMPUTE = "compute"
INIT = "init"
UPDATE = "update"


@dataclass(frozen=True, eq=False)
class Statement:
    """One isl statement: ``name`` over ``domain``, writing ``write`` (S -> tensor).

    ``reads[k]`` is the read relation of the node's k-th input; an update also reads its
    accumulator (``acc_read``).  ``reducer`` is set for init/update statements.
    """

    name: str
    index: int            # position of the node in the micro-graph
    node: Node
    role: str             # COMPUTE, INIT or UPDATE
    domain: isl.Set
    write: isl.Map
    reads: tuple
    acc_read: isl.Map | None = None
    reducer: str | None = None

    @property
    def out(self) -> str:
        return self.node.outputs[0]

    def all_reads(self) -> list[isl.Map]:
        rs = [r for r in self.reads]
        if self.acc_read is not None:
            rs.append(self.acc_read)
        return rs


@dataclass(frozen=True, eq=False)
class PolyProgram:
    """The statements of one micro-graph in one isl context, with their tensors.

    ``tensors`` maps value name -> isl tuple name; ``params`` parameter name -> value;
    ``context`` fixes the parameters.  ``order`` is the original program order (a schedule:
    statements in sequence, identity inside), used for dependence analysis.
    """

    ctx: isl.Context
    statements: tuple
    tensors: Mapping[str, str]
    types: Mapping[str, TensorType]
    inputs: tuple
    outputs: tuple
    params: Mapping[str, int]
    context: isl.Set

    @property
    def tensor_values(self) -> dict[str, str]:
        """isl tuple name -> value name."""
        return {t: v for v, t in self.tensors.items()}

    def stmt(self, name: str) -> Statement:
        for s in self.statements:
            if s.name == name:
                return s
        raise KeyError(name)

    def domain(self) -> isl.UnionSet:
        u = isl.UnionSet.empty(self.context.get_space())
        for s in self.statements:
            u = u.union(isl.UnionSet.from_set(s.domain))
        return u

    def writes(self) -> isl.UnionMap:
        return _union([s.write for s in self.statements], self.context)

    def reads(self) -> isl.UnionMap:
        return _union([r for s in self.statements for r in s.all_reads()], self.context)

    def order(self) -> isl.Schedule:
        """Program order: statements in sequence, each with its identity schedule inside."""
        dom = self.domain()
        sched = isl.Schedule.from_domain(dom)
        filters = isl.UnionSetList.alloc(self.ctx, len(self.statements))
        for s in self.statements:
            filters = filters.add(isl.UnionSet.from_set(isl.Set.universe(s.domain.get_space())))
        node = sched.get_root().child(0).insert_sequence(filters)
        for k, s in enumerate(self.statements):
            n = s.domain.dim(isl.dim_type.set)
            if n == 0:
                continue
            node = node.child(k).child(0)
            ident = isl.MultiUnionPwAff.from_union_map(isl.UnionMap.from_map(
                isl.Map.identity(s.domain.get_space().map_from_set()).intersect_domain(s.domain)))
            node = node.insert_partial_schedule(ident).parent().parent()
        return node.get_schedule()


def _union(maps, context) -> isl.UnionMap:
    u = isl.UnionMap.empty(context.get_space())
    for m in maps:
        u = u.union(isl.UnionMap.from_map(m))
    return u


_BOUND = re.compile(r"<\s*(\d+)\b")


def _parametrize(text: str, sizes: set[int]) -> tuple[str, set[int]]:
    """Replace ``< d`` bounds (d a tensor dim size > 1) by parameters ``N<d>``."""
    used: set[int] = set()

    def sub(m):
        d = int(m.group(1))
        if d in sizes and d > 1:
            used.add(d)
            return f"< N{d}"
        return m.group(0)

    return _BOUND.sub(sub, text), used


def _rename(text: str, stmt: str, out: str | None, ins: Sequence[str]) -> str:
    text = re.sub(r"\bS\[", f"{stmt}[", text)
    if out is not None:
        text = re.sub(r"\bOut\[", f"{out}[", text)
    for k, t in enumerate(ins):
        text = re.sub(rf"\bIn{k}\[", f"{t}[", text)
    return text


def _with_params(text: str, params: Sequence[str]) -> str:
    return f"[{', '.join(params)}] -> {text}" if params else text


def build_program(nodes: Sequence[Node], types: Mapping[str, TensorType], inputs: Sequence[str],
                  outputs: Sequence[str], ctx: isl.Context | None = None) -> PolyProgram:
    """Statements, accesses and context of a micro-graph of COMPUTED primitives.

    Expects ``nodes`` in topological order, each with one output, every value typed in
    ``types``; raises CompileError naming the node for an op that has no affine accesses.
    """
    ctx = ctx or isl.Context()
    tensors: dict[str, str] = {}

    def tname(v: str) -> str:
        if v not in tensors:
            tensors[v] = f"T{len(tensors)}"
        return tensors[v]

    for v in inputs:
        tname(v)
    raw = []          # (node index, node, opdef, Access)
    sizes: set[int] = set()
    for k, n in enumerate(_expand_index_maps(nodes, types)):
        if isinstance(n, tuple):     # a copy through a concat / slice / transpose / pad index map
            n, acc = n               # (a pad's border fill reads nothing)
            for v in (*n.inputs, n.outputs[0]):
                sizes.update(types[v].shape)
                tname(v)
            raw.append((k, n, get_op("stop_gradient"), acc))
            continue
        opdef = get_op(n.op, n.label)
        if opdef.kind != COMPUTED or opdef.access is None:
            raise CompileError(f"node {n.label!r} ({n.op}): layer 1 needs an op with affine "
                               f"accesses, {n.op!r} is {opdef.kind}")
        if len(n.outputs) != 1:
            raise CompileError(f"node {n.label!r} ({n.op}): layer 1 handles single-output ops")
        in_t = tuple(types[v] for v in n.inputs)
        out_t = tuple(types[v] for v in n.outputs)
        acc = opdef.access(in_t, out_t, n.attrs)
        if any(r is None for r in acc.reads):
            raise CompileError(f"node {n.label!r} ({n.op}): data-dependent access")
        for t in in_t + out_t:
            sizes.update(t.shape)
        for v in n.inputs:
            tname(v)
        tname(n.outputs[0])
        raw.append((k, n, opdef, acc))

    texts = []
    used: set[int] = set()
    for k, n, opdef, acc in raw:
        dom, u = _parametrize(acc.domain, sizes)
        used |= u
        texts.append(dom)
    params = [f"N{d}" for d in sorted(used)]
    pvals = {f"N{d}": d for d in sorted(used)}
    ctx_text = "{ : " + " and ".join(f"{p} = {v}" for p, v in pvals.items()) + " }" if params else "{ : }"
    context = isl.Set(_with_params(ctx_text, params), context=ctx)

    stmts = []
    for (k, n, opdef, acc), dom_text in zip(raw, texts):
        out = tensors[n.outputs[0]]
        ins = [tensors[v] for v in n.inputs]

        def mk_set(text, name):
            return isl.Set(_with_params(_rename(text, name, out, ins), params), context=ctx)

        def mk_map(text, name, dom):
            return isl.Map(_with_params(_rename(text, name, out, ins), params),
                           context=ctx).intersect_domain(dom)

        reducer = opdef.reducer or (n.attrs.get("reducer") if n.op == "window_reduce" else None)
        name = f"S{k}"
        domain = mk_set(dom_text, name)
        write = mk_map(acc.write, name, domain)
        reads = tuple(mk_map(r, name, domain) for r in acc.reads)
        if reducer is None:
            stmts.append(Statement(name, k, n, COMPUTE, domain, write, reads))
            continue
        # init statement over the output space: I<k>[o...] -> Out[o...]
        init_dom = write.range().set_tuple_name(f"I{k}")
        init_write = isl.Map.from_domain_and_range(init_dom, write.range()) \
            .intersect(_identity_like(init_dom, write.range()))
        stmts.append(Statement(f"I{k}", k, n, INIT, init_dom, init_write, (), None, reducer))
        stmts.append(Statement(name, k, n, UPDATE, domain, write, reads, write, reducer))
    return PolyProgram(ctx, tuple(stmts), dict(tensors), dict(types), tuple(inputs), tuple(outputs),
                       pvals, context)


#: reorganising ops that layer 1 takes as index maps (copy statements, _expand_index_maps)
INDEX_MAP_OPS = ("concat", "slice", "transpose", "pad")


def pad_as_index_map(n: Node) -> bool:
    """Whether layer 1 takes pad node ``n`` as an index map: constant mode, no cropping."""
    return n.op == "pad" and n.attrs["mode"] == "constant" and all(int(p) >= 0 for p in n.attrs["pads"])


def _pad_pieces(n: Node, types: Mapping[str, TensorType]) -> list:
    """A constant-mode pad as disjoint boxes: one copy of the input into the interior
    (``Out[i + begin]``) and, per padded dim ``d``, a fill of the slabs before and after the
    interior along ``d`` (dims before ``d`` restricted to the interior, so no element is
    written twice).  A fill piece is a ``stop_gradient`` with no input and the pad value in
    its attrs (codegen/scalar_ops.py writes the constant)."""
    from ..ops.access import domain_set, ivars, rel
    from ..ops.registry import Access
    if not pad_as_index_map(n):
        raise CompileError(f"node {n.label!r} (pad): layer 1 takes constant-mode pads without cropping only")
    src, dst = types[n.inputs[0]].shape, types[n.outputs[0]].shape
    r = len(src)
    pads = [int(p) for p in n.attrs["pads"]]
    begin, end = pads[:r], pads[r:]
    iv = ivars(r)
    out = [(n.replace(op="stop_gradient", attrs={}, name=f"{n.label}#in"),
            Access(domain_set(iv, src), rel(iv, "Out", [f"{x} + {b}" if b else x for x, b in zip(iv, begin)]),
                   (rel(iv, "In0", iv),)))]
    for d in range(r):
        for side, lo, hi in (("lo", 0, begin[d]), ("hi", begin[d] + src[d], dst[d])):
            if hi <= lo:
                continue
            cons = [f"{begin[k]} <= {iv[k]} < {begin[k] + src[k]}" if k < d else
                    f"{lo} <= {iv[k]} < {hi}" if k == d else f"0 <= {iv[k]} < {dst[k]}" for k in range(r)]
            dom = f"{{ S[{', '.join(iv)}] : {' and '.join(cons)} }}"
            piece = n.replace(op="stop_gradient", inputs=(), attrs={"value": float(n.attrs["value"])},
                              name=f"{n.label}#{side}{d}")
            out.append((piece, Access(dom, rel(iv, "Out", iv), ())))
    return out


def _expand_index_maps(nodes: Sequence[Node], types: Mapping[str, TensorType]) -> list:
    """``nodes`` with every concat, slice and transpose replaced by copy statements through
    their index maps (docs/design/stitching.md), as ``(piece node, Access)`` pairs:

    * ``concat``: one copy per input, writing the input's slice of the output
      (``Out[..., i_axis + offset, ...]``), so a producer in the same micro-graph writes
      straight into that slice and its own tensor becomes a scalar;
    * ``slice``: a copy over the output reading ``In0[start + step * i]`` per dim;
    * ``transpose``: a copy over the output reading ``In0`` through the permutation;
    * ``pad`` (constant mode): a copy into the interior and fills of the border slabs
      (:func:`_pad_pieces`);

    so a consumer in the same micro-graph reads through the map instead of a copied tensor."""
    from ..ops.access import domain_set, ivars, rel
    from ..ops.registry import Access
    out: list = []
    for n in nodes:
        if n.op not in INDEX_MAP_OPS:
            out.append(n)
            continue
        if n.op == "pad":
            out.extend(_pad_pieces(n, types))
            continue
        if n.op != "concat":
            src, dst = types[n.inputs[0]].shape, types[n.outputs[0]].shape
            iv = ivars(len(dst))
            if n.op == "transpose":
                perm = [int(p) for p in n.attrs["perm"]]
                idx = [iv[perm.index(d)] for d in range(len(src))]
            else:
                idx = []
                for d, (s0, e0, st) in enumerate(zip(n.attrs["starts"], n.attrs["ends"], n.attrs["steps"])):
                    start = slice(s0, None if e0 is not None and e0 < 0 else e0, st).indices(src[d])[0]
                    idx.append(f"{start} + {st}*{iv[d]}" if dst[d] > 1 else str(start))
            piece = n.replace(op="stop_gradient", attrs={}, name=f"{n.label}#map")
            out.append((piece, Access(domain_set(iv, dst), rel(iv, "Out", iv), (rel(iv, "In0", idx),))))
            continue
        ax, off = int(n.attrs["axis"]), 0
        for j, v in enumerate(n.inputs):
            shape = types[v].shape
            iv = ivars(len(shape))
            idx = [f"{x} + {off}" if d == ax and off else x for d, x in enumerate(iv)]
            piece = n.replace(op="stop_gradient", inputs=(v,), attrs={}, name=f"{n.label}#{j}")
            out.append((piece, Access(domain_set(iv, shape), rel(iv, "Out", idx), (rel(iv, "In0", iv),))))
            off += shape[ax]
    return out


def _identity_like(dom: isl.Set, rng: isl.Set) -> isl.Map:
    """{ I[x] -> T[x] } between two sets with the same dimension."""
    sp = isl.Space.map_from_domain_and_range(dom.get_space(), rng.get_space())
    return isl.Map.from_basic_map(isl.BasicMap.equal(sp, dom.dim(isl.dim_type.set)))


@dataclass(frozen=True, eq=False)
class Dependences:
    """Flow (read-after-write) and output (write-after-write) dependences; validity = both."""

    flow: isl.UnionMap
    output: isl.UnionMap

    @property
    def validity(self) -> isl.UnionMap:
        return self.flow.union(self.output)


def compute_dependences(prog: PolyProgram) -> Dependences:
    """Exact dataflow of ``prog`` in program order (``isl.UnionAccessInfo.compute_flow``).

    Output dependences are included because an accumulator is updated in place: later updates
    must stay after earlier ones and after the init.
    """
    order = prog.order()
    writes = prog.writes()
    info = isl.UnionAccessInfo.from_sink(prog.reads()).set_must_source(writes).set_schedule(order)
    flow = info.compute_flow().get_may_dependence()
    winfo = isl.UnionAccessInfo.from_sink(writes).set_must_source(writes).set_schedule(order)
    waw = winfo.compute_flow().get_may_dependence()
    return Dependences(flow, waw)
