"""Mobile CNN blocks (layers/conv_squeeze.py, codegen/conv_direct.py): the squeeze-excitation
squeeze fused into the depthwise conv, the excitation into the gate's matrix-vector conv, and
the flat depthwise form -- numbers against onnxruntime, plan pins."""
import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py
from apollo_py import Options

sys.path.insert(0, str(Path(__file__).parent))
from models import conv_model, ort_run, se_block_model  # noqa: E402

SE_CASES = {
    # EfficientNet: SiLU, sigmoid gate, torch dynamo's mean (ReduceSum / H*W)
    "silu_sumdiv": dict(x_shape=(1, 32, 14, 14), k=3, mean="SumDiv"),
    # MobileNetV3: HardSwish, ReLU squeeze, HardSigmoid gate, stride 2, 5x5, batch 2, odd sizes
    "hswish_hsig_s2": dict(x_shape=(2, 24, 15, 13), k=5, stride=2, act="HardSwish", gate="HardSigmoid",
                           mean="GlobalAveragePool"),
    # ReduceMean spelling, ReLU, the pooled vector also a graph output (stored by the conv kernel)
    "relu_mean_exposed": dict(x_shape=(1, 16, 9, 9), act="Relu", mean="ReduceMean", expose_pool=True),
    # 7x7 planes (flat form: pitch 9 for 7 columns) with 40 channels (lane tails in the squeeze)
    "silu_7x7": dict(x_shape=(1, 40, 7, 7), k=5, mean="ReduceMean"),
}


def _se(case):
    kw = SE_CASES[case]
    m = se_block_model(**kw)
    x = np.random.default_rng(1).standard_normal(kw["x_shape"]).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    got = f(x=x)
    return f, (got if isinstance(got, (list, tuple)) else [got]), ort_run(m, {"x": x})


@pytest.mark.parametrize("case", sorted(SE_CASES))
def test_se_block_matches_onnxruntime_in_three_steps(case):
    """dwconv + act + squeeze is one direct kernel, FC1 one, FC2 + gate + excitation one: no
    layer-1 reduction or excitation kernel is left."""
    f, got, want = _se(case)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    ks = f.plan.kernels
    assert len(ks) == 3 and all(k.gemm is not None for k in ks), f.plan
    dw, fc1, fc2 = ks
    ops = [n.op for n in dw.nodes]
    assert ops[0] == "conv" and "reduce_sum" in ops and "squeeze reduce_sum" in dw.reason, dw.reason
    assert dw.gemm.squeeze is not None and fc1.gemm.excite is None
    assert fc2.gemm.excite is not None and fc2.nodes[-1].op == "mul" and "excitation mul fused" in fc2.reason
    assert fc2.outputs[-1] == "y" or "y" in fc2.outputs


def test_squeeze_not_fused_when_reduction_is_not_over_the_plane():
    """A reduction over W only keeps its own kernel; numbers still match."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((8, 1, 3, 3))).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([3], np.int64), "ax")]
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1], group=8),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("ReduceSum", ["r", "ax"], ["y"], keepdims=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 7])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = rng.standard_normal((1, 8, 6, 7)).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    np.testing.assert_allclose(f(x=x), ort_run(m, {"x": x})[0], rtol=1e-4, atol=1e-4)
    assert not any(getattr(k.gemm, "squeeze", None) for k in f.plan.kernels), f.plan


@pytest.mark.parametrize("xs,k,s,scratch", [((1, 24, 14, 14), 3, 1, "yrow"), ((1, 20, 7, 7), 5, 1, "yflat"),
                                             ((1, 16, 7, 7), 5, 1, "ycv"),
                                             ((1, 8, 28, 28), 3, 2, "yrow")])
def test_flat_form_vectorises_small_planes(xs, k, s, scratch):
    """Depthwise kernels at 14x14 / 7x7 / stride 2 run vectorised at more than 4 lanes (LLVM
    vectorised 14- and 7-wide rows at 2 lanes or not at all): 7-wide rows and strided convs the
    tap sum over the flattened padded plane (scratch ``yflat``), 14-wide rows (strides 1, 2) the
    row-blocked kernel over a 16-lane row pitch (codegen/conv_dw_rows.py, scratch ``yrow``), 5x5
    convs on 7x7 planes with a multiple of 16 channels 16 channels per vector (conv_dw_cvec.py,
    scratch ``ycv``)."""
    import re
    from apollo_py.codegen.conv_direct import flat_form, render_direct_conv
    from apollo_py.codegen.llvm import optimize_ir
    m = conv_model(xs, (xs[1], 1, k, k), strides=(s, s), pads=(k // 2,) * 4, group=xs[1], act="SiLU")
    x = np.random.default_rng(0).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    d = f.plan.kernels[0].gemm
    assert flat_form(d) and scratch in render_direct_conv(d)
    ir = str(optimize_ir(render_direct_conv(d)))
    widths = {int(v) for v in re.findall(r"<(\d+) x float>", ir)}
    assert max(widths) >= 8, widths


def test_zoo_small_se_blocks_fused():
    """The small EfficientNet / MobileNetV3 of the zoo: every SE squeeze and excitation is fused
    (no layer-1 kernel with a reduce_sum after a depthwise conv, none that is a lone mul), and the
    numbers match onnxruntime."""
    import json
    zoo = Path(__file__).parent.parent / "models" / "zoo"
    man = json.loads((zoo / "manifest.json").read_text())
    for name in ("efficientnet_small.dynamo.onnx", "mobilenetv3_small.torchscript.onnx"):
        shape = man[name]["inputs"][0]["shape"]
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        f = apollo_py.jit(str(zoo / name), options=Options(num_threads=2))
        got = f(x)
        got = got[0] if isinstance(got, (list, tuple)) else got
        import onnxruntime as ort
        s = ort.InferenceSession(str(zoo / name), providers=["CPUExecutionProvider"])
        want = s.run(None, {s.get_inputs()[0].name: x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
        ks = f.plan.kernels
        squeezes = sum(1 for k in ks if getattr(k.gemm, "squeeze", None) is not None)
        excites = sum(1 for k in ks if getattr(k.gemm, "excite", None) is not None)
        lone_mul = [k for k in ks if k.fused is not None and [n.op for n in k.fused.nodes] == ["mul"]]
        assert squeezes >= 3 and excites == squeezes and not lone_mul, (name, squeezes, excites, f.plan)


def _gemm_squeeze_models():
    """RegNetY's SE block (grouped 3x3 conv, 24 channels per group: a GEMM conv, ReLU, dynamo's
    mean) and EfficientNet's head (1x1 conv + SiLU + global average pool)."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(2)
    regnet = se_block_model(x_shape=(1, 48, 14, 14), k=3, act="Relu", mean="SumDiv", groups=2)
    inits = [numpy_helper.from_array((rng.standard_normal((64, 32, 1, 1)) / 6).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(64).astype(np.float32), "B")]
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"]), helper.make_node("Sigmoid", ["c"], ["s"]),
             helper.make_node("Mul", ["c", "s"], ["a"]),
             helper.make_node("ReduceMean", ["a"], ["y"], axes=[2, 3], keepdims=1)]
    g = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 7, 7])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    head = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return {"regnet_se": (regnet, (1, 48, 14, 14), "relu"), "effnet_head": (head, (1, 32, 7, 7), "sigmoid")}


@pytest.mark.parametrize("case", ["regnet_se", "effnet_head"])
@pytest.mark.parametrize("chain", [True, False])
def test_gemm_conv_takes_the_squeeze_chain_as_epilogue(case, chain, monkeypatch):
    """A GEMM conv (not a direct one) followed by ``act -> reduce_sum over H, W``: the activation
    is the GEMM's epilogue and the reduction kernel only sums (``SQUEEZE_CHAIN`` off: the
    reduction kernel applies it, as before)."""
    from apollo_py.layers import lowering
    monkeypatch.setattr(lowering, "SQUEEZE_CHAIN", chain)
    m, xs, act = _gemm_squeeze_models()[case]
    x = np.random.default_rng(1).standard_normal(xs).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    ks = f.plan.kernels
    conv, red = ks[0], ks[1]
    assert conv.gemm is not None and "direct conv" not in conv.reason and red.gemm is None, f.plan
    red_ops = {n.op for n in red.fused.nodes}
    assert "reduce_sum" in red_ops
    if chain:
        assert act in {n.op for n in conv.nodes} and "epilogue add+" in conv.reason, conv.reason
        assert not {"add", act} & red_ops, red_ops
    else:
        assert act in red_ops


def _with_projection(m, c, cout=8, seed=3):
    """``m`` with a 1x1 projection conv after its output (the excitation then feeds it)."""
    from onnx import TensorProto, helper, numpy_helper
    g = m.graph
    w = (np.random.default_rng(seed).standard_normal((cout, c, 1, 1)) / np.sqrt(c)).astype(np.float32)
    g.initializer.append(numpy_helper.from_array(w, "Wp"))
    g.node.append(helper.make_node("Conv", [g.output[0].name, "Wp"], ["proj"]))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("proj", TensorProto.FLOAT, None))
    return m


@pytest.mark.parametrize("kw", [dict(x_shape=(1, 32, 14, 14), k=3, mean="SumDiv"),
                                dict(x_shape=(2, 24, 15, 13), k=5, stride=2, act="HardSwish", gate="HardSigmoid",
                                     mean="GlobalAveragePool")])
def test_excitation_in_place_when_only_the_projection_reads_it(kw):
    """An excitation whose operand (the depthwise activation) nothing reads later is written over
    the operand's buffer: the product's arena slot is the operand's; repeated calls (the driver,
    reused arenas) match onnxruntime.  Where the product is a graph output it gets its own."""
    m = _with_projection(se_block_model(**kw), kw["x_shape"][1])
    x = np.random.default_rng(1).standard_normal(kw["x_shape"]).astype(np.float32)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    want = ort_run(m, {"x": x})[0]
    for _ in range(3):
        np.testing.assert_allclose(f(x=x), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    fc2 = f.plan.kernels[2]
    ex = fc2.gemm.excite
    assert ex.inplace and "in place over" in fc2.reason, f.plan
    slots = f.specialization({"x": kw["x_shape"]}).memory.slots
    assert slots[ex.output].offset == slots[ex.operand].offset
    assert slots[ex.operand].last >= 3          # alive through the projection conv (step 3)
    f2, _, _ = _se("silu_sumdiv")              # the product is the graph's output: not in place
    assert not f2.plan.kernels[2].gemm.excite.inplace
