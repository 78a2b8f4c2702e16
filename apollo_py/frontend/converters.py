"""The table of ONNX converters (op type -> function), filled by the ``@converter`` decorator.

A module of its own so that the converter modules (``onnx_ops.py``, ``onnx_ops_index.py``)
register into it without importing each other; read it through :mod:`.onnx_ops`, which imports
every converter module.
"""
from __future__ import annotations

from typing import Callable

CONVERTERS: dict[str, Callable] = {}


def converter(*op_types: str):
    """Register the decorated function as the converter of ``op_types``."""
    def deco(fn):
        for t in op_types:
            CONVERTERS[t] = fn
        return fn
    return deco
