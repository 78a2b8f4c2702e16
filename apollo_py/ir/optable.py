"""The op table the graph IR consults: what the builder and the verifier need to know of ops.

``ir`` sits below ``ops`` (docs/design/layers.md): it does not import the op registry.  It
states here what it asks of an op set, and :mod:`apollo_py.ops.registry` registers itself with
:func:`provide` when it is imported (``import apollo_py`` does that).  So the IR can be read,
and tested with a table of its own, without the op definitions, and a change to the op set
cannot make ``ir`` fail to import.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Protocol, Sequence

from ..errors import GraphError
from .types import TensorType


class OpTable(Protocol):
    """The questions the IR asks of an op set (names are primitive op names)."""

    def has(self, op: str) -> bool:
        """Whether ``op`` is defined."""

    def names(self) -> Iterable[str]:
        """Every defined op name."""

    def doc(self, op: str) -> str:
        """One line saying what ``op`` computes (becomes the builder method's docstring)."""

    def normalize_attrs(self, op: str, attrs: Mapping[str, Any], node: str = "") -> dict[str, Any]:
        """``attrs`` with defaults filled; ShapeError naming ``node`` for unknown or missing ones;
        UnsupportedOpError naming ``node`` when ``op`` is not defined."""

    def infer_types(self, op: str, in_types: Sequence[TensorType], attrs: Mapping[str, Any],
                    node: str = "") -> list[TensorType]:
        """The output types of ``op`` on ``in_types``; ShapeError naming ``node`` otherwise."""


_table: OpTable | None = None


def provide(table: OpTable) -> None:
    """Make ``table`` the op set the IR consults (the op registry calls this on import)."""
    global _table
    _table = table


def op_table() -> OpTable:
    """The registered op table; GraphError when none is (``apollo_py.ops`` not imported)."""
    if _table is None:
        raise GraphError("no op table is registered: import apollo_py.ops (import apollo_py does) "
                         "before building or verifying graphs")
    return _table
