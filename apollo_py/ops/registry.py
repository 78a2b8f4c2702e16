"""The primitive-op registry.

Each primitive is one :class:`OpDef`: a shape/dtype rule, a numpy reference, and (for ops
whose class is computed, not declared) the isl iteration domain and access relations from which
:mod:`apollo_py.ops.classify` derives elementwise / broadcast / reduction.  Reorganising ops
(reshape, transpose, ...), compute-bound ops (matmul, conv) and data-dependent ops (gather) are
opaque by declaration, as DESIGN §4 prescribes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import ShapeError, UnsupportedOpError
from ..ir import optable
from ..ir.types import TensorType

# kinds an OpDef can declare
COMPUTED = "computed"          # class derived from access relations
REORGANIZE = "reorganize"      # reshape, transpose, slice, concat, pad -> opaque
COMPUTE_BOUND = "compute_bound"  # matmul, conv -> opaque (may take epilogues, rule 6)
DATA_DEPENDENT = "data_dependent"  # gather -> opaque
SOURCE = "source"              # constant: data, not computation
FALLBACK = "fallback"          # runs through an external reference implementation


@dataclass(frozen=True)
class Access:
    """isl text of an op's iteration domain, write relation and one read relation per input.

    Statement tuple is ``S``, the output tensor ``Out``, the k-th input ``In<k>``.  A read is
    ``None`` when it is not affine (data-dependent), which makes the op opaque.
    """

    domain: str
    write: str
    reads: tuple[str | None, ...]


@dataclass(frozen=True)
class OpDef:
    """Definition of one primitive op.

    ``infer(in_types, attrs) -> [TensorType]``, ``reference(arrays, attrs) -> [ndarray]``,
    ``access(in_types, out_types, attrs) -> Access`` (only for COMPUTED ops).  ``scalar`` names
    the loop-IR operation of an elementwise op; ``reducer`` the combining op of a reduction.
    ``attrs`` lists accepted attributes with defaults (``REQUIRED`` marks mandatory ones).
    """

    name: str
    kind: str
    infer: Callable[[Sequence[TensorType], Mapping[str, Any]], list[TensorType]]
    reference: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]]
    access: Callable[..., Access] | None = None
    arity: tuple[int, int | None] = (1, 1)
    attrs: Mapping[str, Any] = field(default_factory=dict)
    scalar: str | None = None
    reducer: str | None = None
    doc: str = ""


class _Required:
    def __repr__(self):
        return "REQUIRED"


REQUIRED = _Required()
_REGISTRY: dict[str, OpDef] = {}


def register(opdef: OpDef) -> OpDef:
    """Add ``opdef`` to the registry (a second definition of the same name is an error)."""
    if opdef.name in _REGISTRY:
        raise ValueError(f"primitive {opdef.name!r} registered twice")
    _REGISTRY[opdef.name] = opdef
    return opdef


def get_op(name: str, node: str = "") -> OpDef:
    """The OpDef called ``name``; UnsupportedOpError naming ``node`` if there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnsupportedOpError(name, node, "no primitive of that name") from None


def has_op(name: str) -> bool:
    return name in _REGISTRY


def all_ops() -> dict[str, OpDef]:
    """A copy of the registry: name -> OpDef."""
    return dict(_REGISTRY)


def normalize_attrs(opdef: OpDef, attrs: Mapping[str, Any], node: str = "") -> dict[str, Any]:
    """Fill defaults and reject unknown or missing attributes (ShapeError naming the node)."""
    out = {}
    where = f"node {node!r} ({opdef.name})" if node else f"op {opdef.name!r}"
    for k in attrs:
        if k not in opdef.attrs:
            raise ShapeError(f"{where}: unknown attribute {k!r}; accepted: {sorted(opdef.attrs)}")
    for k, default in opdef.attrs.items():
        if k in attrs:
            out[k] = attrs[k]
        elif default is REQUIRED:
            raise ShapeError(f"{where}: missing required attribute {k!r}")
        else:
            out[k] = default
    return out


def infer_types(opdef: OpDef, in_types: Sequence[TensorType], attrs: Mapping[str, Any],
                node: str = "") -> list[TensorType]:
    """Run the op's shape rule, turning any failure into a ShapeError that names the node."""
    lo, hi = opdef.arity
    where = f"node {node!r} ({opdef.name})" if node else f"op {opdef.name!r}"
    if len(in_types) < lo or (hi is not None and len(in_types) > hi):
        want = f"{lo}" if lo == hi else f"{lo}..{hi if hi is not None else 'n'}"
        raise ShapeError(f"{where}: takes {want} inputs, got {len(in_types)}")
    try:
        return list(opdef.infer(list(in_types), attrs))
    except ShapeError as e:
        raise ShapeError(f"{where}: {e}") from None
    except (ValueError, TypeError, IndexError, KeyError) as e:
        raise ShapeError(f"{where}: invalid operands {[str(t) for t in in_types]}: {e}") from None


class _RegistryTable:
    """This registry as the IR's :class:`~apollo_py.ir.optable.OpTable`."""

    def has(self, op: str) -> bool:
        return has_op(op)

    def names(self):
        return all_ops().keys()

    def doc(self, op: str) -> str:
        return get_op(op).doc

    def normalize_attrs(self, op, attrs, node=""):
        return normalize_attrs(get_op(op, node), attrs, node)

    def infer_types(self, op, in_types, attrs, node=""):
        return infer_types(get_op(op, node), in_types, attrs, node)


def provide_table() -> None:
    """Hand this registry to the IR as its op table.  ``ops/__init__`` calls it after every
    primitive has registered: provided at this module's import, a thread building a graph
    while another thread runs the first ``import apollo_py.ops`` could see a half-filled table
    and reject a valid op."""
    optable.provide(_RegistryTable())
