"""Error paths of the ONNX front end: each is one ApolloError subclass with a useful message."""
from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py
from apollo_py import InputError, ModelLoadError, ShapeError, UnsupportedOpError
from make_models import make_mlp


def _single_node_model(op_type, name, inputs, outputs, inits=None, domain=""):
    node = helper.make_node(op_type, [i for i, _ in inputs], [o for o, _ in outputs], name=name,
                            domain=domain)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(i, TensorProto.FLOAT, s) for i, s in inputs if i not in (inits or {})],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, s) for o, s in outputs],
        [numpy_helper.from_array(a, n) for n, a in (inits or {}).items()])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


@pytest.mark.parametrize("data", [b"", b"not an onnx model at all", b"\x08\x07\x12\xff\xff\xff\xff\x0f"])
def test_malformed_bytes(data):
    with pytest.raises(ModelLoadError) as e:
        apollo_py.jit(data)
    assert "ONNX model" in str(e.value)
    assert e.value.__cause__ is None and (e.value.__context__ is None or e.value.__suppress_context__)


def test_truncated_file(tmp_path):
    blob = make_mlp().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ModelLoadError) as e:
        apollo_py.jit(str(path))
    assert "cut.onnx" in str(e.value) or "invalid ONNX model" in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="nope.onnx"):
        apollo_py.jit(tmp_path / "nope.onnx")


def test_unknown_op_names_node_and_op_type():
    m = _single_node_model("FrobnicateTensor", "frob_1", [("x", [2])], [("y", [2])])
    with pytest.raises(UnsupportedOpError) as e:
        apollo_py.jit(m, target="reference")
    assert "frob_1" in str(e.value) and "FrobnicateTensor" in str(e.value)
    assert e.value.op_type == "FrobnicateTensor" and e.value.node == "frob_1"


def test_custom_domain_op_is_unsupported():
    m = _single_node_model("Gelu", "ms_gelu", [("x", [2])], [("y", [2])], domain="com.microsoft")
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(UnsupportedOpError, match="ms_gelu"):
        apollo_py.jit(m, target="reference")


def test_shape_error_names_node():
    m = _single_node_model("MatMul", "bad_mm", [("a", [2, 3]), ("b", [4, 5])], [("y", [2, 5])])
    f = apollo_py.jit(m, target="reference")
    with pytest.raises(ShapeError) as e:
        f(np.zeros((2, 3), np.float32), np.zeros((4, 5), np.float32))
    assert "bad_mm" in str(e.value) and "MatMul" in str(e.value)


def test_data_dependent_shape_runs_staged_but_not_as_one_graph():
    node = helper.make_node("Reshape", ["x", "s"], ["y"], name="dyn_reshape")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
                                            helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    f = apollo_py.jit(m, target="reference")
    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(f(x, np.array([2, 3])), x.reshape(2, 3))  # via onnx.reference, staged
    with pytest.raises(UnsupportedOpError, match="dyn_reshape"):
        f.program.specialize({"x": (6,), "s": (2,)})


@pytest.fixture(scope="module")
def mlp():
    return apollo_py.jit(make_mlp(), target="reference")


def test_wrong_input_name(mlp):
    with pytest.raises(InputError) as e:
        mlp(inputs=np.zeros((2, 16), np.float32))
    assert "'inputs'" in str(e.value) and "x" in str(e.value)


def test_wrong_input_count(mlp):
    with pytest.raises(InputError, match="takes 1"):
        mlp(np.zeros((2, 16), np.float32), np.zeros((2, 16), np.float32))
    with pytest.raises(InputError, match="missing input"):
        mlp()


def test_wrong_input_shape(mlp):
    with pytest.raises(InputError) as e:
        mlp(x=np.zeros((2, 15), np.float32))
    assert "'x'" in str(e.value) and "(2, 15)" in str(e.value) and "16" in str(e.value)


def test_wrong_input_dtype(mlp):
    with pytest.raises(InputError) as e:
        mlp(x=np.zeros((2, 16), np.float64))
    assert "'x'" in str(e.value) and "float64" in str(e.value) and "float32" in str(e.value)


# --- external data ----------------------------------------------------------------------------

def _external_model(dirpath, location, values):
    """A model y = x + w whose initializer w is stored externally at ``location``."""
    w = numpy_helper.from_array(values, "w")
    w.ClearField("raw_data")
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", location), ("offset", "0"), ("length", str(values.nbytes))):
        e = w.external_data.add()
        e.key, e.value = k, v
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"], name="add")], "ext",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])], [w])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    path = dirpath / "model.onnx"
    path.write_bytes(m.SerializeToString())
    return path


def test_external_data_inside_model_dir(tmp_path):
    vals = np.arange(4, dtype=np.float32)
    (tmp_path / "weights.bin").write_bytes(vals.tobytes())
    path = _external_model(tmp_path, "weights.bin", vals)
    y = apollo_py.jit(str(path), target="reference")(np.ones(4, np.float32))
    np.testing.assert_array_equal(y, vals + 1)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_external_data_outside_model_dir(tmp_path, kind):
    vals = np.arange(4, dtype=np.float32)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    secret = tmp_path / "secret.bin"
    secret.write_bytes(vals.tobytes())
    if kind == "dotdot":
        location = "../secret.bin"
    elif kind == "absolute":
        location = str(secret)
    else:
        os.symlink(secret, model_dir / "link.bin")
        location = "link.bin"
    path = _external_model(model_dir, location, vals)
    with pytest.raises(ModelLoadError) as e:
        apollo_py.jit(str(path), target="reference")
    assert "outside" in str(e.value) or "relative path inside" in str(e.value)


def test_external_data_without_a_path(tmp_path):
    vals = np.arange(4, dtype=np.float32)
    (tmp_path / "weights.bin").write_bytes(vals.tobytes())
    path = _external_model(tmp_path, "weights.bin", vals)
    with pytest.raises(ModelLoadError, match="external data"):
        apollo_py.jit(path.read_bytes(), target="reference")


def test_load_does_not_need_onnx_at_import():
    import subprocess
    import sys
    code = "import sys, apollo_py; print('onnx' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == "False", out.stderr


def test_external_initializers_are_memory_mapped_not_copied(tmp_path):
    """Load maps external weights (np.memmap over the data file) and leaves the proto without
    them, so a model whose weights exceed 2 GB is not held twice; the numbers still match."""
    import onnx

    rng = np.random.default_rng(0)
    w1 = rng.standard_normal((16, 8)).astype(np.float32)
    b1 = rng.standard_normal(8).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm"), helper.make_node("Add", ["h", "b1"], ["y"], name="add")],
        "ext", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 8])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(m, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    f = apollo_py.jit(str(tmp_path / "m.onnx"), target="reference")
    for name, want in (("w1", w1), ("b1", b1)):
        arr = f.program.initializers[name]
        assert isinstance(arr, np.memmap) and not arr.flags.writeable
        np.testing.assert_array_equal(arr, want)
    x = rng.standard_normal((3, 16)).astype(np.float32)
    np.testing.assert_allclose(f(x), x @ w1 + b1, rtol=1e-5, atol=1e-6)


def test_external_data_shorter_than_the_tensor(tmp_path):
    vals = np.arange(4, dtype=np.float32)
    (tmp_path / "weights.bin").write_bytes(vals.tobytes()[:8])
    path = _external_model(tmp_path, "weights.bin", vals)
    with pytest.raises(ModelLoadError, match="truncated"):
        apollo_py.jit(str(path), target="reference")
