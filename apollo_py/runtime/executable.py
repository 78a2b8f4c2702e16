"""Executables: what codegen produces for one specialised graph."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from ..ir.graph import Graph
from .reference import evaluate


class ReferenceExecutable:
    """Runs the graph with the numpy references (``target="reference"``)."""

    def __init__(self, graph: Graph, plan):
        self.graph = graph
        self.plan = plan

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        return evaluate(self.graph, feeds)
