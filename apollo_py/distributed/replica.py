"""One data-parallel replica: compiled forward + backward, then the optimizer update.

A :class:`Replica` holds a copy of the parameters and of the optimizer state and does the two
halves of a data-parallel step that :class:`~apollo_py.train.TrainStep` does as one graph:

1. :meth:`Replica.grads` runs the compiled forward + loss + backward on its shard and returns
   the loss and the gradients, each scaled by the shard's share of the global batch
   (``n_shard / n_global``), so that the SUM over replicas is the gradient of the mean loss over
   the global batch, exactly as one process would compute it on the whole batch;
2. after the gradients are summed across replicas (by the caller's collective),
   :meth:`Replica.apply` runs the optimizer update, one compiled graph built by the optimizer's
   own ``update`` (:func:`apollo_py.train.apply._update_fn`), in place on the parameter and
   state arrays.

Every replica applies the same update to the same values, so parameters and optimizer state stay
bitwise identical across replicas.  Nothing here knows about Ray: the class is also the
single-process reference of the tests.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import InputError

LABELS = "labels"


def _grad_graph(program, params: list[str], loss: str, labels: np.ndarray, inputs: Mapping[str, Any]):
    """The graph ``(model inputs, labels, params) -> (loss, d loss / d param ...)`` of a
    train_step's program, specialised to these shapes (the first half of
    :func:`apollo_py.train.step.build_train_graph`, without the update)."""
    from ..ir.builder import GraphBuilder
    from ..train.autodiff import grad
    from ..train.graphs import replay
    from ..train.losses import LOSSES
    forward = program.specialize(inputs)
    b = GraphBuilder(forward.name + "_loss")
    env = {v: b.input(v, forward.types[v].shape, forward.types[v].dtype) for v in forward.inputs}
    lab = b.input(LABELS, tuple(labels.shape), labels.dtype.name)
    vals = replay(b, forward, env)
    return grad(b.build([LOSSES[loss](b, vals[forward.outputs[0]], lab)]), list(params))


@dataclasses.dataclass
class ModelSpec:
    """What a replica is built from; picklable, so it travels to Ray actors.

    Either a train_step's parts (``program``, ``loss``) or a Python loss function ``fn(params,
    *batch)`` (``fn``, ``tree``: the parameters' pytree, whose structure the replica flattens
    itself: a tree definition does not survive pickling).  ``names`` are the
    parameters' names (train_step: its parameter names; fn: pytree paths), ``params`` their
    initial values, ``state`` the optimizer state (``"<name>.<slot>"``) and ``t`` the step
    count to start from."""

    optimizer: Any
    names: list[str]
    params: list[np.ndarray]
    state: dict[str, np.ndarray]
    t: int = 0
    program: Any = None
    loss: str | None = None
    fn: Callable | None = None
    tree: Any = None
    target: str | None = None
    options: Any = None


def spec_from(train_step_or_fn, params=None, optimizer=None, options=None) -> ModelSpec:
    """The :class:`ModelSpec` of a :class:`~apollo_py.train.TrainStep` (its current parameters,
    optimizer state and step count) or of a loss function ``fn(params, *batch)`` with a
    ``params`` pytree of float arrays and an ``optimizer``."""
    from ..train.optim import Optimizer
    from ..train.step import TrainStep
    if isinstance(train_step_or_fn, TrainStep):
        ts = train_step_or_fn
        if params is not None or optimizer is not None:
            raise InputError("DataParallel: a train_step brings its own parameters and optimizer; "
                             "do not pass params= or optimizer=")
        names = list(ts.params)
        return ModelSpec(optimizer=dataclasses.replace(ts.optimizer), names=names,
                         params=[ts.params[k].copy() for k in names],
                         state={k: v.copy() for k, v in ts.state.items()}, t=ts.t,
                         program=ts.program, loss=ts.loss, target=ts.target,
                         options=options if options is not None else ts.options)
    if not callable(train_step_or_fn):
        raise InputError(f"DataParallel: expected an ap.train_step(...) or a loss function "
                         f"fn(params, *batch), got {type(train_step_or_fn).__name__}")
    if params is None or optimizer is None:
        raise InputError("DataParallel: a loss function needs params= (a pytree of float arrays) "
                         "and optimizer= (an ap.optim optimizer)")
    if not isinstance(optimizer, Optimizer):
        raise InputError(f"DataParallel: optimizer must be an apollo_py.optim optimizer, got "
                         f"{type(optimizer).__name__}")
    from ..frontend.jit import flatten
    leaves, paths, _ = flatten(params, "params")
    for a, p in zip(leaves, paths):
        if not isinstance(a, np.ndarray) or a.dtype.kind != "f":
            raise InputError(f"DataParallel: parameter {p!r} must be a float numpy array")
    opt = dataclasses.replace(optimizer)
    state = {f"{p}.{slot}": arr for p, a in zip(paths, leaves) for slot, arr in opt.init_state(a).items()}
    return ModelSpec(optimizer=opt, names=paths, params=[np.array(a, copy=True) for a in leaves],
                     state=state, fn=train_step_or_fn, tree=params, options=options)


class Replica:
    """The parameters, optimizer state and compiled functions of one data-parallel worker."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.params = [np.ascontiguousarray(a).copy() for a in spec.params]
        self.state = {k: v.copy() for k, v in spec.state.items()}
        self.t = spec.t
        self._grad_fns: dict[tuple, Any] = {}
        self._update = None
        self._vg = None
        self._treedef = None

    # -- forward + backward ---------------------------------------------------------------
    def grads(self, args: tuple, kwargs: dict, weight: float) -> tuple[float, list[np.ndarray]]:
        """(loss * weight, [gradient * weight per parameter]) on this shard."""
        if self.spec.fn is not None:
            loss, g = self._fn_grads(args, kwargs)
        else:
            loss, g = self._step_grads(kwargs)
        w = np.float64(weight)
        out = []
        for a, p in zip(g, self.params):
            a = np.asarray(a, dtype=p.dtype)
            out.append(a * a.dtype.type(w) if weight != 1.0 else a)
        return float(loss) * weight, out

    def _step_grads(self, kwargs):
        kwargs = dict(kwargs)
        labels = kwargs.pop(LABELS, None)
        if labels is None:
            raise InputError("DataParallel: pass the batch's targets as labels=...")
        labels = np.asarray(labels)
        key = (labels.shape, labels.dtype.name) + tuple(
            (k, np.shape(v), np.asarray(v).dtype.name) for k, v in sorted(kwargs.items()))
        fn = self._grad_fns.get(key)
        if fn is None:
            from ..api import jit
            shapes = {k: tuple(np.shape(v)) for k, v in kwargs.items()}
            shapes.update({k: a.shape for k, a in zip(self.spec.names, self.params)})
            graph = _grad_graph(self.spec.program, self.spec.names, self.spec.loss, labels, shapes)
            fn = self._grad_fns[key] = jit(graph, target=self.spec.target, options=self.spec.options)
        outs = fn(**kwargs, **{LABELS: labels}, **dict(zip(self.spec.names, self.params)))
        return outs[0], list(outs[1:])

    def _fn_grads(self, args, kwargs):
        from ..frontend.jit import flatten, unflatten
        if self._vg is None:
            from ..api import jit
            from ..train.transforms import value_and_grad
            self._vg = jit(value_and_grad(self.spec.fn), options=self.spec.options)
            self._treedef = flatten(self.spec.tree, "params")[2]
        loss, g = self._vg(unflatten(self._treedef, self.params), *args, **kwargs)
        return loss, flatten(g, "params")[0]

    # -- update ---------------------------------------------------------------------------
    def apply(self, grads: list[np.ndarray]) -> None:
        """One optimizer step from the (already summed) gradients, in place."""
        from ..train.apply import _update_fn
        from ..train.scalars import scalar_inputs
        opt = self.spec.optimizer
        dtypes = [p.dtype.name for p in self.params]
        if self._update is None:
            specs = [(p.shape, p.dtype.name) for p in self.params]
            self._update = _update_fn(opt, specs, self.spec.options)
        fn, state_names = self._update
        feeds = {f"p{k}": p for k, p in enumerate(self.params)}
        feeds.update({f"g{k}": np.ascontiguousarray(g) for k, g in enumerate(grads)})
        # _update_fn names the state "p<k>.<slot>"; ours is "<name>.<slot>" (TrainStep's names)
        ours = [f"{self.spec.names[k]}.{slot}" for k in range(len(self.params))
                for slot in opt.state_spec()]
        feeds.update({s: self.state[o] for s, o in zip(state_names, ours)})
        feeds.update(scalar_inputs(opt, dtypes, self.t + 1))
        # the new values are written into the parameter and state arrays (run_updating copies
        # them in where the compiled update cannot write in place)
        fn.run_updating(dict(zip(fn.output_names, [f"p{k}" for k in range(len(self.params))]
                                 + state_names)), **feeds)
        self.t += 1

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Copies of the parameters and optimizer state and the step count (TrainStep's form)."""
        return {"params": {k: p.copy() for k, p in zip(self.spec.names, self.params)},
                "optimizer": {k: v.copy() for k, v in self.state.items()}, "step": self.t}

    def load_state_dict(self, sd: Mapping) -> None:
        """Write a :meth:`state_dict` into this replica's arrays (shapes and names must match)."""
        params, state = sd.get("params", {}), sd.get("optimizer", {})
        missing = [k for k in self.spec.names if k not in params] + [k for k in self.state if k not in state]
        if missing:
            raise InputError(f"DataParallel.load_state_dict: the state dict lacks {missing}")
        for k, p in zip(self.spec.names, self.params):
            src = np.asarray(params[k])
            if src.shape != p.shape:
                raise InputError(f"DataParallel.load_state_dict: {k!r} is {list(src.shape)}, the "
                                 f"parameter {list(p.shape)}")
            np.copyto(p, src)
        for k, v in self.state.items():
            np.copyto(v, np.asarray(state[k]))
        self.t = int(sd.get("step", 0))
