"""The CLI on models with symbolic input dims: --shape NAME=D0,D1,... pins them."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from apollo_py.cli import main, parse_shapes
from apollo_py.errors import ApolloError


@pytest.fixture
def dynamic_model(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    g = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=1)], "dyn", [x], [y])
    path = tmp_path / "dyn.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return str(path)


def test_explain_needs_and_takes_shapes(dynamic_model, capsys):
    assert main(["explain", dynamic_model]) == 2
    assert "--shape x=D0,D1,..." in capsys.readouterr().err
    assert main(["explain", dynamic_model, "--shape", "x=3,4"]) == 0
    out = capsys.readouterr().out
    assert "plan for" in out and "reduce_max" in out


def test_run_with_pinned_shape(dynamic_model, tmp_path, capsys):
    xv = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "x.npy", xv)
    assert main(["run", dynamic_model, "--shape", "x=3,4", "--input", f"x={tmp_path / 'x.npy'}",
                 "--out", str(tmp_path)]) == 0
    e = np.exp(xv - xv.max(axis=1, keepdims=True))
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), e / e.sum(axis=1, keepdims=True), rtol=1e-6)
    assert main(["run", dynamic_model, "--shape", "x=2,4", "--input", f"x={tmp_path / 'x.npy'}"]) == 2
    assert "pinned to (2, 4)" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["x", "x=a,b", "=3", "x=-1,2"])
def test_bad_shape_options_are_named(bad):
    with pytest.raises(ApolloError, match="--shape"):
        parse_shapes([bad])
    assert parse_shapes(["s="]) == {"s": ()}
