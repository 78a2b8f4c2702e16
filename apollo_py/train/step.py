"""``train_step``: forward + loss + backward + optimizer update compiled as ONE graph.

Which constants become trainable parameters (unless ``params=`` names them explicitly):

* ONNX model: every initializer (an entry of ``graph.initializer``) of a float dtype and rank
  >= 1, except the running mean and variance of a ``BatchNormalization`` (inputs 3 and 4), which
  are statistics, not parameters.  Rank-0 float initializers (epsilons, exponents) and integer
  ones (shapes, indices) stay constants.
* Builder :class:`~apollo_py.ir.Graph`: every ``constant`` node of a float dtype with more than
  one element; the parameter is named after the constant's output value.

Parameters become graph inputs; the training graph takes the model inputs, ``labels``, the
parameters, the optimizer state and the optimizer's per-step scalars (``optim.<name>`` for a
bool, ``optim.<name>.<dtype>`` per parameter dtype for a float; shape (1,), computed on the host
from the step count by :meth:`Optimizer.step_scalars`) and returns the loss, the new parameters
and the new state.  It is specialised per input shape
on the first call with that shape and compiled with :func:`apollo_py.jit`.
"""
from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import ApolloError, InputError
from ..ir.builder import GraphBuilder
from ..ir.graph import Graph
from ..ir.types import FLOAT_DTYPES
from ..ir.verify import verify
from ..options import Options
from .autodiff import grad
from .graphs import replay
from .losses import LOSSES
from .optim import SGD, Optimizer

LABELS = "labels"
# the optimizer's per-step scalar inputs (shared with optim.apply, train/apply.py)
from .scalars import SCALAR_PREFIX, _scalar_values, scalar_inputs  # noqa: E402,F401


def _load_proto(model):
    """The model's ModelProto, read and checked by the front end's loader: malformed or truncated
    files and external data outside the model's folder raise ModelLoadError, and external
    tensors are read in (so the proto is self-contained)."""
    from ..frontend.onnx import _resolve_external_data, read_model_proto
    proto, base_dir = read_model_proto(model, "train_step cannot load a model")
    return _resolve_external_data(proto, base_dir)


def _onnx_params(proto, names: Sequence[str] | None):
    """(program with the chosen initializers turned into inputs, {name: initial array})."""
    import onnx
    from onnx import numpy_helper
    from ..frontend.onnx import load_onnx

    inits = {t.name: t for t in proto.graph.initializer}
    arrays = {k: numpy_helper.to_array(t) for k, t in inits.items()}
    if names is None:
        stats = {v for n in proto.graph.node if n.op_type == "BatchNormalization" for v in n.input[3:5]}
        names = [k for k, a in arrays.items()
                 if a.dtype.name in FLOAT_DTYPES and a.ndim >= 1 and k not in stats]
    for k in names:
        if k not in arrays:
            raise InputError(f"train_step: parameter {k!r} is not an initializer of the model; "
                             f"initializers are {sorted(arrays)}")
        if arrays[k].dtype.name not in FLOAT_DTYPES:
            raise InputError(f"train_step: parameter {k!r} has dtype {arrays[k].dtype}, not a float")
    chosen = set(names)
    mod = onnx.ModelProto()
    mod.CopyFrom(proto)
    keep = [t for t in mod.graph.initializer if t.name not in chosen]
    del mod.graph.initializer[:]
    mod.graph.initializer.extend(keep)
    declared = {vi.name for vi in mod.graph.input}
    for k in names:
        if k not in declared:
            mod.graph.input.append(onnx.helper.make_tensor_value_info(
                k, inits[k].data_type, list(arrays[k].shape)))
    return load_onnx(mod), {k: np.array(arrays[k], copy=True) for k in names}


def _graph_params(graph: Graph, names: Sequence[str] | None):
    """(graph with the chosen constants turned into inputs, {name: initial array})."""
    consts = {n.outputs[0]: n.attrs["value"].array for n in graph.nodes if n.op == "constant"}
    if names is None:
        names = [k for k, a in consts.items() if a.dtype.name in FLOAT_DTYPES and a.size > 1]
    for k in names:
        if k not in consts:
            raise InputError(f"train_step: parameter {k!r} is not a constant of graph {graph.name!r}")
        if consts[k].dtype.name not in FLOAT_DTYPES:
            raise InputError(f"train_step: parameter {k!r} has dtype {consts[k].dtype}, not a float")
    chosen = set(names)
    nodes = [n for n in graph.nodes if not (n.op == "constant" and n.outputs[0] in chosen)]
    g = graph.replace(inputs=tuple(graph.inputs) + tuple(names), nodes=tuple(nodes))
    verify(g)
    from ..frontend import GraphProgram
    return GraphProgram(g), {k: np.array(consts[k], copy=True) for k in names}


def build_train_graph(forward: Graph, params: Sequence[str], loss: str, optimizer: Optimizer,
                      labels_shape: tuple, labels_dtype: str) -> tuple[Graph, list[str]]:
    """The training graph of a forward graph whose inputs include ``params``.

    Inputs: forward inputs, ``labels``, optimizer state ``<param>.<slot>`` per parameter,
    the optimizer's per-step scalars (:func:`scalar_inputs`).  Outputs: loss, new parameters
    (in ``params`` order), new state (same order as the state inputs).  Returns (graph, state
    input names).
    """
    if loss not in LOSSES:
        raise InputError(f"train_step: unknown loss {loss!r}; choose one of {sorted(LOSSES)}")
    scalars = scalar_inputs(optimizer, [forward.types[p].dtype for p in params])
    for name in (LABELS, *scalars):
        if name in forward.inputs:
            raise InputError(f"train_step: the model has an input named {name!r}, which the "
                             "training step reserves")
    b = GraphBuilder(forward.name + "_loss")
    env = {v: b.input(v, forward.types[v].shape, forward.types[v].dtype) for v in forward.inputs}
    labels = b.input(LABELS, labels_shape, labels_dtype)
    vals = replay(b, forward, env)
    out = vals[forward.outputs[0]]
    loss_v = LOSSES[loss](b, out, labels)
    with_grads = grad(b.build([loss_v]), list(params))

    u = GraphBuilder(forward.name + "_train_step")
    env = {v: u.input(v, with_grads.types[v].shape, with_grads.types[v].dtype) for v in with_grads.inputs}
    state_names, state_vals = [], {}
    for p in params:
        for slot in optimizer.state_spec():
            name = f"{p}.{slot}"
            if name in env:
                raise InputError(f"train_step: optimizer state name {name!r} clashes with a model value")
            state_vals[name] = u.input(name, forward.types[p].shape, forward.types[p].dtype)
            state_names.append(name)
    # shape (1,), broadcast against each parameter; inputs, not computed values, so that the
    # update chains of different parameters share no node (each fuses into its own kernel)
    scalar_vals = {k: u.input(k, a.shape, a.dtype.name) for k, a in scalars.items()}
    vals = replay(u, with_grads, env, strip_stop_gradient=True)
    outs = [vals[o] for o in with_grads.outputs]
    new_params, new_state = [], []
    for p, g in zip(params, outs[1:]):
        st = {slot: state_vals[f"{p}.{slot}"] for slot in optimizer.state_spec()}
        np_, ns = optimizer.update(u, env[p], g, st,
                                   _scalar_values(optimizer, forward.types[p].dtype, scalar_vals))
        new_params.append(np_)
        new_state.extend(ns[slot] for slot in optimizer.state_spec())
    return u.build([outs[0]] + new_params + new_state), state_names


class TrainStep:
    """A compiled training step; call it (or :meth:`step`) with ``labels=`` and the model inputs.

    ``params`` maps parameter names to the live float arrays, updated in place by every step;
    ``state`` (the optimizer state, internal: :meth:`state_dict` returns copies) likewise.  The
    compiled step writes the new values straight into those arrays where the runtime proves it
    safe (:meth:`apollo_py.api.CompiledGraph.run_updating`), else they are copied in.
    """

    def __init__(self, program, proto, params: dict[str, np.ndarray], loss: str, optimizer: Optimizer,
                 target: str | None, options: Options | None):
        self.program = program
        self._proto = proto
        self.params = params
        self.loss = loss
        self.optimizer = optimizer
        self.target = target
        self.options = options
        self.t = 0
        self.state = {f"{p}.{slot}": arr for p, a in params.items()
                      for slot, arr in optimizer.init_state(a).items()}
        self._model_inputs = [s.name for s in program.inputs if s.name not in params]
        self._dtypes = [a.dtype.name for a in params.values()]
        self._compiled: dict[tuple, Any] = {}
        self._update_maps: dict[int, dict] = {}

    def graph_for(self, labels: np.ndarray, inputs: Mapping[str, np.ndarray]) -> Graph:
        """The training graph for these model-input and label shapes."""
        shapes = {k: tuple(np.shape(v)) for k, v in inputs.items()}
        shapes.update({k: a.shape for k, a in self.params.items()})
        forward = self.program.specialize(shapes)
        graph, _ = build_train_graph(forward, list(self.params), self.loss, self.optimizer,
                                     tuple(labels.shape), labels.dtype.name)
        return graph

    def _compiled_for(self, labels, inputs):
        key = (tuple(labels.shape), labels.dtype.name) + tuple(
            (k, tuple(np.shape(inputs[k]))) for k in self._model_inputs)
        fn = self._compiled.get(key)
        if fn is None:
            from ..api import jit
            fn = jit(self.graph_for(labels, inputs), target=self.target, options=self.options)
            self._compiled[key] = fn
        return fn

    def step(self, labels=None, **inputs) -> float:
        """Run one forward/backward/update step on a batch; return the loss as a float."""
        if labels is None:
            raise InputError("train_step: pass the batch's targets as labels=...")
        unknown = set(inputs) - set(self._model_inputs)
        missing = [k for k in self._model_inputs if k not in inputs]
        if unknown or missing:
            raise InputError(f"train_step: model inputs are {self._model_inputs}; got unknown "
                             f"{sorted(unknown)}, missing {missing}")
        labels = np.asarray(labels)
        fn = self._compiled_for(labels, inputs)
        feeds = {**inputs, LABELS: labels, **self.params, **self.state,
                 **scalar_inputs(self.optimizer, self._dtypes, self.t + 1)}
        n = len(self.params)
        # new parameters and state (outputs 1..) go straight into their arrays where the compiled
        # step allows it (runtime/inplace.py), else they are copied in: an in-place update also
        # saves the read-for-ownership of a fresh output (Adam's W1 update: 32 -> 22 MB moved)
        outs = fn.run_updating(self._updates(fn), **feeds)
        self.state = dict(zip(self.state, outs[1 + n:]))
        self.t += 1
        return float(outs[0])

    __call__ = step

    def _updates(self, fn) -> dict:
        """Output name -> input name for the new parameters and optimizer state of compiled
        step ``fn`` (outputs: loss, parameters, state, in the order of the inputs)."""
        ups = self._update_maps.get(id(fn))
        if ups is None:
            ups = self._update_maps[id(fn)] = dict(zip(fn.output_names[1:], [*self.params, *self.state]))
        return ups

    def state_dict(self) -> dict:
        """Copies of the parameters and optimizer state, and the number of steps taken."""
        return {"params": {k: v.copy() for k, v in self.params.items()},
                "optimizer": {k: v.copy() for k, v in self.state.items()},
                "step": self.t}

    def export_onnx(self, path) -> None:
        """Write the original ONNX model with its initializers replaced by the trained values."""
        if self._proto is None:
            raise ApolloError("export_onnx needs an ONNX model: this TrainStep was built from an "
                              "apollo_py Graph, which has no ONNX form to write back")
        import onnx
        from onnx import numpy_helper
        out = onnx.ModelProto()
        out.CopyFrom(self._proto)
        for t in out.graph.initializer:
            if t.name in self.params:
                old = numpy_helper.to_array(t)
                t.CopyFrom(numpy_helper.from_array(self.params[t.name].astype(old.dtype), t.name))
        onnx.save(out, os.fspath(path))


def train_step(model, loss: str = "cross_entropy", optimizer: Optimizer | None = None,
               params: Sequence[str] | None = None, target: str | None = None,
               options: Options | None = None) -> TrainStep:
    """Build a :class:`TrainStep` for ``model`` (ONNX path/bytes/ModelProto or a Graph).

    ``loss``: "cross_entropy" (logits (B, C), int labels (B,)) or "mse" (labels shaped like the
    output); the model's first output is the prediction.  ``optimizer`` defaults to
    ``SGD(lr=1e-3)``.  ``params`` names the trainable constants (default: see module docs).
    ``target``: where the step runs; None = ``options.target`` (default "cpu", as for ``jit``).
    """
    if loss not in LOSSES:
        raise InputError(f"train_step: unknown loss {loss!r}; choose one of {sorted(LOSSES)}")
    optimizer = optimizer if optimizer is not None else SGD(lr=1e-3)
    if not isinstance(optimizer, Optimizer):
        raise InputError(f"train_step: optimizer must be an apollo_py.optim optimizer, got "
                         f"{type(optimizer).__name__}")
    if isinstance(model, Graph):
        program, arrays = _graph_params(model, params)
        proto = None
    else:
        proto = _load_proto(model)
        program, arrays = _onnx_params(proto, params)
    if not arrays:
        raise InputError("train_step: the model has no trainable parameters")
    return TrainStep(program, proto, arrays, loss, optimizer, target, options)
