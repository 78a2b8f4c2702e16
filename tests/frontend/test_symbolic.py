"""Models with symbolic dims: one CompiledGraph, several input shapes, each specialised."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import apollo_py
from apollo_py import InputError
from make_models import example_inputs, make_attention, make_layernorm_gelu

ort = pytest.importorskip("onnxruntime")


def _ort(model, feeds):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("make", [make_attention, make_layernorm_gelu])
def test_two_shapes_one_compiled_graph(make):
    model = make()
    f = apollo_py.jit(model, target="reference")
    spec = f.program.inputs[0]
    assert any(isinstance(d, str) for d in spec.dims)
    for dims in ({"B": 2, "S": 5, "N": 2}, {"B": 3, "S": 7, "N": 4}):
        feeds = example_inputs(model, dims, seed=sum(dims.values()))
        got = f(**feeds)
        want = _ort(model, feeds)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert len(f._cache) == 2


def test_unknown_dim_is_symbolic():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3])
    x.type.tensor_type.shape.dim[0].Clear()  # neither dim_value nor dim_param
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])
    g = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], name="sm", axis=-1)], "g", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    f = apollo_py.jit(m, target="reference")
    assert f.program.inputs[0].dims == (None, 3)
    for n in (1, 6):
        a = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
        e = np.exp(a - a.max(-1, keepdims=True))
        np.testing.assert_allclose(f(a), e / e.sum(-1, keepdims=True), rtol=1e-6)


def test_shared_dim_param_must_agree():
    ins = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 4]) for n in ("a", "b")]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"], name="add")], "g", ins, [out])
    f = apollo_py.jit(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), target="reference")
    np.testing.assert_array_equal(f(np.ones((3, 4), np.float32), np.ones((3, 4), np.float32)), 2)
    with pytest.raises(InputError, match="'N'"):
        f(np.ones((3, 4), np.float32), np.ones((2, 4), np.float32))


def test_static_specialisation_checks_shapes():
    model = make_attention()
    prog = apollo_py.jit(model, target="reference").program
    g = prog.specialize({"x": (2, 3, 32)})
    assert g.types["x"].shape == (2, 3, 32) and g.types["y"].shape == (2, 3, 32)
    with pytest.raises(InputError):
        prog.specialize({"x": (2, 3, 31)})


@pytest.mark.parametrize("target", ["reference", "cpu"])
@pytest.mark.parametrize("make", [make_attention, make_layernorm_gelu])
def test_batch_and_sequence_dims_two_shapes_both_targets(make, target):
    """Symbolic batch and sequence dims, two call shapes, each specialised once and reused."""
    model = make()
    f = apollo_py.jit(model, target=target)
    shapes = ({"B": 2, "S": 5, "N": 2}, {"B": 3, "S": 7, "N": 3})
    for rep in range(2):  # second round reuses both specialisations
        for dims in shapes:
            feeds = example_inputs(model, dims, seed=sum(dims.values()))
            np.testing.assert_allclose(f(**feeds), _ort(model, feeds), rtol=1e-4, atol=1e-5)
    assert len(f._cache) == 2


def test_input_shapes_pins_and_rejects_other_shapes():
    model = make_layernorm_gelu()
    f = apollo_py.jit(model, target="reference", input_shapes={"x": (2, 4, 24)})
    assert f.plan.graph.types["x"].shape == (2, 4, 24)  # the plan exists before any call
    feeds = example_inputs(model, {"N": 2, "S": 4})
    np.testing.assert_allclose(f(**feeds), _ort(model, feeds), rtol=1e-4, atol=1e-5)
    with pytest.raises(InputError, match=r"'x'.*pinned to \(2, 4, 24\)"):
        f(**example_inputs(model, {"N": 3, "S": 4}))
    assert len(f._cache) == 1


def test_input_shapes_must_name_inputs():
    with pytest.raises(InputError, match="'nope'"):
        apollo_py.jit(make_layernorm_gelu(), input_shapes={"nope": (1, 2, 24)})


def test_symbolic_plan_needs_a_shape():
    f = apollo_py.jit(make_layernorm_gelu(), target="reference")
    with pytest.raises(InputError, match="input_shapes"):
        f.plan


@pytest.mark.parametrize("target", ["reference", "cpu"])
@pytest.mark.parametrize("dynamic,hw", [(-1, "unset"), (0, "unset"), (-1, "?")])
def test_nonpositive_dim_value_is_symbolic(target, dynamic, hw):
    # PaddlePaddle writes the batch as dim_value -1 (some exporters 0) and H, W unset or as the
    # dim_param "?" (rapidocr's PP-OCR classifier: [-1, 3, ?, ?]).  All are symbolic and the two
    # "?" are independent: not a fixed size -1, not one symbol that forces H == W.
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 3, 3],
                           rng.standard_normal(4 * 3 * 3 * 3).astype(np.float32).tolist())

    def model(batch):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, None, None])
        for d in (2, 3):
            x.type.tensor_type.shape.dim[d].Clear()
            if hw == "?":
                x.type.tensor_type.shape.dim[d].dim_param = "?"
        y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
        nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
                 helper.make_node("Relu", ["c"], ["r"], name="relu"),
                 helper.make_node("GlobalAveragePool", ["r"], ["y"], name="gap")]
        g = helper.make_graph(nodes, "g", [x], [y], initializer=[w])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    f = apollo_py.jit(model(dynamic), target=target)
    assert f.program.inputs[0].dims == (None, 3, None, None)
    for shape in ((1, 3, 48, 192), (2, 3, 32, 64)):
        a = rng.standard_normal(shape).astype(np.float32)
        # onnxruntime reads dim_value 0 literally; its answer comes from the -1 spelling
        want = _ort(model(-1), {"x": a})
        got = f(a)
        assert got.shape == want.shape == (shape[0], 4, 1, 1)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
