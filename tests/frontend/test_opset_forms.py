"""Opset-specific forms (attribute vs input operands, changed defaults, padding modes) vs onnxruntime.

The ONNX backend node tests mostly use the newest opset of each op; these single-node models pin
the older forms that exported models still use.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py

ort = pytest.importorskip("onnxruntime")

F, I64 = TensorProto.FLOAT, TensorProto.INT64
_ELEM = {np.dtype(np.float32): F, np.dtype(np.int64): I64, np.dtype(np.int32): TensorProto.INT32,
         np.dtype(np.bool_): TensorProto.BOOL}
RNG = np.random.default_rng(0)


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _i(*vals):
    return np.array(vals, np.int64)


def case(op, opset, inputs, inits=None, n_out=1, out_types=None, **attrs):
    """(model, feeds): one node ``op`` reading ``inputs`` (runtime) then ``inits`` (initializers).

    ``None`` in inputs/inits marks an omitted optional operand.
    """
    inits = inits or {}
    names = list(inputs) + list(inits)
    node = helper.make_node(op, ["" if n.startswith("_skip") else n for n in names],
                            [f"y{k}" for k in range(n_out)], name=f"{op.lower()}_node", **attrs)
    ins = [helper.make_tensor_value_info(n, _ELEM[a.dtype], a.shape) for n, a in inputs.items()]
    outs = [helper.make_tensor_value_info(f"y{k}", (out_types or [F] * n_out)[k], None) for k in range(n_out)]
    g = helper.make_graph([node], f"{op}_{opset}", ins, outs,
                          [numpy_helper.from_array(a, n) for n, a in inits.items() if not n.startswith("_skip")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7
    return m, dict(inputs)


CASES = {
    "slice_attr_9": case("Slice", 9, {"x": _x(5, 6)}, starts=[1, -4], ends=[4, 1000], axes=[0, 1]),
    "slice_neg_step_13": case("Slice", 13, {"x": _x(5, 6)}, {"s": _i(-1, 4), "e": _i(-1000, 0),
                                                              "a": _i(0, 1), "st": _i(-2, -1)}),
    "pad_attr_9": case("Pad", 9, {"x": _x(2, 3)}, pads=[0, 1, 2, 1], value=1.5),
    "pad_reflect_11": case("Pad", 11, {"x": _x(3, 4)}, {"p": _i(1, 2, 1, 1)}, mode="reflect"),
    "pad_edge_axes_18": case("Pad", 18, {"x": _x(2, 3, 4)}, {"p": _i(1, 2, 0, 3), "_skip": _i(0),
                                                             "ax": _i(0, -1)}, mode="edge"),
    "pad_wrap_19": case("Pad", 19, {"x": _x(3, 4)}, {"p": _i(0, 2, 1, 3)}, mode="wrap"),
    "pad_const_value_13": case("Pad", 13, {"x": _x(2, 2)}, {"p": _i(1, 1, 1, 1),
                                                          "v": np.array(-2.0, np.float32)}),
    "reduce_sum_attr_11": case("ReduceSum", 11, {"x": _x(2, 3, 4)}, axes=[0, -1], keepdims=0),
    "reduce_sum_noop_13": case("ReduceSum", 13, {"x": _x(2, 3)}, noop_with_empty_axes=1),
    "reduce_mean_attr_13": case("ReduceMean", 13, {"x": _x(2, 3, 4)}, axes=[1]),
    "reduce_max_input_18": case("ReduceMax", 18, {"x": _x(2, 3, 4)}, {"a": _i(-1, 0)}, keepdims=0),
    "reduce_lse_13": case("ReduceLogSumExp", 13, {"x": _x(3, 5)}, axes=[1]),
    "reduce_l2_all_13": case("ReduceL2", 13, {"x": _x(3, 5)}, keepdims=0),
    "squeeze_attr_11": case("Squeeze", 11, {"x": _x(1, 3, 1, 2)}, axes=[0, -2]),
    "squeeze_all_13": case("Squeeze", 13, {"x": _x(1, 3, 1, 2)}),
    "unsqueeze_attr_11": case("Unsqueeze", 11, {"x": _x(3, 2)}, axes=[0, 3]),
    "unsqueeze_input_13": case("Unsqueeze", 13, {"x": _x(3, 2)}, {"a": _i(-1, 1)}),
    "split_attr_11": case("Split", 11, {"x": _x(6, 2)}, n_out=2, split=[2, 4]),
    "split_even_11": case("Split", 11, {"x": _x(2, 6)}, n_out=3, axis=1),
    "split_input_13": case("Split", 13, {"x": _x(5, 2)}, {"s": _i(1, 4)}, n_out=2),
    "split_num_outputs_18": case("Split", 18, {"x": _x(7, 2)}, n_out=3, num_outputs=3),
    "softmax_coerce_11": case("Softmax", 11, {"x": _x(2, 3, 4)}),
    "softmax_axis0_11": case("Softmax", 11, {"x": _x(2, 3, 4)}, axis=0),
    "logsoftmax_9": case("LogSoftmax", 9, {"x": _x(3, 4, 2)}, axis=2),
    "softmax_axis1_13": case("Softmax", 13, {"x": _x(2, 3, 4)}, axis=1),
    "clip_attr_9": case("Clip", 9, {"x": _x(4, 4)}, min=-0.5, max=0.25),
    "clip_max_only_12": case("Clip", 12, {"x": _x(4, 4)}, {"_skip": _i(0), "hi": np.array(0.3, np.float32)}),
    "clip_none_13": case("Clip", 13, {"x": _x(4, 4)}),
    "batchnorm_9": case("BatchNormalization", 9, {"x": _x(2, 3, 4, 4)},
                        {"s": _x(3), "b": _x(3), "m": _x(3), "v": np.abs(_x(3)) + 0.5}, epsilon=1e-3),
    "batchnorm_15": case("BatchNormalization", 15, {"x": _x(2, 3, 5)},
                         {"s": _x(3), "b": _x(3), "m": _x(3), "v": np.abs(_x(3)) + 0.5}),
    "dropout_10": case("Dropout", 10, {"x": _x(3, 3)}, ratio=0.3),
    "dropout_mask_13": case("Dropout", 13, {"x": _x(3, 3)}, n_out=2, out_types=[F, TensorProto.BOOL]),
    "reshape_zero_5": case("Reshape", 9, {"x": _x(2, 3, 4)}, {"s": _i(0, -1)}),
    "reshape_allowzero_14": case("Reshape", 14, {"x": _x(2, 0, 4)}, {"s": _i(0, 4, 2)}, allowzero=1),
    "maxpool_ceil_10": case("MaxPool", 10, {"x": _x(1, 2, 7, 7)}, kernel_shape=[3, 3], strides=[2, 2],
                            ceil_mode=1),
    "maxpool_dilated_pads_12": case("MaxPool", 12, {"x": _x(1, 2, 8, 8)}, kernel_shape=[2, 2],
                                    dilations=[2, 2], pads=[1, 0, 1, 1]),
    "avgpool_include_pad_11": case("AveragePool", 11, {"x": _x(1, 2, 5, 5)}, kernel_shape=[3, 3],
                                   pads=[1, 1, 1, 1], count_include_pad=1),
    "avgpool_same_upper_11": case("AveragePool", 11, {"x": _x(1, 1, 6, 5)}, kernel_shape=[3, 2],
                                  strides=[2, 2], auto_pad="SAME_UPPER"),
    "avgpool_ceil_19": case("AveragePool", 19, {"x": _x(1, 1, 6, 6)}, kernel_shape=[3, 3],
                            strides=[2, 2], ceil_mode=1, pads=[1, 1, 0, 0]),
    "maxpool_same_lower_11": case("MaxPool", 11, {"x": _x(1, 1, 5, 6)}, kernel_shape=[2, 3],
                                  strides=[2, 1], auto_pad="SAME_LOWER"),
    "conv_same_lower_11": case("Conv", 11, {"x": _x(1, 4, 7, 6)}, {"w": _x(6, 2, 3, 3), "b": _x(6)},
                               auto_pad="SAME_LOWER", strides=[2, 2], group=2),
    "conv1d_dilated_11": case("Conv", 11, {"x": _x(2, 3, 9)}, {"w": _x(4, 3, 3)}, dilations=[2],
                              pads=[1, 2]),
    "gemm_trans_11": case("Gemm", 11, {"a": _x(4, 3)}, {"b": _x(5, 4), "c": _x(5)}, transA=1, transB=1,
                          alpha=0.5, beta=2.0),
    "gemm_no_c_13": case("Gemm", 13, {"a": _x(3, 4), "b": _x(4, 2)}),
    "flatten_neg_11": case("Flatten", 11, {"x": _x(2, 3, 4)}, axis=-1),
    "flatten_zero_11": case("Flatten", 11, {"x": _x(2, 3, 4)}, axis=0),
    "tile_13": case("Tile", 13, {"x": _x(2, 3)}, {"r": _i(2, 3)}),
    "expand_13": case("Expand", 13, {"x": _x(3, 1)}, {"s": _i(2, 1, 4)}),
    "cast_trunc_13": case("Cast", 13, {"x": _x(3, 4) * 4}, to=TensorProto.INT32,
                          out_types=[TensorProto.INT32]),
    "hardswish_14": case("HardSwish", 14, {"x": _x(3, 5) * 4}),
    "celu_12": case("Celu", 12, {"x": _x(3, 5)}, alpha=0.7),
    "mish_18": case("Mish", 18, {"x": _x(3, 5)}),
    "softplus_big_11": case("Softplus", 11, {"x": _x(3, 5) * 30}),
    "prelu_9": case("PRelu", 9, {"x": _x(2, 3, 4)}, {"s": _x(3, 1)}),
    "range_11": case("Range", 11, {}, {"a": np.array(1.0, np.float32), "b": np.array(4.2, np.float32),
                                       "d": np.array(0.5, np.float32)}),
    "constantofshape_9": case("ConstantOfShape", 9, {}, {"s": _i(2, 3)},
                              value=numpy_helper.from_array(np.array([7], np.int64)), out_types=[I64]),
    "gather_neg_13": case("Gather", 13, {"x": _x(5, 3)}, {"i": np.array([[-1, 0], [2, 4]], np.int64)}, axis=0),
    "concat_neg_axis_13": case("Concat", 13, {"a": _x(2, 3), "b": _x(2, 1)}, axis=-1),
    "instancenorm_6": case("InstanceNormalization", 9, {"x": _x(2, 3, 4, 5)}, {"s": _x(3), "b": _x(3)}),
    "mean_variadic_13": case("Mean", 13, {"a": _x(2, 3), "b": _x(3), "c": _x(1, 3)}),
    "max_variadic_13": case("Max", 13, {"a": _x(2, 3), "b": _x(3)}),
    "sum_single_13": case("Sum", 13, {"a": _x(2, 3)}),
    "pow_int_exp_15": case("Pow", 15, {"a": np.abs(_x(2, 3)) + 0.1}, {"e": np.array([2, 3, 1], np.int64)}),
    "hardsigmoid_6": case("HardSigmoid", 9, {"x": _x(3, 4) * 4}, alpha=0.3, beta=0.4),
    "layernorm_axis_17": case("LayerNormalization", 17, {"x": _x(2, 3, 4)}, {"s": _x(3, 4), "b": _x(3, 4)},
                              axis=1, epsilon=1e-3),
    "upsample_9": case("Upsample", 9, {"x": _x(1, 2, 3, 4)},
                       {"s": np.array([1, 1, 2, 1.5], np.float32)}),
    "resize_10_nearest_down": case("Resize", 10, {"x": _x(1, 1, 5, 7)},
                                   {"s": np.array([1, 1, 0.6, 0.5], np.float32)}),
    "resize_10_linear_up": case("Resize", 10, {"x": _x(1, 1, 3, 4)},
                                {"s": np.array([1, 1, 2, 1.5], np.float32)}, mode="linear"),
    "resize_13_cubic_sizes": case("Resize", 13, {"x": _x(1, 2, 4, 5)},
                                  {"_skip1": _i(0), "_skip2": _i(0), "sz": _i(1, 2, 7, 3)}, mode="cubic"),
    "resize_19_linear_axes": case("Resize", 19, {"x": _x(2, 3, 4)},
                                  {"_skip": _i(0), "sc": np.array([1.7], np.float32)}, mode="linear",
                                  axes=[2], coordinate_transformation_mode="half_pixel_symmetric"),
    "convtranspose_group_11": case("ConvTranspose", 11, {"x": _x(1, 4, 3, 4)},
                                   {"w": _x(4, 3, 3, 2), "b": _x(6)}, group=2, strides=[2, 3],
                                   pads=[1, 0, 0, 1], output_padding=[1, 2], dilations=[1, 2]),
    "convtranspose_same_upper_11": case("ConvTranspose", 11, {"x": _x(2, 3, 5)}, {"w": _x(3, 2, 4)},
                                        strides=[2], auto_pad="SAME_UPPER"),
    "convtranspose_output_shape_11": case("ConvTranspose", 11, {"x": _x(1, 2, 3, 3, 2)},
                                          {"w": _x(2, 2, 2, 3, 2)}, strides=[2, 2, 1],
                                          output_shape=[7, 8, 3]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_opset_form_matches_onnxruntime(name):
    model, feeds = CASES[name]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    got = apollo_py.jit(model, target="reference").run(**feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
