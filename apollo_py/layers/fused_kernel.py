"""The record of one fused loop nest that layer 1 produces (:class:`FusedKernel`).

Kept apart from ``layer1.py`` so that unpickling one (the model cache's warm path,
``frontend/model_cache.py``) imports the loop IR only, not islpy and the poly passes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..codegen import loopir as L
from ..poly.reduce_forms import ReduceForm


@dataclass(frozen=True, eq=False)
class FusedKernel:
    """One fused loop nest produced by layer 1.

    ``loop`` is the loop-IR kernel; its params bind, in order, the values ``param_values``
    (``inputs`` that are not inlined constants, then ``outputs``).  ``nodes`` are the
    primitives it computes and ``micro_graphs`` the micro-graph(s) it came from.
    ``parallel_dims`` is the depth of the shared outer (coincident) band, ``band_extents``
    its extents, ``tile_sizes`` the tiles applied to it (``()`` = untiled); ``flops`` and
    ``bytes`` are estimates for the cost model; ``reduce_form`` the canonical form of its
    last reduction; ``strategy`` "direct" (built fused tree) or "isl" (isl scheduler);
    ``object_key`` the piecewise-cache key of its object code (set by layers/fuse_memo.py, so
    that codegen need not render the loop to find it).
    """

    loop: L.Kernel
    nodes: tuple
    inputs: tuple
    outputs: tuple
    param_values: tuple
    signature: str
    parallel_dims: int
    band_extents: tuple
    tile_sizes: tuple
    flops: int
    bytes: int
    reduce_form: ReduceForm | None
    strategy: str
    schedule_ms: float
    total_ms: float
    micro_graphs: tuple = ()
    consts: Mapping[str, Any] = field(default_factory=dict)
    object_key: str = ""    # piece key of the loop's object code (codegen/cached.py), when known
    #: > 0: the parallel loop is that many phases that must run in order (codegen/phased.py:
    #: the recurrent time loop); the runtime never splits it into concurrent ranges
    phases: int = 0

    @property
    def name(self) -> str:
        return self.loop.name

    def to_dict(self) -> dict:
        return {"name": self.name, "ops": [n.op for n in self.nodes], "inputs": list(self.inputs),
                "outputs": list(self.outputs), "signature": self.signature,
                "parallel_dims": self.parallel_dims, "band_extents": list(self.band_extents),
                "tile_sizes": list(self.tile_sizes), "flops": self.flops, "bytes": self.bytes,
                "reduce_form": self.reduce_form.to_dict() if self.reduce_form else None,
                "strategy": self.strategy, "schedule_ms": round(self.schedule_ms, 3)}
