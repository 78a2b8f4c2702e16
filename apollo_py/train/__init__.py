"""Training: reverse-mode autodiff over primitives, losses, optimizers and ``train_step``.

``grad(graph, wrt)`` differentiates a primitive graph; ``train_step(model, ...)`` compiles
forward + loss + backward + optimizer update into one graph (DESIGN §12).
"""
from . import optim
from .autodiff import grad
from .step import TrainStep, train_step

__all__ = ["TrainStep", "grad", "optim", "train_step"]
