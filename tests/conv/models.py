"""Small ONNX conv models for the conv tests (tests/conv) and benchmarks/conv_bench.py."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def conv_model(x_shape, w_shape, *, strides=(1, 1), pads=(0, 0, 0, 0), dilations=(1, 1), group=1,
               bias=True, bn=False, act=None, pre=None, post=None, seed=0, opset=17):
    """``x -> Conv [+ BatchNormalization] [-> act] [-> post ops]`` with random constant weights.

    ``act``: None, "Relu", "Clip6" (ReLU6), "HardSwish", "SiLU" (x * Sigmoid(x)), "Sigmoid".
    ``post``: list of ("Mul"|"Add"|"Sub"|"Div", per-channel shape) constant affine ops after the
    conv (torch decompositions of BatchNorm: mean/scale vectors shaped (C,1,1) or (1,C,1,1))."""
    rng = np.random.default_rng(seed)
    cout = w_shape[0]
    inits = [numpy_helper.from_array((rng.standard_normal(w_shape) * 0.3).astype(np.float32), "W")]
    nodes = []
    conv_in = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(cout).astype(np.float32), "B"))
        conv_in.append("B")
    nodes.append(helper.make_node("Conv", conv_in, ["c"], strides=list(strides), pads=list(pads),
                                  dilations=list(dilations), group=group))
    cur = "c"
    if bn:
        for name, arr in (("s", rng.uniform(0.5, 1.5, cout)), ("b", rng.standard_normal(cout)),
                          ("m", rng.standard_normal(cout) * 0.1), ("v", rng.uniform(0.5, 2.0, cout))):
            inits.append(numpy_helper.from_array(arr.astype(np.float32), f"bn_{name}"))
        nodes.append(helper.make_node("BatchNormalization", [cur, "bn_s", "bn_b", "bn_m", "bn_v"], ["bn"],
                                      epsilon=1e-5))
        cur = "bn"
    for q, (op, shape) in enumerate(post or ()):
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, shape).astype(np.float32), f"p{q}"))
        nodes.append(helper.make_node(op, [cur, f"p{q}"], [f"post{q}"]))
        cur = f"post{q}"
    if act == "Relu":
        nodes.append(helper.make_node("Relu", [cur], ["y"]))
    elif act == "Clip6":
        inits += [numpy_helper.from_array(np.array(0, np.float32), "lo"),
                  numpy_helper.from_array(np.array(6, np.float32), "hi")]
        nodes.append(helper.make_node("Clip", [cur, "lo", "hi"], ["y"]))
    elif act == "HardSwish":
        nodes.append(helper.make_node("HardSwish", [cur], ["y"]))
    elif act == "Sigmoid":
        nodes.append(helper.make_node("Sigmoid", [cur], ["y"]))
    elif act == "SiLU":
        nodes += [helper.make_node("Sigmoid", [cur], ["sg"]), helper.make_node("Mul", [cur, "sg"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", [cur], ["y"]))
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def pool_model(x_shape, op, pre=None, post=None, **attrs):
    """``x [-> Add bias -> Relu] -> MaxPool|AveragePool [-> Mul s -> Sigmoid]``."""
    rng = np.random.default_rng(0)
    c = x_shape[1]
    inits, nodes, cur = [], [], "x"
    bshape = (c,) + (1,) * (len(x_shape) - 2)
    if pre:
        inits.append(numpy_helper.from_array(rng.standard_normal(bshape).astype(np.float32), "b"))
        nodes += [helper.make_node("Add", [cur, "b"], ["xa"]), helper.make_node("Relu", ["xa"], ["xr"])]
        cur = "xr"
    nodes.append(helper.make_node(op, [cur], ["p"], **attrs))
    cur = "p"
    if post:
        inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, bshape).astype(np.float32), "s"))
        nodes += [helper.make_node("Mul", [cur, "s"], ["pm"]), helper.make_node("Sigmoid", ["pm"], ["y"])]
    else:
        nodes.append(helper.make_node("Identity", [cur], ["y"]))
    g = helper.make_graph(nodes, "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def convt_model(x_shape, w_shape, bias=True, **attrs):
    """``x -> ConvTranspose [+ bias] -> Relu`` with random constant weights."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(w_shape) * 0.3).astype(np.float32), "W")]
    ins = ["x", "W"]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(w_shape[1] * attrs.get("group", 1))
                                             .astype(np.float32), "B"))
        ins.append("B")
    g = helper.make_graph([helper.make_node("ConvTranspose", ins, ["c"], **attrs),
                           helper.make_node("Relu", ["c"], ["y"])], "convt",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def residual_conv1d_model(seed: int = 5):
    """``(model, x)``: a 3x3 conv of x[2, 6, 9, 7] with a residual add + ReLU epilogue (an
    epilogue operand indexed by output pixel), reshaped to one row and fed to a stride-2
    Conv1d."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((6, 6, 3, 3)) * 0.3).astype(np.float32)
    w1 = (rng.standard_normal((5, 6, 3)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "W"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Add", ["c", "x"], ["r"]), helper.make_node("Relu", ["r"], ["y"]),
             helper.make_node("Reshape", ["y", "s"], ["y1"]),
             helper.make_node("Conv", ["y1", "W1"], ["z"], pads=[2, 0], strides=[2])]
    g = helper.make_graph(nodes, "res", [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 6, 9, 7))],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                          [numpy_helper.from_array(w, "W"), numpy_helper.from_array(w1, "W1"),
                           numpy_helper.from_array(np.array([2, 6, 63], np.int64), "s")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return m, rng.standard_normal((2, 6, 9, 7)).astype(np.float32)


def ort_run(model, feeds: dict):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)


def se_block_model(x_shape, k=3, stride=1, act="SiLU", gate="Sigmoid", mean="ReduceMean", reduce=4, seed=0,
                   opset=17, expose_pool=False, groups=None):
    """A mobile inverted-residual tail: depthwise ``k x k`` conv (bias) -> ``act`` -> squeeze-excitation
    (global average pool spelt ``mean`` -- "ReduceMean", "GlobalAveragePool", or "SumDiv" for the torch
    dynamo form ``ReduceSum / (H*W)`` -- 1x1 conv, ReLU or ``act``, 1x1 conv, ``gate``) -> ``a * gate``.

    ``act``: "SiLU", "HardSwish", "Relu"; ``gate``: "Sigmoid" or "HardSigmoid".  ``expose_pool`` adds
    the pooled vector as a second graph output.  ``groups``: the first conv's groups (default: depthwise;
    RegNetY's grouped 3x3 convs have 24 channels per group)."""
    rng = np.random.default_rng(seed)
    c = x_shape[1]
    cr = max(1, c // reduce)
    p = k // 2
    groups = groups or c
    inits = [numpy_helper.from_array((rng.standard_normal((c, c // groups, k, k)) * 0.3 / np.sqrt(c // groups))
                                     .astype(np.float32), "Wd"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32), "Bd"),
             numpy_helper.from_array((rng.standard_normal((cr, c, 1, 1)) / np.sqrt(c)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal(cr).astype(np.float32) * 0.1, "B1"),
             numpy_helper.from_array((rng.standard_normal((c, cr, 1, 1)) / np.sqrt(cr)).astype(np.float32), "W2"),
             numpy_helper.from_array(rng.standard_normal(c).astype(np.float32) * 0.1, "B2")]
    nodes = [helper.make_node("Conv", ["x", "Wd", "Bd"], ["d"], strides=[stride, stride], pads=[p, p, p, p],
                              group=groups)]

    def activation(src, dst, kind):
        if kind == "SiLU":
            return [helper.make_node("Sigmoid", [src], [dst + "_sg"]),
                    helper.make_node("Mul", [src, dst + "_sg"], [dst])]
        return [helper.make_node(kind, [src], [dst])]

    nodes += activation("d", "a", act)
    if mean == "ReduceMean":
        nodes.append(helper.make_node("ReduceMean", ["a"], ["pool"], axes=[2, 3], keepdims=1))
    elif mean == "GlobalAveragePool":
        nodes.append(helper.make_node("GlobalAveragePool", ["a"], ["pool"]))
    else:
        inits += [numpy_helper.from_array(np.array([2, 3], np.int64), "axes"),
                  numpy_helper.from_array(np.array(0, np.float32), "hw")]
        nodes += [helper.make_node("ReduceSum", ["a", "axes"], ["psum"], keepdims=1),
                  helper.make_node("Shape", ["a"], ["shp"]),
                  helper.make_node("Gather", ["shp", "hw_idx"], ["hwd"], axis=0),
                  helper.make_node("ReduceProd", ["hwd"], ["hwp"], keepdims=0),
                  helper.make_node("Cast", ["hwp"], ["hwf"], to=TensorProto.FLOAT),
                  helper.make_node("Div", ["psum", "hwf"], ["pool"])]
        inits = [i for i in inits if i.name != "hw"]
        inits.append(numpy_helper.from_array(np.array([2, 3], np.int64), "hw_idx"))
    nodes.append(helper.make_node("Conv", ["pool", "W1", "B1"], ["s1"]))
    nodes += activation("s1", "s1a", "Relu" if act == "HardSwish" else act)
    nodes.append(helper.make_node("Conv", ["s1a", "W2", "B2"], ["s2"]))
    nodes.append(helper.make_node(gate, ["s2"], ["g"]))
    nodes.append(helper.make_node("Mul", ["a", "g"], ["y"]))
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if expose_pool:
        outs.append(helper.make_tensor_value_info("pool", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "se", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                          outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
