"""Optimizers written as primitive graphs, following ``torch.optim`` semantics.

An optimizer describes its per-parameter state (:meth:`Optimizer.state_spec`) and appends the
update of one parameter to a builder (:meth:`Optimizer.update`).  The step count ``t`` (1 at the
first step) is a float64 rank-0 graph input, so one compiled graph serves every step; bias
corrections are computed from it in float64 and cast to the parameter dtype.

* :class:`SGD`: ``g += wd*p``; with momentum ``buf = g`` at t = 1, else
  ``buf = momentum*buf + (1-dampening)*g``; ``g = g + momentum*buf`` if nesterov else ``buf``;
  ``p -= lr*g``.
* :class:`Adam`: ``g += wd*p``; ``m = lerp(m, g, 1-b1)``; ``v = b2*v + (1-b2)*g*g``;
  ``p -= lr/(1-b1**t) * m / (sqrt(v)/sqrt(1-b2**t) + eps)``.
* :class:`AdamW`: ``p *= 1 - lr*wd`` (decoupled decay), then the Adam update without ``wd``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..errors import InputError
from ..ir.builder import GraphBuilder, Value
from .graphs import scalar


class Optimizer:
    """Base class: hyper-parameters are fields; subclasses define ``state_spec`` and ``update``."""

    def state_spec(self) -> tuple[str, ...]:
        """Names of the per-parameter state tensors (each shaped like the parameter)."""
        return ()

    def init_state(self, param: np.ndarray) -> dict[str, np.ndarray]:
        """Initial state of one parameter: zeros of its shape and dtype for every slot."""
        return {k: np.zeros_like(param) for k in self.state_spec()}

    def update(self, b: GraphBuilder, p: Value, g: Value, state: Mapping[str, Value],
               t: Value) -> tuple[Value, dict[str, Value]]:
        """Append the update of parameter ``p`` with gradient ``g``; return (new p, new state)."""
        raise NotImplementedError

    def _check(self):
        if self.lr < 0:
            raise InputError(f"{type(self).__name__}: learning rate must be >= 0, got {self.lr}")


def _c(b, v, like: Value) -> Value:
    return scalar(b, v, like.dtype)


def _lerp(b, start: Value, end: Value, w: float) -> Value:
    """``torch.lerp(start, end, w)`` with torch's two-sided formula (exact at w = 0 and 1)."""
    if w < 0.5:
        return b.add(start, b.mul(b.sub(end, start), _c(b, w, start)))
    return b.sub(end, b.mul(b.sub(end, start), _c(b, 1 - w, start)))


def _t_scalar(b: GraphBuilder, expr: Value, like: Value) -> Value:
    """Cast a float64 scalar expression of ``t`` to the parameter's dtype."""
    return expr if like.dtype == "float64" else b.cast(expr, to=like.dtype)


@dataclass(frozen=True)
class SGD(Optimizer):
    """Stochastic gradient descent (torch.optim.SGD)."""

    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self):
        self._check()
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InputError("SGD: nesterov momentum needs momentum > 0 and zero dampening")

    def state_spec(self):
        return ("momentum_buffer",) if self.momentum else ()

    def update(self, b, p, g, state, t):
        if self.weight_decay:
            g = b.add(g, b.mul(p, _c(b, self.weight_decay, p)))
        new_state = {}
        if self.momentum:
            buf = state["momentum_buffer"]
            later = b.add(b.mul(buf, _c(b, self.momentum, p)), b.mul(g, _c(b, 1 - self.dampening, p)))
            first = b.eq(t, scalar(b, 1.0, t.dtype))
            buf = b.where(first, g, later)
            new_state["momentum_buffer"] = buf
            g = b.add(g, b.mul(buf, _c(b, self.momentum, p))) if self.nesterov else buf
        return b.sub(p, b.mul(g, _c(b, self.lr, p))), new_state


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam (torch.optim.Adam, amsgrad=False); ``weight_decay`` is L2 added to the gradient."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self):
        self._check()
        if not all(0.0 <= bt < 1.0 for bt in self.betas):
            raise InputError(f"{type(self).__name__}: betas must lie in [0, 1), got {self.betas}")

    def state_spec(self):
        return ("exp_avg", "exp_avg_sq")

    def _decay(self, b, p, g):
        if self.weight_decay:
            g = b.add(g, b.mul(p, _c(b, self.weight_decay, p)))
        return p, g

    def update(self, b, p, g, state, t):
        b1, b2 = self.betas
        p, g = self._decay(b, p, g)
        m = _lerp(b, state["exp_avg"], g, 1 - b1)
        v = b.add(b.mul(state["exp_avg_sq"], _c(b, b2, p)), b.mul(b.mul(g, g), _c(b, 1 - b2, p)))
        one = scalar(b, 1.0, t.dtype)
        bc1 = b.sub(one, b.pow(scalar(b, b1, t.dtype), t))
        bc2 = b.sub(one, b.pow(scalar(b, b2, t.dtype), t))
        step_size = _t_scalar(b, b.div(scalar(b, self.lr, t.dtype), bc1), p)
        sqrt_bc2 = _t_scalar(b, b.sqrt(bc2), p)
        denom = b.add(b.div(b.sqrt(v), sqrt_bc2), _c(b, self.eps, p))
        new_p = b.sub(p, b.mul(step_size, b.div(m, denom)))
        return new_p, {"exp_avg": m, "exp_avg_sq": v}


@dataclass(frozen=True)
class AdamW(Adam):
    """AdamW (torch.optim.AdamW): decoupled weight decay ``p *= 1 - lr*wd`` before the update."""

    weight_decay: float = 1e-2

    def _decay(self, b, p, g):
        if self.weight_decay:
            p = b.mul(p, _c(b, 1 - self.lr * self.weight_decay, p))
        return p, g


__all__ = ["Optimizer", "SGD", "Adam", "AdamW"]
