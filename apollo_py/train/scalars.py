"""The optimizer's per-step scalars as graph inputs (shared by ``train_step`` and
``Optimizer.apply``): names ``optim.<name>`` for a bool, ``optim.<name>.<dtype>`` per parameter
dtype for a float, each of shape (1,), computed on the host from the step count."""
from __future__ import annotations

import numpy as np

SCALAR_PREFIX = "optim."


def scalar_inputs(optimizer, dtypes, t: int = 1) -> dict[str, np.ndarray]:
    """Input name -> (1,) array of every per-step scalar of ``optimizer`` at step ``t``, for
    parameters of the given dtypes (a float scalar once per dtype, a bool once)."""
    out = {}
    for k, v in optimizer.step_scalars(t).items():
        if isinstance(v, (bool, np.bool_)):
            out[f"{SCALAR_PREFIX}{k}"] = np.array([v], np.bool_)
        else:
            for dt in sorted(set(dtypes)):
                out[f"{SCALAR_PREFIX}{k}.{dt}"] = np.array([v], np.float64).astype(dt)
    return out


def _scalar_values(optimizer, dtype: str, inputs: dict) -> dict:
    vals = {}
    for k, v in optimizer.step_scalars(1).items():
        name = f"{SCALAR_PREFIX}{k}" if isinstance(v, (bool, np.bool_)) else f"{SCALAR_PREFIX}{k}.{dtype}"
        vals[k] = inputs[name]
    return vals
