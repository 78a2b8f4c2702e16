"""Shared fixtures of the codegen tests.

The suite runs with ``--import-mode=importlib``, so this folder is put on ``sys.path`` for
the test modules to share the kernel builders in ``codegen_kernels.py``.
"""
import os
import sys

import numpy as np
import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
