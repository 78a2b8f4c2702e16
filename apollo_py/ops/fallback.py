"""Fallback primitive: run one ONNX node through ``onnx.reference``'s op implementation.

Standard ONNX ops that apollo_py does not decompose become an ``onnx_op`` node.  It is opaque
and not compilable: it splits clusters and runs as its own step between compiled pieces, and
the plan lists it as ``fallback``.  The node proto travels as hex text in the attributes (so the
node stays hashable); output types are fixed when the graph is specialised.
"""
from __future__ import annotations

from functools import lru_cache

from ..errors import ShapeError, UnsupportedOpError
from ..ir.types import TensorType
from .registry import FALLBACK, REQUIRED, OpDef, register


@lru_cache(maxsize=1024)
def _op_instance(node_hex: str, domain: str, opset: int):
    import onnx
    from onnx.reference import ReferenceEvaluator
    from onnx.reference.ops import load_op

    node = onnx.NodeProto()
    node.ParseFromString(bytes.fromhex(node_hex))
    try:
        cls = load_op(domain, node.op_type, opset)
    except Exception as e:  # onnx raises several types for "no such op"
        raise UnsupportedOpError(node.op_type, node.name, f"no lowering and no onnx.reference "
                                 f"implementation ({type(e).__name__})") from None
    run_params = {"log": lambda *a: None, "opsets": {domain: opset, "": opset}, "verbose": 0,
                  "new_ops": None, "existing_functions": {}, "evaluator_cls": ReferenceEvaluator}
    return cls(node, run_params), node


def has_reference(op_type: str, domain: str, opset: int) -> bool:
    """Whether onnx.reference implements ``op_type`` at ``opset``."""
    from onnx.reference.ops import load_op
    try:
        load_op(domain, op_type, opset)
        return True
    except Exception:
        return False


def _infer(ins, attrs):
    return [TensorType(tuple(shape), dtype) for shape, dtype in attrs["out_types"]]


def _reference(xs, attrs):
    op, node = _op_instance(attrs["node"], attrs["domain"], attrs["opset"])
    n_in = len(node.input)
    args = list(xs)
    # optional inputs given as "" in the proto are passed as None
    full, it = [], iter(args)
    for name in node.input[:n_in]:
        full.append(next(it) if name else None)
    outs = op.run(*full)
    if len(outs) < len(attrs["out_types"]):
        raise ShapeError(f"onnx.reference {node.op_type} returned {len(outs)} outputs, "
                         f"expected {len(attrs['out_types'])}")
    return list(outs[: len(attrs["out_types"])])


register(OpDef("onnx_op", FALLBACK, _infer, _reference, arity=(0, None),
               attrs={"node": REQUIRED, "domain": "", "opset": REQUIRED, "op_type": REQUIRED,
                      "out_types": REQUIRED},
               doc="an ONNX node run through onnx.reference (fallback; not compiled)"))
