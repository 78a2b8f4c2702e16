"""Primitive ops (registry, references, access relations, classes) and compound decompositions."""
from .registry import OpDef, all_ops, get_op, has_op
from .classify import classify, CLASSES

__all__ = ["OpDef", "all_ops", "get_op", "has_op", "classify", "CLASSES"]
