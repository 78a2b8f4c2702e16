"""Refining a reshape-split region to one shape, so that layer 2 can stitch across the reshapes.

GroupNorm as exporters write it reshapes ``[N, C, H, W]`` to ``[N, G, C/G·H·W]`` (or
``[N, G, C/G, H, W]``), normalises over the trailing axes, reshapes back and applies a
per-channel affine with ``(C, 1, 1)`` constants.  The normalisation and the affine live in
two shapes whose dims do not line up (the reshape splits the channel axis), so layer 2 ends
its stitch group at the back reshape and the affine is a second kernel.

Every value of such a region is a row-major view of one set of *atoms*: the coarsest common
refinement of the shapes involved (``[N, G, C/G, H, W]`` here).  :func:`refine_reshapes`
rewrites the region so that all of its values have one shape over those atoms, with adjacent
atoms merged wherever no value tells them apart (``[N, G, C/G, H·W]``: the mean is 1 over
``C/G`` and ``H·W``, the scale over ``N`` and ``H·W``).  The reshapes inside the region vanish
(both sides are the same refined shape), reductions reduce the refined axes, constants are
reshaped at compile time, and every value read outside the region gets a reshape back to its
own shape (a view at run time).  Layer 2 then sees one x-reduce whose full-size consumers,
the affine included, share its row space: GroupNorm is one kernel.
"""
from __future__ import annotations

from math import prod

import numpy as np

from ..ir.graph import Attrs, ConstArray, Graph, Node
from ..ir.types import TensorType
from ..ops.registry import COMPUTED, get_op, has_op

_NOT_ELEMENTWISE = ("broadcast_to", "iota")


def _elementwise(op: str) -> bool:
    """An op computed per element with numpy broadcasting (add, exp, where, cast, ...)."""
    if op in _NOT_ELEMENTWISE or op.startswith("reduce_") or not has_op(op):
        return False
    d = get_op(op)
    return d.kind == COMPUTED and d.scalar is not None


def _atoms(a: tuple, b: tuple) -> tuple | None:
    """The coarsest common refinement of two shapes of one size (1-dims dropped), or None
    when their prefix products do not nest (``[6, 4]`` and ``[4, 6]``)."""
    def cuts(s):
        out, p = set(), 1
        for d in s:
            p *= d
            out.add(p)
        return out
    if prod(a) != prod(b) or prod(a) == 0:
        return None
    atoms, last = [], 1
    for c in sorted(cuts(a) | cuts(b)):
        if c == 1:
            continue
        if c % last:
            return None
        atoms.append(c // last)
        last = c
    return tuple(atoms)


def _group(shape: tuple, atoms: tuple) -> tuple | None:
    """Per dim of ``shape`` (a full-size value), the atom indices it covers; None if the
    shape does not split at atom boundaries."""
    groups, k = [], 0
    for d in shape:
        g, p = [], 1
        while p < d and k < len(atoms):
            p *= atoms[k]
            g.append(k)
            k += 1
        if p != d:
            return None
        groups.append(tuple(g))
    return tuple(groups) if k == len(atoms) else None


class _Region:
    """The values of one region with their layouts over the atoms: per value, the atom
    indices of each dim (``groups``) and, per atom, whether the value spans it (``full``; a
    reduced or broadcast atom has extent 1)."""

    def __init__(self, atoms):
        self.atoms = atoms
        self.groups: dict[str, tuple] = {}
        self.full: dict[str, tuple] = {}
        self.operands: dict[tuple, tuple] = {}  # (id(node), position) -> (value, full vector)
        self.nodes: list[Node] = []

    def add_full(self, v: str, shape: tuple) -> bool:
        g = _group(shape, self.atoms)
        if g is None:
            return False
        self.groups[v] = g
        self.full[v] = (True,) * len(self.atoms)
        return True

    def elementwise(self, n: Node, types) -> tuple | None:
        """(groups, full, operands) of ``n``'s output when it may join, else None;
        ``operands``: (input position, full vector) of each input from outside the region."""
        out_shape = types[n.outputs[0]].shape
        r = len(out_shape)
        groups: list = [None] * r
        for v in n.inputs:
            if v not in self.groups:
                continue
            g = self.groups[v]
            if len(g) > r:
                return None
            for j, gj in enumerate(g):
                jj = j + r - len(g)
                if gj:
                    if groups[jj] not in (None, gj):
                        return None
                    groups[jj] = gj
        for j, d in enumerate(out_shape):
            if groups[j] is None:
                if d != 1:
                    return None
                groups[j] = ()
        if tuple(k for g in groups for k in g) != tuple(range(len(self.atoms))):
            return None
        full = [False] * len(self.atoms)
        operands = []
        for pos, v in enumerate(n.inputs):
            if v in self.groups:
                f = self.full[v]
            else:
                s = types[v].shape
                if len(s) > r:
                    return None
                s = (1,) * (r - len(s)) + tuple(s)
                f = [False] * len(self.atoms)
                for j, g in enumerate(groups):
                    ext = prod(self.atoms[k] for k in g)
                    if s[j] == ext and ext != 1:
                        for k in g:
                            f[k] = True
                    elif s[j] != 1:
                        return None
                operands.append((pos, tuple(f)))
            full = [a or b for a, b in zip(full, f)]
        return tuple(groups), tuple(full), operands

    def refined(self, consts) -> list[tuple]:
        """The refined dims: runs of adjacent atoms that no region value tells apart, split
        further where an outside operand varies inside a run and cannot be expanded.

        A constant operand broadcast over part of a run is expanded (materialised) over that
        run when its expanded size stays within ``1 / EXPAND_RATIO`` of a full-size value
        (GroupNorm's ``(G, C/G)`` scale over the batch: ``N·C`` elements), so that ``N`` and
        ``G`` merge and the kernel has one rank less; isl's cost grows fast with the rank
        (a rank-4 GroupNorm goes over ``Options.schedule_budget``, rank 3 does not)."""
        n = len(self.atoms)
        vecs = list(self.full.values())
        cuts = {k for k in range(1, n) if any(f[k] != f[k - 1] for f in vecs)}
        limit = prod(self.atoms) // EXPAND_RATIO
        while True:
            runs = _runs(n, cuts)
            new = set()
            for v, f in self.operands.values():
                mixed = [run for run in runs if len({f[k] for k in run}) > 1]
                if not mixed:
                    continue
                size = prod(self.atoms[k] for k in range(n) if f[k])
                for run in sorted(mixed, key=lambda run: prod(self.atoms[k] for k in run if not f[k])):
                    factor = prod(self.atoms[k] for k in run if not f[k])
                    if v in consts and size * factor <= limit:
                        size *= factor
                    else:
                        new |= {k for k in run[1:] if f[k] != f[k - 1]}
            if new <= cuts:
                return runs
            cuts |= new

    @staticmethod
    def shape(full, dims, atoms) -> tuple:
        return tuple(prod(atoms[k] for k in d) if all(full[k] for k in d) else 1 for d in dims)


#: a constant operand is expanded over merged dims only while it stays this many times smaller
#: than a full-size value of the region (it is read once per element it spans)
EXPAND_RATIO = 16


def _runs(n: int, cuts: set) -> list[tuple]:
    """Atoms 0..n-1 cut before each index in ``cuts``: consecutive runs."""
    out, cur = [], [0]
    for k in range(1, n):
        if k in cuts:
            out.append(tuple(cur))
            cur = []
        cur.append(k)
    out.append(tuple(cur))
    return out


def _grow(seed: Node, graph: Graph, consts, taken) -> _Region | None:
    """The region that starts at reshape ``seed`` (in node order), or None when there is none
    worth refining: it must hold a reduction and either a reshape back whose result a region
    node computes with (the split that ends a stitch group), or a reduction over several axes
    that the refined shape merges into one (a lower rank is a cheaper schedule for isl)."""
    types = graph.types
    x, y = seed.inputs[0], seed.outputs[0]
    atoms = _atoms(types[x].shape, types[y].shape)
    if atoms is None or len(atoms) < 2:
        return None
    reg = _Region(atoms)
    if not reg.add_full(y, types[y].shape):
        return None
    reg.nodes.append(seed)
    inner_reshapes: set = set()
    has_reduce = crosses = False
    reductions = []
    start = graph.nodes.index(seed)
    for n in graph.nodes[start + 1:]:
        if id(n) in taken or len(n.outputs) != 1 or not any(v in reg.groups for v in n.inputs):
            continue
        out = n.outputs[0]
        if n.op == "reshape":
            v = n.inputs[0]
            if all(reg.full[v]) and reg.add_full(out, types[out].shape):
                reg.nodes.append(n)
                inner_reshapes.add(out)
        elif n.op.startswith("reduce_") and n.attrs["keepdims"] and n.inputs[0] in reg.groups:
            v = n.inputs[0]
            full = list(reg.full[v])
            for a in n.attrs["axes"]:
                for k in reg.groups[v][a]:
                    full[k] = False
            reg.groups[out], reg.full[out] = reg.groups[v], tuple(full)
            reg.nodes.append(n)
            has_reduce = True
            reductions.append((v, [a for a in n.attrs["axes"] if types[v].shape[a] > 1]))
        elif _elementwise(n.op):
            got = reg.elementwise(n, types)
            if got is None:
                continue
            reg.groups[out], reg.full[out], ops = got
            for pos, f in ops:
                reg.operands[(id(n), pos)] = (n.inputs[pos], f)
            reg.nodes.append(n)
            crosses = crosses or bool(inner_reshapes.intersection(n.inputs))
    if not has_reduce:
        return None
    if crosses:
        return reg
    # no reshape back inside: worth it only where a reduction over several axes reduces fewer
    # refined ones (GroupNormalization-18's [N, G, C/G, H, W] over (2, 3, 4) -> [N*G, C/G*H*W]
    # over 1); a region already refined is left as it is
    dims = reg.refined(consts)
    for v, axes in reductions:
        atoms_r = {k for a in axes for k in reg.groups[v][a]}
        if len(axes) > sum(1 for d in dims if atoms_r & set(d)):
            return reg
    return None


def refine_reshapes(graph: Graph, rebuild) -> Graph:
    """Rewrite every reshape-split region (module docstring) to its refined shape.

    Expects a verified graph with constants folded; returns a verified graph with the same
    inputs and outputs (the graph itself when no region qualifies).  ``rebuild`` is
    preprocess's ``_rebuild`` (this module must not import preprocess, which imports it)."""
    consts = {n.outputs[0]: n.attrs["value"].array for n in graph.nodes if n.op == "constant"}
    taken: set = set()
    regions = []
    for n in graph.nodes:
        if n.op == "reshape" and id(n) not in taken and n.inputs[0] not in consts:
            reg = _grow(n, graph, consts, taken)
            if reg is not None:
                regions.append(reg)
                taken.update(id(m) for m in reg.nodes)
    if not regions:
        return graph
    types = dict(graph.types)
    outs = set(graph.outputs)
    replace: dict[int, list] = {}
    used = set(types)

    def fresh(base: str) -> str:
        name, k = f"{base}_rf", 0
        while name in used:
            k += 1
            name = f"{base}_rf{k}"
        used.add(name)
        return name

    for reg in regions:
        dims = reg.refined(consts)
        in_region = {id(m) for m in reg.nodes}
        read_outside = {v for m in graph.nodes if id(m) not in in_region for v in m.inputs} | outs
        rf: dict[str, str] = {}
        for m in reg.nodes:
            out = m.outputs[0]
            t = types[out]
            shape = reg.shape(reg.full[out], dims, reg.atoms)
            new: list[Node] = []
            if m.op == "reshape" and m is not reg.nodes[0]:
                rf[out] = rf[m.inputs[0]]           # both sides are the refined shape
            else:
                rf[out] = fresh(out)
                types[rf[out]] = TensorType(shape, t.dtype)
                if m.op == "reshape":
                    new.append(m.replace(outputs=(rf[out],), attrs=m.attrs.with_(shape=shape)))
                else:
                    ins = [rf[v] if v in rf else
                           _operand(v, reg.operands[(id(m), pos)][1], m, reg, dims, types, consts, new, fresh)
                           for pos, v in enumerate(m.inputs)]
                    attrs = m.attrs
                    if m.op.startswith("reduce_"):
                        src = m.inputs[0]
                        atoms_r = {k for a in m.attrs["axes"] for k in reg.groups[src][a]}
                        attrs = attrs.with_(axes=tuple(i for i, d in enumerate(dims) if set(d) & atoms_r))
                    new.append(m.replace(inputs=tuple(ins), outputs=(rf[out],), attrs=attrs))
            if out in read_outside:
                new.append(Node("reshape", (rf[out],), (out,), Attrs({"shape": t.shape}),
                                name=f"{out}_unrefine", source=m.source))
            replace[id(m)] = new
    nodes = [k for n in graph.nodes for k in replace.get(id(n), [n])]
    return rebuild(graph.replace(types=types), nodes, {})


def _operand(v, full, m, reg, dims, types, consts, new, fresh) -> str:
    """An outside operand ``v`` of region node ``m`` (spanning the atoms where ``full``) in
    the refined shape: a reshaped constant, expanded over the refined dims it spans only in
    part (``_Region.refined`` allowed that), or a reshape node (a view) placed before ``m``."""
    t = types[v]
    atoms = reg.atoms
    span = [any(full[k] for k in d) for d in dims]
    shape = tuple(prod(atoms[k] for k in d) if sp else 1 for d, sp in zip(dims, span))
    if shape == tuple(t.shape):
        return v
    name = fresh(v)
    types[name] = TensorType(shape, t.dtype)
    if v in consts:
        arr = np.asarray(consts[v]).reshape([a if f else 1 for a, f in zip(atoms, full)])
        wide = [a if span[j] else 1 for j, d in enumerate(dims) for a in (atoms[k] for k in d)]
        arr = np.ascontiguousarray(np.broadcast_to(arr, wide)).reshape(shape)
        new.append(Node("constant", (), (name,), Attrs({"value": ConstArray(arr)}), name=name, source=m.source))
    else:
        new.append(Node("reshape", (v,), (name,), Attrs({"shape": shape}), name=name, source=m.source))
    return name
