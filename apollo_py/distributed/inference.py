"""Batch inference on Ray Data: ``predictor(model, options)`` for ``Dataset.map_batches``.

``predictor`` returns a callable class; Ray Data builds one instance per actor, which compiles
the model once (``ap.jit``; at construction for the example batch's shapes when ``example=``
is given) and then serves every batch that actor gets.  Batches are dicts of
numpy arrays (``batch_format="numpy"``): the model's inputs are read from the columns of the
same names, its outputs are added as columns of their names, every other column (an id, say)
is passed through.  Symbolic batch dims are specialised per batch shape, as ``ap.jit`` does; a
short last batch compiles one more specialisation.

Compiled code reaches the actors in one of two ways:

* shared cache (``ship=False``): each actor compiles with ``options.cache_dir``; where the
  actors share that directory (one machine, or a shared file system) only the first compile of
  each piece does the work, the others read it from the piecewise cache;
* shipped pieces (``ship=True``, the default when ``example=`` is given): the driver compiles the
  model once for the example batch into a fresh cache directory, packs that directory's files
  (:mod:`.pieces`) into Ray's object store once, and each actor writes them into its own cache
  directory before compiling, so every actor's compile is a cache hit.

A batch whose run raises is retried once; a second failure raises
:class:`~._ray.BatchFailedError` naming the batch (by the first and last value of
``index_column`` when the data set has one, else the actor's batch count), never dropped.
"""
from __future__ import annotations

import dataclasses
import os
import tempfile
from typing import Any, Mapping

import numpy as np

from ..errors import InputError
from ..options import Options
from ._ray import BatchFailedError, ensure_ray, ray
from .pieces import pack, unpack


def _portable(model):
    """The model in a form that pickles: ONNX as serialized bytes (external data read in), a
    Graph as it is."""
    from ..ir.graph import Graph
    if isinstance(model, Graph):
        return model
    if isinstance(model, (bytes, bytearray)):
        return bytes(model)
    from ..frontend.onnx import _resolve_external_data, read_model_proto
    proto, base = read_model_proto(model, "distributed.predictor cannot load a model")
    return _resolve_external_data(proto, base).SerializeToString()


class _PredictorBase:
    """The per-actor body of a predictor; :func:`predictor` subclasses it with its settings."""

    _model: Any = None          # ObjectRef of the portable model
    _pieces: Any = None         # ObjectRef of the packed cache files, or None
    _options: Options | None = None
    _index_column: str | None = None
    _warm: dict | None = None   # input name -> (shape, dtype) of the example batch

    def __init__(self):
        r = ray()
        from ..api import jit
        options = self._options or Options()
        if self._pieces is not None:
            self.pieces_written = unpack(r.get(self._pieces), options.cache_dir)
        self.fn = jit(r.get(self._model), options=options)
        if self._warm:   # compile now (from the shipped pieces), not inside the first batch
            self.fn(**{k: np.zeros(s, d) for k, (s, d) in self._warm.items()})
        self.batches = 0

    def _label(self, batch) -> str:
        col = self._index_column
        if col and col in batch and len(batch[col]):
            return f"rows {col}={batch[col][0]!r}..{batch[col][-1]!r}"
        return f"batch {self.batches} of actor pid {os.getpid()}"

    def __call__(self, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        names = self.fn.input_names
        missing = [k for k in names if k not in batch]
        if missing:
            raise InputError(f"distributed.predictor: the batch has columns {sorted(batch)}, the "
                             f"model needs inputs {names} (missing {missing})")
        feeds = {k: np.ascontiguousarray(batch[k]) for k in names}
        where = self._label(batch)
        self.batches += 1
        try:
            outs = self.fn(**feeds)
        except Exception as first:   # retried once, then reported with the batch's index
            try:
                outs = self.fn(**feeds)
            except Exception as e:
                raise BatchFailedError(where, f"distributed.predictor: {where} failed twice: "
                                              f"{type(e).__name__}: {e} (first: {first})") from e
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        result = {k: v for k, v in batch.items() if k not in names}
        result.update(zip(self.fn.output_names, outs))
        return result


def predictor(model, options: Options | None = None, *, example: Mapping[str, np.ndarray] | None = None,
              ship: bool | None = None, index_column: str | None = None) -> type:
    """A callable class for ``ray.data.Dataset.map_batches(cls, concurrency=N,
    batch_format="numpy")`` that runs ``model`` (ONNX path/bytes/ModelProto or a Graph).

    ``example``: a batch (dict of input arrays) the driver compiles for and ships (see the
    module docs); ``ship``: force shipping (needs ``example``) or the shared cache (False).
    ``options.num_threads`` is each actor's thread count (None: every core of its node; match
    it to the actors' ``num_cpus``, as :func:`predict` does).
    ``index_column``: a column that names rows in error messages.  Ray is started if needed.
    """
    r = ensure_ray()
    if ship is None:
        ship = example is not None
    if ship and example is None:
        raise InputError("distributed.predictor: ship=True needs example= (a batch to compile for)")
    options = options if options is not None else Options()
    portable = _portable(model)
    pieces = None
    if ship:
        from ..api import jit
        with tempfile.TemporaryDirectory(prefix="apollo_py_ship_") as tmp:
            machine = os.path.join(options.cache_dir, "machine.json")
            if os.path.exists(machine):   # the driver's measured figures: no re-measuring
                with open(machine, "rb") as f, open(os.path.join(tmp, "machine.json"), "wb") as g:
                    g.write(f.read())
            fn = jit(portable, options=dataclasses.replace(options, cache_dir=tmp))
            fn(**{k: np.ascontiguousarray(v) for k, v in example.items()})
            pieces = r.put(pack(tmp))
    warm = None if example is None else {k: (np.shape(v), np.asarray(v).dtype.str)
                                         for k, v in example.items()}
    attrs = {"_model": r.put(portable), "_pieces": pieces, "_options": options,
             "_index_column": index_column, "_warm": warm}
    return type("ApolloPredictor", (_PredictorBase,), attrs)


def predict(dataset, model, options: Options | None = None, *, num_actors: int = 2,
            batch_size: int | None = None, num_cpus: float = 1, example=None, ship=None,
            index_column: str | None = None):
    """``dataset.map_batches`` with a :func:`predictor` on ``num_actors`` actors, in order: the
    output rows follow the input rows (``preserve_order`` is set on the data set's DataContext,
    which Ray Data captures when a data set is created and shares with the data sets derived
    from it).  Returns the lazy Dataset."""
    options = options if options is not None else Options()
    if options.num_threads is None:   # each actor's runtime threads: its CPUs, not every core
        options = dataclasses.replace(options, num_threads=max(1, int(num_cpus)))
    cls = predictor(model, options, example=example, ship=ship, index_column=index_column)
    out = dataset.map_batches(cls, concurrency=num_actors, batch_size=batch_size,
                              batch_format="numpy", num_cpus=num_cpus)
    out.context.execution_options.preserve_order = True
    return out
