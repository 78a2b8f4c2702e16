"""Constant-mode Pad as an index map of the kernel that produces its input
(docs/design/stitching.md): the producer writes into the interior of the padded output and
the same kernel fills the border, so no numpy pad step remains.  Numbers against onnxruntime.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

import apollo_py as ap

ort = pytest.importorskip("onnxruntime")
MACHINE = ap.Machine(bandwidth=100e9, peak=500e9, launch=1e-9)


def _run(nodes, shape, inits, tmp_path, outputs=("y",)):
    """[(kind, ops)] per plan step, outputs checked against onnxruntime (exact: a pad copies)."""
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, shape)],
                     [h.make_tensor_value_info(o, T.FLOAT, None) for o in outputs], inits)
    data = h.make_model(g, opset_imports=[h.make_opsetid("", 18)]).SerializeToString()
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    f = ap.jit(data, options=ap.Options(target="cpu", cache_dir=str(tmp_path), machine=MACHINE))
    got = f(x=x)
    got = got if isinstance(got, (list, tuple)) else [got]
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)
    return [("kernel" if k.fused is not None else "numpy", sorted(n.op for n in (k.fused.nodes if k.fused else k.nodes)
                                                              if n.op != "constant")) for k in f.plan.kernels]


def _pads(*p):
    return nh.from_array(np.array(p, np.int64), "p")


def _val(v):
    return nh.from_array(np.array(v, np.float32), "cv")


def test_pad_after_elementwise_is_one_kernel(tmp_path):
    """relu -> mul -> Pad on two axes with a non-zero value: one kernel (before: a kernel and a
    numpy pad)."""
    nodes = [h.make_node("Relu", ["x"], ["r"]), h.make_node("Mul", ["r", "r"], ["m"]),
             h.make_node("Pad", ["m", "p", "cv"], ["y"], mode="constant")]
    steps = _run(nodes, (2, 8, 10, 12), [_pads(0, 0, 1, 2, 0, 0, 3, 1), _val(-1.5)], tmp_path)
    assert steps == [("kernel", ["mul", "pad", "relu"])]


def test_pad_after_stitched_softmax(tmp_path):
    """A row softmax (one stitched kernel) padded on its last axis (attention masks padded to a
    block size): still one kernel."""
    nodes = [h.make_node("Softmax", ["x"], ["s"], axis=-1), h.make_node("Pad", ["s", "p"], ["y"], mode="constant")]
    steps = _run(nodes, (16, 50), [_pads(0, 0, 0, 14)], tmp_path)
    assert len(steps) == 1 and steps[0][0] == "kernel" and "pad" in steps[0][1], steps


@pytest.mark.parametrize("case", ["graph_input", "reflect", "crop", "input_is_output"])
def test_pads_that_stay_numpy_steps(case, tmp_path):
    """A pad of a graph input has no kernel to join; reflect mode and negative pads (a crop)
    are not index maps of this kind; a pad whose input is a graph output leaves the producer
    alone (its value must exist unpadded anyway)."""
    shape = (4, 6, 8)
    if case == "graph_input":
        nodes, inits = [h.make_node("Pad", ["x", "p"], ["y"])], [_pads(0, 1, 1, 0, 1, 1)]
    elif case == "reflect":
        nodes = [h.make_node("Exp", ["x"], ["e"]), h.make_node("Pad", ["e", "p"], ["y"], mode="reflect")]
        inits = [_pads(0, 1, 1, 0, 1, 1)]
    elif case == "crop":
        nodes = [h.make_node("Exp", ["x"], ["e"]), h.make_node("Pad", ["e", "p"], ["y"])]
        inits = [_pads(0, -1, 1, 0, 0, 1)]
    else:
        nodes = [h.make_node("Exp", ["x"], ["e"]), h.make_node("Pad", ["e", "p"], ["y"])]
        inits = [_pads(0, 1, 1, 0, 1, 1)]
    outputs = ("y", "e") if case == "input_is_output" else ("y",)
    steps = _run(nodes, shape, inits, tmp_path, outputs)
    assert ("numpy", ["pad"]) in steps, steps
