"""Optimizers written as primitive graphs, following ``torch.optim`` semantics.

An optimizer describes its per-parameter state (:meth:`Optimizer.state_spec`), the per-step
scalars it needs (:meth:`Optimizer.step_scalars`, computed on the host from the step count
``t``, 1 at the first step, exactly as torch computes them in Python floats) and appends the
update of one parameter to a builder (:meth:`Optimizer.update`).  The scalars are graph inputs
of shape (1,), so one compiled graph serves every step, and the update chains of different
parameters share no computed value: each stays its own micro-graph and fuses into one kernel
(a bias correction computed in the graph and shared by all chains tied them into one
micro-graph that layer 1 split into dozens of kernels).

* :class:`SGD`: ``g += wd*p``; with momentum ``buf = g`` at t = 1, else
  ``buf = momentum*buf + (1-dampening)*g``; ``g = g + momentum*buf`` if nesterov else ``buf``;
  ``p -= lr*g``.
* :class:`Adam`: ``g += wd*p``; ``m = lerp(m, g, 1-b1)``; ``v = b2*v + (1-b2)*g*g``;
  ``p -= lr/(1-b1**t) * m / (sqrt(v)/sqrt(1-b2**t) + eps)``.
* :class:`AdamW`: ``p *= 1 - lr*wd`` (decoupled decay), then the Adam update without ``wd``.
"""
from __future__ import annotations

import math
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

    def step_scalars(self, t: int) -> dict[str, float | bool]:
        """Per-step scalars at step ``t`` (1 at the first step), computed on the host.

        A float value reaches :meth:`update` as a (1,) value of the parameter's dtype (the
        Python float rounded once, as torch does with a Python scalar); a bool as a (1,) bool.
        The keys must not depend on ``t``.
        """
        return {}

    def update(self, b: GraphBuilder, p: Value, g: Value, state: Mapping[str, Value],
               scalars: Mapping[str, Value]) -> tuple[Value, dict[str, Value]]:
        """Append the update of parameter ``p`` with gradient ``g``; return (new p, new state).

        ``state`` holds the slot values of :meth:`state_spec`, ``scalars`` the values of
        :meth:`step_scalars` (shape (1,), broadcast against ``p``)."""
        raise NotImplementedError

    def apply(self, params, grads, options=None) -> None:
        """Update the float numpy arrays of pytree ``params`` in place from ``grads`` (one
        compiled step; the step count and state live on this instance): see :mod:`.apply`."""
        from .apply import apply
        apply(self, params, grads, options)

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

    def step_scalars(self, t):
        return {"first": t == 1} if self.momentum else {}

    def update(self, b, p, g, state, scalars):
        if self.weight_decay:
            g = b.add(g, b.mul(p, _c(b, self.weight_decay, p)))
        new_state = {}
        if self.momentum:
            buf = state["momentum_buffer"]
            later = b.add(b.mul(buf, _c(b, self.momentum, p)), b.mul(g, _c(b, 1 - self.dampening, p)))
            buf = b.where(scalars["first"], g, later)
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

    def step_scalars(self, t):
        b1, b2 = self.betas
        return {"step_size": self.lr / (1 - b1 ** t), "sqrt_bc2": math.sqrt(1 - b2 ** t)}

    def update(self, b, p, g, state, scalars):
        b1, b2 = self.betas
        p, g = self._decay(b, p, g)
        m = _lerp(b, state["exp_avg"], g, 1 - b1)
        v = b.add(b.mul(state["exp_avg_sq"], _c(b, b2, p)), b.mul(b.mul(g, g), _c(b, 1 - b2, p)))
        denom = b.add(b.div(b.sqrt(v), scalars["sqrt_bc2"]), _c(b, self.eps, p))
        new_p = b.sub(p, b.mul(scalars["step_size"], b.div(m, denom)))
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
