"""Partition stage (DESIGN §4): preprocess, clusters, classification, aggregation by rules.

``partition(graph, options)`` is the pass the pipeline calls: Graph -> tuple[MicroGraph].
"""
from __future__ import annotations

from ..ir.graph import Graph
from ..options import Options
from .aggregate import aggregate
from .clusters import canonical_order, classify_node, find_clusters, is_compilable
from .micrograph import MicroGraph
from .preprocess import (eliminate_common_subexpressions, eliminate_dead_code, fold_constants, preprocess,
                         simplify_algebra)
from .rules import Rule, RuleTable, load_rules
from .signature import pattern_signature


def partition(graph: Graph, options: Options) -> tuple[MicroGraph, ...]:
    """Micro-graphs of a verified primitive graph, by the rule table (plus the user overlay
    named in ``options.rules_overlay``), in a topological order of the micro-graph DAG."""
    return aggregate(graph, load_rules(options.rules_overlay))


__all__ = ["MicroGraph", "Rule", "RuleTable", "aggregate", "canonical_order", "classify_node",
           "eliminate_common_subexpressions", "eliminate_dead_code", "find_clusters", "fold_constants",
           "is_compilable", "load_rules", "partition", "pattern_signature", "preprocess", "simplify_algebra"]
