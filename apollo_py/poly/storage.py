"""Storage of the tensors of a scheduled micro-graph: parameters, scalars or small tiles.

An intermediate tensor (produced and consumed inside the micro-graph) never becomes a full
buffer.  With the final schedule, find the deepest prefix of the schedule dims within which
every element of the tensor is both written and read (all accesses to one element share the
first ``level`` schedule values); the elements touched within one prefix iteration fit a box
of ``extents``.  A one-element box is a scalar (``Local``); otherwise a tile (``Alloc``)
addressed by ``index mod extent`` per dim — injective inside one prefix iteration, and an
element's lifetime never crosses prefix iterations, so reuse across iterations is safe.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import islpy as isl

from .statements import PolyProgram

PARAM = "param"
SCALAR = "scalar"
TILE = "tile"


@dataclass(frozen=True)
class Storage:
    """Where one tensor lives: ``kind`` PARAM (kernel argument), SCALAR or TILE.

    ``extents`` are the tile's per-dim extents (TILE), ``level`` the schedule prefix depth
    the tensor is private to (SCALAR/TILE).
    """

    value: str
    kind: str
    shape: tuple
    extents: tuple = ()
    level: int = 0

    @property
    def size(self) -> int:
        return prod(self.extents) if self.kind == TILE else (1 if self.kind == SCALAR else prod(self.shape))


class StorageError(Exception):
    """An intermediate tensor would need a tile larger than allowed."""


def _accesses(prog: PolyProgram, tname: str) -> isl.UnionMap:
    u = isl.UnionMap.empty(prog.context.get_space())
    for s in prog.statements:
        for m in [s.write] + s.all_reads():
            if m.get_tuple_name(isl.dim_type.out) == tname:
                u = u.union(isl.UnionMap.from_map(m.intersect_params(prog.context)))
    return u


def _zero_dim(deltas: isl.Set, d: int) -> bool:
    n = deltas.dim(isl.dim_type.set)
    proj = deltas.project_out(isl.dim_type.set, d + 1, n - d - 1).project_out(isl.dim_type.set, 0, d)
    zero = isl.Set.universe(proj.get_space()).fix_val(isl.dim_type.set, 0, isl.Val.zero(proj.get_ctx()))
    return proj.is_subset(zero)


def plan_storage(prog: PolyProgram, schedule: isl.Schedule, max_tile: int = 1 << 16) -> dict[str, Storage]:
    """Storage of every tensor of ``prog`` under ``schedule`` (value name -> Storage).

    Inputs and outputs are PARAMs; intermediates SCALARs or TILEs.  Raises StorageError when an
    intermediate needs a tile of more than ``max_tile`` elements.
    """
    sched = schedule.get_map().intersect_params(prog.context)
    out: dict[str, Storage] = {}
    boundary = set(prog.inputs) | set(prog.outputs)
    for value, tname in prog.tensors.items():
        shape = tuple(prog.types[value].shape)
        if value in boundary:
            out[value] = Storage(value, PARAM, shape)
            continue
        acc = _accesses(prog, tname)
        if acc.is_empty():
            continue
        if not shape or prod(shape) == 1:
            out[value] = Storage(value, SCALAR, shape, (1,) * len(shape), 0)
            continue
        e = isl.Map.from_union_map(acc.apply_domain(sched))       # time -> element
        pairs = e.apply_range(e.reverse())                          # time -> time, same element
        deltas = pairs.deltas()
        n = deltas.dim(isl.dim_type.set)
        level = 0
        while level < n and _zero_dim(deltas, level):
            level += 1
        pk = e.project_out(isl.dim_type.in_, level, n - level)     # prefix -> element
        fd = pk.reverse().apply_range(pk).deltas()                   # element deltas, same prefix
        extents = []
        for d in range(len(shape)):
            mx = fd.dim_max_val(d).to_python()
            extents.append(min(int(mx) + 1, shape[d]))
        extents = tuple(extents)
        if prod(extents) == 1:
            out[value] = Storage(value, SCALAR, shape, extents, level)
        elif prod(extents) <= max_tile:
            out[value] = Storage(value, TILE, shape, extents, level)
        else:
            raise StorageError(f"intermediate {value!r} {list(shape)} needs a tile of "
                               f"{list(extents)} elements per iteration (limit {max_tile})")
    return out
