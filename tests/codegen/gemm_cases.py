"""Generated-GEMM test cases shared by tests/codegen/test_gemm_*.py: a random product
``x @ y`` (float32 inputs, float64 reference), optionally with a bias + relu epilogue."""
import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.gemm import EpiOperand, matmul_desc
from apollo_py.ir.graph import Node


def matmul_case(xs, ys, epilogue=False, seed=0):
    """``(desc, x, y, epilogue operands, want)`` for a product of shapes ``xs`` @ ``ys``; with
    ``epilogue`` the output is ``relu(x @ y + bias)`` (not a plain product: every tile goes
    through the epilogue kernel)."""
    rng = np.random.default_rng(seed)
    x, y = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ys).astype(np.float32)
    want = np.matmul(x.astype(np.float64), y.astype(np.float64))
    kw = dict(outputs=("h",), out_dtypes=("float32",))
    ops = []
    if epilogue:
        bias = rng.standard_normal(want.shape[-1]).astype(np.float32)
        kw = dict(nodes=(Node("add", ("h", "bias"), ("a",)), Node("max", ("a", "zero"), ("z",))),
                  operands=(EpiOperand("bias", "float32", bias.shape),), outputs=("z",),
                  out_dtypes=("float32",), node_dtypes=("float32",) * 2,
                  inline_consts={"zero": L.Const(0.0, "float32")})
        ops = [bias]
        want = np.maximum(want + bias, 0)
    return matmul_desc("g", xs, ys, want.shape, "h", **kw), x, y, ops, want
