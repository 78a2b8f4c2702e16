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


def ort_run(model, feeds: dict):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return s.run(None, feeds)
