"""The ``onnx_op`` primitive: run one ONNX node through ``onnx.reference``'s op implementation.

Standard ONNX ops that apollo_py does not decompose become an ``onnx_op`` node.  It is opaque
and not compilable: it splits clusters and runs as its own step between compiled pieces, and
the plan lists it as ``fallback`` with its ``reason``.  The node proto travels as hex text in
the attributes (so the node stays hashable); output types are fixed when the graph is
specialised.  It is defined here, in the front end, because running it needs
onnx.reference and the control-flow runner; the op registry below knows it only once the
front end is imported (``frontend/__init__`` does so).

Control-flow nodes (If, Loop, Scan) carry their subgraphs in the proto.  Their outer-scope
captures are extra inputs of the ``onnx_op`` node, after the node's own present inputs, named
by the ``captures`` attribute; the op class sees them as its ``context``.  The subgraphs run
through :class:`apollo_py.frontend.control_flow.SubgraphRunner` (compiled by apollo_py with the
Options recorded in ``options``), not through onnx.reference's evaluator.
"""
from __future__ import annotations

from ..errors import ShapeError
from ..ir.types import TensorType
from ..ops.registry import FALLBACK, REQUIRED, OpDef, register
from ..plan import BODY_PLANS


def has_reference(op_type: str, domain: str, opset: int) -> bool:
    """Whether onnx.reference implements ``op_type`` at ``opset``."""
    from onnx.reference.ops import load_op
    try:
        load_op(domain, op_type, opset)
        return True
    except (RuntimeError, ValueError, KeyError):  # "no such op": NotImplementedError, or
        return False                              # ValueError for an unknown domain


def _infer(ins, attrs):
    return [TensorType(tuple(shape), dtype) for shape, dtype in attrs["out_types"]]


def _reference(xs, attrs):
    from .control_flow import op_instance, run_op

    op, node = op_instance(attrs["node"], attrs["domain"], attrs["opset"], attrs.get("options", ()))
    captures = tuple(attrs.get("captures", ()))
    n_present = len(xs) - len(captures)
    outs = run_op(op, node, list(xs[:n_present]), dict(zip(captures, xs[n_present:])))
    if len(outs) < len(attrs["out_types"]):
        raise ShapeError(f"onnx.reference {node.op_type} returned {len(outs)} outputs, "
                         f"expected {len(attrs['out_types'])}")
    return list(outs[: len(attrs["out_types"])])


register(OpDef("onnx_op", FALLBACK, _infer, _reference, arity=(0, None),
               attrs={"node": REQUIRED, "domain": "", "opset": REQUIRED, "op_type": REQUIRED,
                      "out_types": REQUIRED, "reason": "", "captures": (), "options": ()},
               doc="an ONNX node run through onnx.reference (fallback; not compiled)"))


def _body_plans(node) -> list:
    """The plans of the subgraphs a control-flow ``onnx_op`` node compiled (for ``str(plan)``)."""
    if not node.attrs.get("options"):
        return []
    from .control_flow import body_plans, op_instance
    a = node.attrs
    return body_plans(op_instance(a["node"], a["domain"], a["opset"], a["options"])[0])


BODY_PLANS["onnx_op"] = _body_plans
