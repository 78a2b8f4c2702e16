"""Auto-tuning with stored decisions (DESIGN §11; docs/design/tuning.md).

:func:`tune` times candidate decisions per piece of a model on its real shapes
(:mod:`.tuner`) and stores the winners in the tuning database (:mod:`.db`), keyed by piece and
machine; every later compile on this machine replays them without timing (``Options.tune``).
"""
from __future__ import annotations

from typing import Any, Mapping

from ..options import Options


def tune(model: Any, *, options: Options | None = None, input_shapes: Mapping[str, tuple] | None = None,
         feeds: Mapping | None = None, budget: float | None = None, repeat: int = 7,
         progress: bool | None = None, allow_load: bool = False):
    """Tune ``model`` (an ONNX path / bytes / ModelProto, a Graph or a Program) at
    ``input_shapes`` (needed for symbolic dims; default the static shapes) on ``feeds`` (default
    random inputs of those shapes); returns a :class:`~apollo_py.tuning.tuner.TuneResult`.
    ``allow_load``: store decisions timed while other processes held the cores (refused by
    default: tuning/load.py)."""
    from ..errors import InputError
    from .tuner import graph_for, tune_graph
    options = options or Options()
    program = _program(model, options)
    shapes = {}
    for s in program.inputs:
        shape = (input_shapes or {}).get(s.name) or (feeds[s.name].shape if feeds and s.name in feeds else s.dims)
        if not all(isinstance(d, int) for d in shape):
            raise InputError(f"input {s.name!r} has symbolic shape {s.describe()}: pass input_shapes= "
                             f"(on the command line: --shape {s.name}=D0,D1,...) to tune it")
        shapes[s.name] = tuple(shape)
    graph = graph_for(program, shapes, options)
    if not options.model_name:
        options = options.replace(model_name=getattr(program, "name", "") or "")
    return tune_graph(graph, options, feeds, budget=budget, repeat=repeat, progress=progress,
                      allow_load=allow_load)


def _program(model: Any, options: Options):
    """A Program of ``model`` (what ``apollo_py.api.load_program`` gives, without importing the
    api module, which imports this one for ``Options(tune="tune")``)."""
    from ..frontend.program import GraphProgram, Program
    from ..ir.graph import Graph
    if isinstance(model, Program):
        return model
    if isinstance(model, Graph):
        return GraphProgram(model)
    from ..frontend.onnx import load_onnx
    return load_onnx(model, options.cache_dir)


def ensure_tuned(program, shapes: Mapping[str, tuple], options: Options) -> None:
    """``Options(tune="tune")``: tune ``program`` at ``shapes`` unless the database already
    has a decision for each of its lowering groups on this machine."""
    from ..compiler import compile_graph
    from ..layers.lowering import lowering_groups
    from . import db
    from .tuner import graph_for, tune_graph
    graph = graph_for(program, shapes, options)
    known = db.decisions(options)
    plan = compile_graph(graph, options.replace(tune="replay")).plan
    _, _, keys = lowering_groups(plan.graph, plan.micro_graphs, options, known, with_keys=True)
    if keys and all(k in known for k in keys):
        return
    if not options.model_name:
        options = options.replace(model_name=getattr(program, "name", "") or "")
    tune_graph(graph, options)


__all__ = ["tune", "ensure_tuned"]
