"""GroupNorm stitched across its reshapes (partition/refine_reshape.py, docs/design/stitching.md):
every spelling is one kernel and one launch (two before: the per-channel affine sat on the
other side of the reshape back), the reshapes views; numbers against onnxruntime (rtol 1e-4).

The torch exports (torchscript and dynamo: Reshape -> InstanceNormalization -> Reshape ->
Mul / Add) are pinned in test_stitching.py; here the GroupNormalization op (opset 18: per-group
scale, opset 21: per-channel), the mean / var spelling of decompositions, the epilogues that
follow a GroupNorm in a UNet block (SiLU, a residual add), and what must stay apart.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from apollo_py.ir.graph import Graph, Node
from apollo_py.ir.types import TensorType
from apollo_py.partition.preprocess import refine_reshapes

pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).parent))
from layer_counts import compile_and_count as _run  # noqa: E402


def _model(nodes, shape, inits, opset=18, extra_inputs=()):
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, shape), *extra_inputs],
                     [h.make_tensor_value_info("y", T.FLOAT, None)], inits)
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)])


def _x(shape, seed=0):
    return {"x": np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 2 + 0.5}


def _vec(name, n, seed):
    return nh.from_array(np.random.default_rng(seed).uniform(0.5, 1.5, n).astype(np.float32), name)


def _i64(name, v):
    return nh.from_array(np.array(v, np.int64), name)


@pytest.mark.parametrize("opset,per", [(18, "group"), (21, "channel")])
def test_group_normalization_op_one_kernel(opset, per, tmp_path):
    n, c, g, hw = 2, 32, 8, (12, 10)
    k = g if per == "group" else c
    node = h.make_node("GroupNormalization", ["x", "s", "b"], ["y"], num_groups=g, epsilon=1e-5)
    m = _model([node], (n, c, *hw), [_vec("s", k, 1), _vec("b", k, 2)], opset)
    kernels, launches, copies, plan = _run(m, tmp_path, _x((n, c, *hw)))
    assert (kernels, launches, copies) == (1, 1, 0), str(plan)


def _mean_var_gn(shape, groups, tail=()):
    """torch's decomposition spelling: Reshape [N, G, -1] -> ReduceMean -> Sub -> Pow 2 ->
    ReduceMean -> Add eps -> Sqrt -> Div -> Reshape back -> Mul / Add (C, 1, 1) -> ``tail``."""
    c = shape[1]
    nodes = [h.make_node("Reshape", ["x", "gshape"], ["g"]),
             h.make_node("ReduceMean", ["g", "ax"], ["mu"], keepdims=1), h.make_node("Sub", ["g", "mu"], ["d"]),
             h.make_node("Pow", ["d", "two"], ["d2"]), h.make_node("ReduceMean", ["d2", "ax"], ["var"], keepdims=1),
             h.make_node("Add", ["var", "eps"], ["ve"]), h.make_node("Sqrt", ["ve"], ["sd"]),
             h.make_node("Div", ["d", "sd"], ["nrm"]), h.make_node("Reshape", ["nrm", "xshape"], ["back"]),
             h.make_node("Mul", ["back", "s"], ["sc"]), h.make_node("Add", ["sc", "b"], ["y" if not tail else "gn"]),
             *tail]
    chan = (c,) + (1,) * (len(shape) - 2)
    inits = [_i64("gshape", [shape[0], groups, -1]), _i64("xshape", list(shape)), _i64("ax", [2]),
             nh.from_array(np.array(2.0, np.float32), "two"), nh.from_array(np.array(1e-5, np.float32), "eps"),
             nh.from_array(np.random.default_rng(1).uniform(0.5, 1.5, chan).astype(np.float32), "s"),
             nh.from_array(np.random.default_rng(2).uniform(-0.5, 0.5, chan).astype(np.float32), "b")]
    return nodes, inits


SILU_RESIDUAL = (h.make_node("Sigmoid", ["gn"], ["sg"]), h.make_node("Mul", ["gn", "sg"], ["act"]),
                 h.make_node("Add", ["act", "r"], ["y"]))


@pytest.mark.parametrize("shape,groups,tail", [
    ((2, 16, 8, 8), 4, ()),
    ((1, 64, 16, 16), 32, ()),          # batch 1 (UNet's): the size-1 atom drops out
    ((3, 24, 50), 6, ()),               # 1-d spatial (GroupNorm in audio / conv1d nets)
    ((2, 32, 8, 8), 8, SILU_RESIDUAL),  # UNet resnet block: GroupNorm -> SiLU -> + residual
])
def test_mean_var_spelling_one_kernel(shape, groups, tail, tmp_path):
    nodes, inits = _mean_var_gn(shape, groups, tail)
    extra = [h.make_tensor_value_info("r", T.FLOAT, shape)] if tail else []
    feeds = _x(shape)
    if tail:
        feeds["r"] = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    kernels, launches, copies, plan = _run(_model(nodes, shape, inits, extra_inputs=extra), tmp_path, feeds)
    assert (kernels, launches, copies) == (1, 1, 0), str(plan)


def test_group_row_over_the_stitch_scratch_stays_correct(tmp_path):
    """One group of 32 * 48 * 48 floats (288 KiB) is over layer 2's stitch scratch: the
    refined region is not stitched (mean, variance, then the normalise + affine kernel, each
    parallel over the N*G rows), and the numbers still match."""
    shape = (2, 64, 48, 48)
    nodes, inits = _mean_var_gn(shape, 2)
    kernels, launches, copies, plan = _run(_model(nodes, shape, inits), tmp_path, _x(shape))
    assert copies == 0 and kernels == 3, str(plan)
    assert all(k.fused.parallel_dims == 1 for k in plan.kernels if k.fused is not None), str(plan)


def _graph(nodes, types, inputs, outputs):
    return Graph(inputs, outputs, tuple(nodes), {k: TensorType(*v) for k, v in types.items()})


def test_refine_keeps_outputs_and_leaves_plain_reshapes_alone():
    """The pass keeps every value read outside the region in its own shape (a reshape back
    from the refined value), and leaves regions without a reduction across the reshape alone
    (a reshape -> relu -> reshape back, a LayerNorm on a reshaped tensor)."""
    f32 = "float32"
    gn = [Node("reshape", ("x",), ("g",), {"shape": (2, 4, 96)}),
          Node("reduce_sum", ("g",), ("m",), {"axes": (2,), "keepdims": True}),
          Node("sub", ("g", "m"), ("d",)),
          Node("reshape", ("d",), ("back",), {"shape": (2, 8, 6, 8)}),
          Node("mul", ("back", "s"), ("y",)),
          Node("constant", (), ("s",), {"value": np.ones((8, 1, 1), np.float32)})]
    gn = [gn[-1], *gn[:-1]]
    types = {"x": ((2, 8, 6, 8), f32), "g": ((2, 4, 96), f32), "m": ((2, 4, 1), f32), "d": ((2, 4, 96), f32),
             "back": ((2, 8, 6, 8), f32), "y": ((2, 8, 6, 8), f32), "s": ((8, 1, 1), f32)}
    g = _graph(gn, types, ("x",), ("y", "m"))
    out = refine_reshapes(g)
    assert out is not g
    assert out.types["y"] == g.types["y"] and out.types["m"] == g.types["m"]
    red = [n for n in out.nodes if n.op == "reduce_sum"]
    assert len(red) == 1 and out.types[red[0].outputs[0]].shape == (8, 1, 1)   # [N*G, C/G, H*W]
    x = np.random.default_rng(0).standard_normal((2, 8, 6, 8)).astype(np.float32)
    from apollo_py.ops.evaluate import run_nodes
    want, got = {"x": x}, {"x": x}
    run_nodes(list(g.nodes), want, g.types)
    run_nodes(list(out.nodes), got, out.types)
    for v in ("y", "m"):
        np.testing.assert_allclose(got[v], want[v], rtol=1e-6)
    assert refine_reshapes(out) is out          # a refined region stays as it is
    plain = [Node("reshape", ("x",), ("g",), {"shape": (2, 4, 96)}), Node("relu", ("g",), ("r",)),
             Node("reshape", ("r",), ("y",), {"shape": (2, 8, 6, 8)})]
    g2 = _graph(plain, {"x": types["x"], "g": types["g"], "r": types["g"], "y": types["x"]}, ("x",), ("y",))
    assert refine_reshapes(g2) is g2
