"""In-place optimizer steps for plain-Python training loops: ``opt.apply(params, grads)``.

``params`` and ``grads`` are matching pytrees (dicts, lists, tuples) of float numpy arrays,
e.g. the arguments and gradients of ``ap.jit(ap.value_and_grad(loss))``.  The update of every
parameter (and its optimizer state) is one compiled graph per signature, built from the
optimizer's own :meth:`~.optim.Optimizer.update` exactly as ``train_step`` builds it, and run
with :meth:`~apollo_py.api.CompiledGraph.run_updating`, which writes the new values straight
into the parameter and state arrays where the runtime allows it.  The step count and state live
on the optimizer instance (one instance per model, as in torch.optim).
"""
from __future__ import annotations

import numpy as np

from ..errors import InputError
from ..ir.builder import GraphBuilder
from ..ir.types import FLOAT_DTYPES


class _Slots:
    """Per-optimizer-instance state of :func:`apply`: step count, state arrays, compiled steps."""

    def __init__(self):
        self.t = 0
        self.state: dict[str, np.ndarray] = {}
        self.compiled: dict[tuple, object] = {}
        self.tree = None


def _update_fn(optimizer, specs, options):
    from ..api import jit
    from .scalars import _scalar_values, scalar_inputs
    b = GraphBuilder(f"{type(optimizer).__name__.lower()}_update")
    ps = [b.input(f"p{k}", s, d) for k, (s, d) in enumerate(specs)]
    gs = [b.input(f"g{k}", s, d) for k, (s, d) in enumerate(specs)]
    st = {f"p{k}.{slot}": b.input(f"p{k}.{slot}", s, d) for k, (s, d) in enumerate(specs)
          for slot in optimizer.state_spec()}
    scalars = scalar_inputs(optimizer, [d for _, d in specs])
    svals = {k: b.input(k, a.shape, a.dtype.name) for k, a in scalars.items()}
    new_p, new_s = [], []
    for k, (p, g) in enumerate(zip(ps, gs)):
        slots = {slot: st[f"p{k}.{slot}"] for slot in optimizer.state_spec()}
        np_, ns = optimizer.update(b, p, g, slots, _scalar_values(optimizer, specs[k][1], svals))
        new_p.append(np_)
        new_s.extend(ns[slot] for slot in optimizer.state_spec())
    return jit(b.build(new_p + new_s), options=options), list(st)


def apply(optimizer, params, grads, options=None) -> None:
    """One optimizer step: update the arrays of ``params`` in place from ``grads``."""
    from ..frontend.jit import flatten
    p_leaves, paths, tree = flatten(params, "params")
    g_leaves, _, g_tree = flatten(grads, "params")
    if tree != g_tree:
        raise InputError("optimizer.apply: grads must have the structure of params")
    specs = []
    for a, g, path in zip(p_leaves, g_leaves, paths):
        if not isinstance(a, np.ndarray) or a.dtype.name not in FLOAT_DTYPES:
            raise InputError(f"optimizer.apply: parameter {path!r} must be a float numpy array")
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise InputError(f"optimizer.apply: parameter {path!r} must be C-contiguous and writeable "
                             "(it is updated in place)")
        g = np.asarray(g)
        if g.shape != a.shape or g.dtype != a.dtype:
            raise InputError(f"optimizer.apply: gradient of {path!r} is {g.dtype}{list(g.shape)}, the "
                             f"parameter {a.dtype}{list(a.shape)}")
        specs.append((a.shape, a.dtype.name))
    slots = optimizer.__dict__.get("_apply_slots")
    if slots is None:
        slots = _Slots()
        object.__setattr__(optimizer, "_apply_slots", slots)  # frozen dataclass: state beside fields
    key = (tree, tuple(specs))
    if slots.tree is not None and slots.tree != key:
        raise InputError("optimizer.apply: this optimizer already steps parameters of another "
                         "structure or shape; use one optimizer instance per model")
    slots.tree = key
    hit = slots.compiled.get(key)
    if hit is None:
        hit = slots.compiled[key] = _update_fn(optimizer, specs, options)
        for k, (s, d) in enumerate(specs):
            for slot, arr in optimizer.init_state(np.zeros(s, d)).items():
                slots.state[f"p{k}.{slot}"] = arr
    fn, state_names = hit
    from .scalars import scalar_inputs
    feeds = {f"p{k}": a for k, a in enumerate(p_leaves)}
    feeds.update({f"g{k}": np.ascontiguousarray(g) for k, g in enumerate(g_leaves)})
    feeds.update(slots.state)
    feeds.update(scalar_inputs(optimizer, [d for _, d in specs], slots.t + 1))
    targets = [f"p{k}" for k in range(len(p_leaves))] + state_names
    fn.run_updating(dict(zip(fn.output_names, targets)), **feeds)
    slots.t += 1
