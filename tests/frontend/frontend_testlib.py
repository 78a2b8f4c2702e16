"""Helpers shared by the model-cache and packed-store tests (tests/frontend/conftest.py puts this
folder on ``sys.path``; the ``stats`` fixture is in conftest.py)."""
import numpy as np


def rel_err(got, want) -> float:
    """max|got - want| / max|want|: the zoo's error measure."""
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))
