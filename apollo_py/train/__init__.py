"""Training: reverse-mode autodiff over primitives, losses, optimizers and ``train_step``.

``grad(graph, wrt)`` differentiates a primitive graph; ``train_step(model, ...)`` compiles
forward + loss + backward + optimizer update into one graph (DESIGN §12).
"""
from .autodiff import grad
from . import optim

__all__ = ["grad", "optim", "train_step", "TrainStep"]


def __getattr__(name):
    if name in ("train_step", "TrainStep"):
        from . import step
        return getattr(step, name)
    raise AttributeError(name)
