"""``DataParallel``: synchronous data-parallel training on Ray actors.

Each of ``num_workers`` Ray actors holds a :class:`~.replica.Replica` (parameters, optimizer
state, compiled forward + backward and update).  A step splits the global batch along axis 0
into one shard per worker and makes ONE call per worker: the worker computes its scaled loss and
gradients, sums them with the other workers by ``ray.util.collective.allreduce`` (the GLOO
backend, i.e. torch.distributed's gloo, CPU), then applies the update in place.  The summed
buffer also carries an error count, so a worker whose forward failed still takes part in the
collective (with zeros) and NO worker applies that step: a failed batch leaves every replica
unchanged and identical, and the driver retries it once, then raises
:class:`~._ray.BatchFailedError` with the batch's index.

A worker that dies (or is killed) leaves its peers inside the collective; the driver then kills
and restarts every worker (``max_restarts``), forms a fresh collective group, loads the last
checkpoint (a ``state_dict`` taken every ``checkpoint_every`` steps, also written to
``checkpoint_dir`` if given) and replays the batches since that checkpoint, so no batch is lost.
"""
from __future__ import annotations

import os
import time
import uuid
from typing import Any, Iterable, Mapping

import numpy as np

from ..errors import InputError
from ._ray import BatchFailedError, DistributedError, ensure_ray, ray
from .replica import Replica, spec_from


class _Stale(Exception):
    """A call reached a worker of another generation (restarted, state not loaded)."""


class Worker:
    """The body of one data-parallel Ray actor (wrapped by ``ray.remote`` in :func:`_actor_class`)."""

    def __init__(self, spec):
        self.replica = Replica(spec)
        self.generation = None
        self.group = None

    def join(self, generation: int, world: int, rank: int, group: str, state) -> int:
        """Join collective group ``group`` as ``rank`` and load ``state`` (a state_dict)."""
        import ray.util.collective as col
        if self.group is not None and col.is_group_initialized(self.group):
            col.destroy_collective_group(self.group)
        col.init_collective_group(world, rank, backend="gloo", group_name=group)
        if state is not None:
            self.replica.load_state_dict(state)
        self.generation, self.group = generation, group
        return os.getpid()

    def step(self, generation: int, args: tuple, kwargs: dict, weight: float):
        """Gradients on this shard, summed over the group, then the update; returns (global loss
        or None, this worker's error or None, bytes all-reduced, seconds in the collective,
        seconds of forward + backward + update)."""
        import ray.util.collective as col
        if generation != self.generation:
            raise _Stale(f"worker of generation {self.generation} got a step of generation {generation}")
        params = self.replica.params
        err = None
        t_start = time.perf_counter()
        try:
            loss, grads = self.replica.grads(args, kwargs, weight)
        except Exception as e:   # reported through the collective, so no peer waits for us
            err, loss = f"{type(e).__name__}: {e}", 0.0
            grads = [np.zeros_like(p) for p in params]
        # one flat buffer per dtype (one collective call each); the first also carries the
        # error count and the loss
        groups: dict[str, list[int]] = {}
        for k, p in enumerate(params):
            groups.setdefault(p.dtype.name, []).append(k)
        total, t0 = 0, time.perf_counter()
        summed = [None] * len(params)
        meta = None
        for n, (dt, ks) in enumerate(groups.items()):
            extra = 2 if n == 0 else 0
            buf = np.empty(sum(params[k].size for k in ks) + extra, dtype=dt)
            off = extra
            for k in ks:
                buf[off:off + params[k].size] = grads[k].ravel()
                off += params[k].size
            if extra:
                buf[0], buf[1] = (1 if err else 0), loss
            col.allreduce(buf, group_name=self.group)
            total += buf.nbytes
            if extra:
                meta = (int(round(float(buf[0]))), float(buf[1]))
            off = extra
            for k in ks:
                summed[k] = buf[off:off + params[k].size].reshape(params[k].shape)
                off += params[k].size
        comm = time.perf_counter() - t0
        failed, global_loss = meta
        if failed:
            return None, err or f"{failed} other worker(s) failed", total, comm, 0.0
        self.replica.apply(summed)
        return global_loss, None, total, comm, time.perf_counter() - t_start - comm

    def state_dict(self) -> dict:
        return self.replica.state_dict()

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The id of the Ray node this worker runs on."""
        return ray().get_runtime_context().get_node_id()

    def destroy(self) -> None:
        import ray.util.collective as col
        if self.group is not None and col.is_group_initialized(self.group):
            col.destroy_collective_group(self.group)
        self.group = None


_ACTOR = None


def _actor_class():
    global _ACTOR
    if _ACTOR is None:
        # restarted by Ray when it dies; the driver then reloads the checkpoint (join)
        _ACTOR = ray().remote(max_restarts=-1, max_task_retries=0)(Worker)
    return _ACTOR


def _get_all(refs) -> list:
    """``ray.get(refs)``, but raising as soon as ANY of them failed: the peers of a dead worker
    wait inside the collective and would otherwise hold ``ray.get`` until gloo's timeout."""
    r = ray()
    pending = list(refs)
    while pending:
        done, pending = r.wait(pending, num_returns=1)
        r.get(done)
    return r.get(list(refs))


def _split(batch: np.ndarray, bounds) -> list:
    return [batch[a:b] for a, b in bounds]


class DataParallel:
    """Data-parallel training of a ``ap.train_step(...)`` or a loss function on Ray actors.

    ``DataParallel(ap.train_step(model, loss=..., optimizer=...), num_workers=2)`` starts from
    the train step's current parameters, optimizer state and step count;
    ``DataParallel(fn, num_workers, params=pytree, optimizer=opt)`` trains ``fn(params, *batch)
    -> mean loss`` (every positional batch argument is split along axis 0).  Call :meth:`step`
    like the train step (``labels=..., **inputs``) or like ``fn`` (``*batch``), or :meth:`fit`
    over an iterable of batches.  ``num_cpus`` per worker; ``options`` (default: the train
    step's, with ``num_threads=num_cpus``) for the workers' compiles.
    """

    def __init__(self, train_step_or_fn, num_workers: int = 2, *, params=None, optimizer=None,
                 options=None, num_cpus: float = 1, checkpoint_every: int = 10,
                 checkpoint_dir: str | None = None, max_recoveries: int = 3):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise InputError(f"DataParallel: num_workers must be an int >= 1, got {num_workers!r}")
        if not isinstance(checkpoint_every, int) or checkpoint_every < 1:
            raise InputError(f"DataParallel: checkpoint_every must be an int >= 1, got {checkpoint_every!r}")
        spec = spec_from(train_step_or_fn, params, optimizer, options)
        if spec.options is None or spec.options.num_threads is None:
            import dataclasses
            from ..options import Options
            base = spec.options if spec.options is not None else Options()
            spec.options = dataclasses.replace(base, num_threads=max(1, int(num_cpus)))
        self._fn_mode = spec.fn is not None
        self.num_workers = num_workers
        self.checkpoint_every = checkpoint_every
        self.checkpoint_dir = checkpoint_dir
        self.max_recoveries = max_recoveries
        self.recoveries = 0
        self.comm_bytes = 0          # bytes all-reduced by one worker at the last step
        self.comm_seconds = 0.0      # the slowest worker's seconds in the collective, last step
        self.compute_seconds = 0.0   # the slowest worker's forward + backward + update, last step
        self.worker_seconds = 0.0    # the longest worker's compute + collective, last step (the
                                     # rest of the step's wall time is Ray's: calls, transfers)
        r = ensure_ray()
        self._spec_ref = r.put(spec)
        self._workers = [_actor_class().options(num_cpus=num_cpus).remote(self._spec_ref)
                         for _ in range(num_workers)]
        self._group_id = uuid.uuid4().hex[:8]
        self._gen = 0
        self._checkpoint = Replica(spec).state_dict()
        self._since: list[tuple[int, tuple, dict]] = []   # batches applied since the checkpoint
        self._index = 0                                    # index of the next batch
        self._join(None)

    # -- group membership and recovery ------------------------------------------------------
    def _join(self, state) -> None:
        r = ray()
        self._gen += 1
        group = f"apollo_dp_{self._group_id}_{self._gen}"
        calls = [w.join.remote(self._gen, self.num_workers, k, group, state)
                 for k, w in enumerate(self._workers)]
        r.get(calls)

    def _recover(self, index: int, cause: BaseException) -> None:
        """Restart every worker, load the last checkpoint and replay the batches since it."""
        r = ray()
        self.recoveries += 1
        if self.recoveries > self.max_recoveries:
            raise DistributedError(f"DataParallel: gave up at batch {index} after "
                                   f"{self.max_recoveries} recoveries; last failure: {cause}") from cause
        for w in self._workers:   # peers of a dead worker wait in the collective: restart all
            r.kill(w, no_restart=False)
        deadline = time.monotonic() + 120
        while True:
            try:
                self._join(self._checkpoint)
                break
            except (r.exceptions.RayActorError, r.exceptions.ActorUnavailableError):
                if time.monotonic() > deadline:
                    raise DistributedError("DataParallel: workers did not come back within 120 s "
                                           f"after a failure at batch {index}") from cause
                time.sleep(0.2)
        for k, args, kwargs in self._since:
            loss, err = self._run(args, kwargs)
            if err is not None:
                raise BatchFailedError(k, f"DataParallel: batch {k} failed again while replaying "
                                          f"it after a recovery: {err}")

    # -- one step -----------------------------------------------------------------------------
    def _shards(self, args, kwargs):
        arrays = [np.asarray(a) for a in args] + [np.asarray(v) for v in kwargs.values()]
        if not arrays:
            raise InputError("DataParallel.step: no batch given")
        n = arrays[0].shape[0] if arrays[0].ndim else 0
        for a in arrays:
            if a.ndim == 0 or a.shape[0] != n:
                raise InputError(f"DataParallel.step: every batch input must have the same leading "
                                 f"(batch) dimension; got shapes {[x.shape for x in arrays]}")
        if n < self.num_workers:
            raise InputError(f"DataParallel.step: a batch of {n} cannot be split over "
                             f"{self.num_workers} workers")
        cuts = np.linspace(0, n, self.num_workers + 1).round().astype(int)
        bounds = list(zip(cuts[:-1], cuts[1:]))
        keys = list(kwargs)
        sa = [_split(np.asarray(a), bounds) for a in args]
        sk = {k: _split(np.asarray(kwargs[k]), bounds) for k in keys}
        return [(tuple(s[w] for s in sa), {k: sk[k][w] for k in keys}, (b - a) / n)
                for w, (a, b) in enumerate(bounds)]

    def _run(self, args, kwargs):
        """One step on every worker: (loss, None) or (None, error message).  Raises Ray's errors
        when a worker died."""
        calls = [w.step.remote(self._gen, a, k, wt)
                 for w, (a, k, wt) in zip(self._workers, self._shards(args, kwargs))]
        outs = _get_all(calls)
        errs = [o[1] for o in outs if o[1] is not None]
        if errs:
            return None, "; ".join(sorted(set(errs)))
        self.comm_bytes, self.comm_seconds = outs[0][2], max(o[3] for o in outs)
        self.compute_seconds = max(o[4] for o in outs)
        self.worker_seconds = max(o[3] + o[4] for o in outs)
        return outs[0][0], None

    def step(self, *args, **kwargs) -> float:
        """One synchronous data-parallel step on a global batch; returns the mean loss."""
        if self._fn_mode and not args:
            raise InputError("DataParallel.step: pass the batch positionally, as to fn(params, *batch)")
        if not self._fn_mode and args:
            raise InputError("DataParallel.step: pass labels=... and the model inputs by name")
        self._shards(args, kwargs)   # bad input is the caller's error: no retry, no recovery
        r = ray()
        index = self._index
        failures = 0
        while True:
            try:
                loss, err = self._run(args, kwargs)
                cause = err
            except (r.exceptions.RayActorError, r.exceptions.RayTaskError,
                    r.exceptions.ActorUnavailableError) as e:
                loss, cause = None, e
                self._recover(index, e)
            if loss is not None:
                break
            failures += 1
            if failures >= 2:    # retried once: report it, with its index
                self._index += 1
                raise BatchFailedError(index, f"DataParallel: batch {index} failed twice: {cause}")
        self._index += 1
        self._since.append((index, args, kwargs))
        if len(self._since) >= self.checkpoint_every:
            self.checkpoint()
        return loss

    __call__ = step

    def fit(self, batches: Iterable, epochs: int = 1) -> list[float]:
        """:meth:`step` over ``batches`` (``epochs`` times; a Sequence is needed for more than
        one): each batch a dict of keyword inputs (train step) or a tuple (loss function).
        Returns the losses."""
        losses = []
        for _ in range(epochs):
            for b in batches:
                losses.append(self.step(**b) if isinstance(b, Mapping) else self.step(*b))
        return losses

    # -- checkpoints ------------------------------------------------------------------------
    def checkpoint(self) -> dict:
        """Take a checkpoint now (rank 0's state_dict; also written to ``checkpoint_dir``)."""
        self._checkpoint = ray().get(self._workers[0].state_dict.remote())
        self._since = []
        if self.checkpoint_dir:
            save_state_dict(self._checkpoint, os.path.join(self.checkpoint_dir, "checkpoint.npz"))
        return self._checkpoint

    def state_dict(self, rank: int = 0) -> dict:
        """Worker ``rank``'s parameters, optimizer state and step count (TrainStep's form)."""
        return ray().get(self._workers[rank].state_dict.remote())

    def load_state_dict(self, sd: Mapping) -> None:
        """Load a state_dict into every worker (and make it the checkpoint)."""
        r = ray()
        for w in self._workers:
            r.get(w.destroy.remote())
        self._join(dict(sd))
        self._checkpoint, self._since = dict(sd), []

    def shutdown(self) -> None:
        """Stop the workers."""
        r = ray()
        for w in self._workers:
            r.kill(w, no_restart=True)
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def save_state_dict(sd: Mapping, path: str) -> None:
    """Write a state_dict as one .npz (atomically: temp file + rename)."""
    flat = {f"params/{k}": v for k, v in sd["params"].items()}
    flat.update({f"optimizer/{k}": v for k, v in sd["optimizer"].items()})
    flat["step"] = np.asarray(sd["step"])
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **flat)
    os.replace(tmp, path)


def load_state_dict(path: str) -> dict:
    """Read a state_dict written by :func:`save_state_dict`."""
    with np.load(path) as z:
        sd: dict[str, Any] = {"params": {}, "optimizer": {}, "step": int(z["step"])}
        for k in z.files:
            if k != "step":
                part, name = k.split("/", 1)
                sd[part][name] = z[k]
    return sd
