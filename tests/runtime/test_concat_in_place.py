"""Concats whose inputs are written in place (runtime/concat.py): the memory plan puts each
producer's output in its slice of the concat output, so the U-Net skip connection costs no
copy.  Numbers against onnxruntime; what is placed and what is copied is pinned."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap
from apollo_py.runtime.concat import ConcatStep
from apollo_py.runtime.memory import plan_memory

RTOL, ATOL = 1e-4, 1e-4


def _unet_block(n: int = 1, skip_out: bool = False, twice: bool = False) -> onnx.ModelProto:
    """A U-Net level: ``skip = relu(conv(x))``, ``d = relu(conv(maxpool(skip)))``, then
    ``cat([convT(d), resize(e), skip, x], 1)`` -> 3x3 conv (outputs: that and ``d``)."""
    rng = np.random.default_rng(0)
    w = lambda *s: numpy_helper.from_array((rng.standard_normal(s) * 0.2).astype(np.float32))  # noqa: E731
    inits = []

    def init(name, *s):
        t = w(*s)
        t.name = name
        inits.append(t)
        return name

    nodes = [
        helper.make_node("Conv", ["x", init("w0", 16, 8, 3, 3), init("b0", 16)], ["c0"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c0"], ["skip"]),
        helper.make_node("MaxPool", ["skip"], ["pool"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["pool", init("wd", 32, 16, 3, 3), init("bd", 32)], ["cd"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["cd"], ["d"]),
        helper.make_node("ConvTranspose", ["d", init("wt", 32, 16, 2, 2), init("bt", 16)], ["up"],
                         strides=[2, 2], kernel_shape=[2, 2]),
        helper.make_node("Resize", ["e", "", "scales"], ["rs"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Concat", ["up", "rs", "skip", "skip" if twice else "x"], ["cat"], axis=1),
        helper.make_node("Conv", ["cat", init("w1", 8, 16 + 64 + 16 + (16 if twice else 8), 3, 3),
                                  init("b1", 8)], ["y"], pads=[1, 1, 1, 1]),
    ]
    inits.append(numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"))
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("d", TensorProto.FLOAT, None)]
    if skip_out:
        outs.append(helper.make_tensor_value_info("skip", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "unet_block", [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [n, 8, 32, 32]),
        helper.make_tensor_value_info("e", TensorProto.FLOAT, [n, 64, 16, 16])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _feeds(n: int = 1) -> dict:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((n, 8, 32, 32)).astype(np.float32),
            "e": rng.standard_normal((n, 64, 16, 16)).astype(np.float32)}


def _run(model, feeds, tmp_path):
    import onnxruntime as ort
    data = model.SerializeToString()
    f = ap.jit(data, options=ap.Options(target="cpu", cache_dir=str(tmp_path)))
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    for _ in range(2):      # the second call reuses the arena
        got = f(**feeds)
        got = got if isinstance(got, (list, tuple)) else [got]
        for a, b in zip(got, want):
            np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL, atol=ATOL)
    return f, f.specialization({k: v.shape for k, v in feeds.items()})


def _concat_steps(exe):
    return [s for s in exe.steps if any(n.op == "concat" for n in getattr(s, "nodes", ()))]


def test_unet_skip_concat_written_in_place(tmp_path):
    f, exe = _run(_unet_block(), _feeds(), tmp_path)
    (step,) = _concat_steps(exe)
    assert isinstance(step, ConcatStep)
    # the conv-transpose shuffle, the resize GEMM and the relu kernel write their slices; the graph
    # input x is copied
    assert [v for v, _, _ in step.copies] == ["x"] and step.copies[0][1:] == (96, 104)
    slots = exe.memory.slots
    cat = slots[step.outputs[0]]
    placed = [v for v in slots if v != step.outputs[0] and cat.offset <= slots[v].offset < cat.offset + cat.nbytes]
    assert len(placed) == 3, placed
    assert cat.first <= min(k for k, s in enumerate(exe.steps) if set(s.outputs) & set(placed))
    assert "concat in place" in str(f.plan)


@pytest.mark.parametrize("skip_out, twice", [(False, True), (True, False)])
def test_repeated_input_and_graph_output_are_copied(tmp_path, skip_out, twice):
    f, exe = _run(_unet_block(skip_out=skip_out, twice=twice), _feeds(), tmp_path)
    (step,) = _concat_steps(exe)
    assert isinstance(step, ConcatStep)
    copied = [v for v, _, _ in step.copies]
    assert len(copied) == 2
    if twice:       # read twice: two slices, one buffer -- both copied
        assert copied[0] == copied[1] and copied[0] != "x"
    else:           # a graph output's array is handed to the caller: copied (and so is x)
        assert "x" in copied and set(copied) & set(exe.graph.outputs)


def test_batch_two_concat_is_copied(tmp_path):
    f, exe = _run(_unet_block(n=2), _feeds(2), tmp_path)
    # channel slices of a batch are strided: no ConcatStep; the concat is a layer-1 copy kernel
    assert _concat_steps(exe) == []
    (k,) = [s for s in exe.steps if getattr(s, "fused", None) is not None
            and any(n.op == "concat" for n in s.fused.nodes)]
    assert [n.op for n in k.fused.nodes] == ["concat"]


def test_python_dispatch_matches_driver(tmp_path):
    import onnxruntime as ort
    model, feeds = _unet_block(), _feeds()
    f, exe = _run(model, feeds, tmp_path)
    exe.use_driver = False
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = exe.run(feeds)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_plan_memory_members_live_as_long_as_their_container():
    # a written at 0, read at 3; b written at 1; c = concat(a, b) at 2, read at 4
    steps = [((), ("a",)), ((), ("b",)), (("a", "b"), ("c",)), (("a",), ("z",)), (("c",), ("o",))]
    sizes = {"a": 256, "b": 128, "c": 384, "z": 384, "o": 64}
    plan = plan_memory(steps, sizes, {"o"}, {"a": ("c", 0), "b": ("c", 256)})
    c, a, b = plan.slots["c"], plan.slots["a"], plan.slots["b"]
    assert (c.first, c.last) == (0, 4)
    assert (a.offset, b.offset) == (c.offset, c.offset + 256)
    z = plan.slots["z"]       # live with c: must not overlap it
    assert z.offset >= c.offset + 384 or z.offset + 384 <= c.offset


def _split_model(rows: int = 64, feat: int = 64, parts: int = 3) -> onnx.ModelProto:
    """``relu(x)`` split in ``parts`` along axis 1 (after a unit batch), each part times its own
    weight, summed: the slices of Swin's ``qkv`` read by GEMMs."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array((rng.standard_normal((feat, 64)) * 0.1).astype(np.float32), f"w{i}")
             for i in range(parts)]
    sizes = [rows] * parts
    inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Split", ["r", "sizes"], [f"s{i}" for i in range(parts)], axis=1)]
    nodes += [helper.make_node("MatMul", [f"s{i}", f"w{i}"], [f"m{i}"]) for i in range(parts)]
    nodes.append(helper.make_node("Sum", [f"m{i}" for i in range(parts)], ["y"]))
    g = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows * parts, feat])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("rows, feat, views", [(64, 64, 3), (1, 60, 1)])
def test_contiguous_slices_are_views(tmp_path, rows, feat, views):
    from apollo_py.runtime.concat import SliceView
    x = np.random.default_rng(3).standard_normal((1, 3 * rows, feat)).astype(np.float32)
    f, exe = _run(_split_model(rows, feat), {"x": x}, tmp_path)
    got = [s for s in exe.steps if isinstance(s, SliceView)]
    # one row of 60 floats: the second and third parts start 240 and 480 bytes in, off the
    # 64-byte alignment the arena gives every buffer, so numpy copies them
    assert len(got) == views
    slots = exe.memory.slots
    for s in got:
        (src,) = {exe._root.get(v, v) for v in s.inputs}
        assert slots[src].offset <= slots[s.outputs[0]].offset < slots[src].offset + slots[src].nbytes
        assert slots[src].last >= max(k for k, t in enumerate(exe.steps) if s.outputs[0] in t.inputs)
