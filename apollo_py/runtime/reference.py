"""The reference target's runner: a graph node by node through the numpy references.

The evaluator lives in :mod:`apollo_py.ops.evaluate`, below ``partition`` (whose constant
folding and micro-graph runner use it); this name is kept for the tests and scripts that call
the oracle as a runtime.
"""
from ..ops.evaluate import evaluate, run_nodes

__all__ = ["evaluate", "run_nodes"]
