"""Primitive ops (registry, references, access relations, classes) and compound decompositions.

Importing the package registers every primitive (``primitives`` and ``structural`` call
:func:`~apollo_py.ops.registry.register` on import), so any ``apollo_py.ops.*`` import sees the
full op set; the registry module itself imports no op definitions.
"""
from .registry import OpDef, all_ops, get_op, has_op
from . import primitives  # noqa: F401  (registers the primitives; primitives imports structural)
from . import recurrent  # noqa: F401  (registers the recurrent primitive of LSTM / GRU / RNN)
from . import resize2d  # noqa: F401  (registers the resize2d primitive of bilinear / nearest Resize)
from .classify import classify, CLASSES
from .registry import provide_table

provide_table()     # last: the IR sees the op table only once every primitive is in it

__all__ = ["OpDef", "all_ops", "get_op", "has_op", "classify", "CLASSES"]
