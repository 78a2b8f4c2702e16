"""A generated GEMM's result reshaped, then sliced into column pieces (GPT-2's
``Gemm -> Reshape -> Split`` of Q, K, V: layers/joint_gemm.split_projections) or read by an
elementwise chain (GPT-2's GELU after ``Gemm -> Reshape``:
layers/gemm_reshape_epilogue.py): one GEMM step, no slice or reshape step or separate kernel,
against onnxruntime; and the cases that must stay as they were."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap

ort = pytest.importorskip("onnxruntime")
N_ = helper.make_node
RTOL = 1e-5


def _model(nodes, x_shape, outputs, inits):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                          initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _check(model, feeds, options):
    f = ap.jit(model.SerializeToString(), options=options)
    got = f(**feeds)
    got = list(got.values()) if isinstance(got, dict) else list(got) if isinstance(got, (list, tuple)) else [got]
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g = np.asarray(g)
        assert g.shape == w.shape
        err = float(np.max(np.abs(g - w))) / max(float(np.max(np.abs(w))), 1e-30)
        assert err <= RTOL, err
    return f.plan


def _split_model(s, d, widths, reshape=True, extra_reader=False):
    rng = np.random.default_rng(0)
    n = sum(widths)
    w = {"w": (rng.standard_normal((d, n)) / np.sqrt(d)).astype(np.float32),
         "shape": np.array([1, s, n], np.int64), "split": np.array(widths, np.int64)}
    outs = [f"p{q}" for q in range(len(widths))]
    nodes = [N_("MatMul", ["x", "w"], ["y"])]
    src = "y"
    if reshape:
        nodes.append(N_("Reshape", ["y", "shape"], ["y3"]))
        src = "y3"
    nodes.append(N_("Split", [src, "split"], outs, axis=-1))
    # the pieces are the outputs here (in GPT-2, the attention's Q, K, V: an elementwise reader
    # would take its slice into its own kernel instead)
    outputs = list(outs)
    if extra_reader:
        nodes.append(N_("Relu", ["y"], ["r"]))
        outputs.append("r")
    return _model(nodes, [s, d], outputs, w)


@pytest.mark.parametrize("s, d, widths, reshape", [
    (40, 64, (64, 64, 64), True),        # GPT-2's shape of it: on the calling thread
    (200, 96, (96, 32, 160), False),     # uneven pieces, no reshape; on the pool
])
def test_split_into_column_slices(s, d, widths, reshape, tmp_path):
    x = np.random.default_rng(1).standard_normal((s, d)).astype(np.float32)
    plan = _check(_split_model(s, d, widths, reshape), {"x": x}, ap.Options(gemm="generated", cache_dir=str(tmp_path)))
    gemms = [k for k in plan.kernels if k.gemm is not None]
    assert len(gemms) == 1 and [p.n for p in gemms[0].gemm.parts] == list(widths), [k.reason for k in gemms]
    assert "split into the column slices" in gemms[0].reason
    assert not [k for k in plan.kernels if k.gemm is None and k.fused is None
                and any(n.op in ("slice", "reshape") for n in k.nodes)]


@pytest.mark.parametrize("widths, extra", [((64, 48, 80), False), ((64, 64, 64), True)])
def test_split_stays_apart(widths, extra, tmp_path):
    """A piece that does not start at a multiple of the micro-tile's NR (32) columns, or a
    product whose result something else reads too: slices as before."""
    x = np.random.default_rng(1).standard_normal((40, 64)).astype(np.float32)
    plan = _check(_split_model(40, 64, widths, True, extra), {"x": x},
                  ap.Options(gemm="generated", cache_dir=str(tmp_path)))
    assert not any(k.gemm is not None and k.gemm.parts for k in plan.kernels)


def _gelu_model(s, d, n, bias_after=False):
    rng = np.random.default_rng(0)
    w = {"w": (rng.standard_normal((d, n)) / np.sqrt(d)).astype(np.float32),
         "shape": np.array([1, s, n], np.int64), "half": np.array(0.5, np.float32),
         "c": np.array(0.044715, np.float32), "three": np.array(3.0, np.float32),
         "k": np.array(0.7978846, np.float32), "one": np.array(1.0, np.float32),
         "b": rng.standard_normal(n).astype(np.float32)}
    nodes = [N_("MatMul", ["x", "w"], ["y"]), N_("Reshape", ["y", "shape"], ["h"])]
    if bias_after:      # a [n] operand broadcast against the reshaped [1, s, n]
        nodes += [N_("Add", ["h", "b"], ["hb"])]
    h = "hb" if bias_after else "h"
    nodes += [N_("Pow", [h, "three"], ["p"]), N_("Mul", ["p", "c"], ["pc"]), N_("Add", [h, "pc"], ["t0"]),
              N_("Mul", ["t0", "k"], ["t1"]), N_("Tanh", ["t1"], ["t2"]), N_("Add", ["t2", "one"], ["t3"]),
              N_("Mul", [h, "half"], ["hh"]), N_("Mul", ["hh", "t3"], ["g"])]
    return _model(nodes, [s, d], ["g"], w)


@pytest.mark.parametrize("s, d, n, bias", [(40, 64, 96, False), (130, 96, 200, True)])
def test_gelu_through_reshape_is_the_epilogue(s, d, n, bias, tmp_path):
    x = np.random.default_rng(1).standard_normal((s, d)).astype(np.float32)
    plan = _check(_gelu_model(s, d, n, bias), {"x": x}, ap.Options(gemm="generated", cache_dir=str(tmp_path)))
    gemms = [k for k in plan.kernels if k.gemm is not None]
    assert len(gemms) == 1 and "tanh" in [nd.op for nd in gemms[0].gemm.nodes], [k.reason for k in plan.kernels]
    assert gemms[0].gemm.out_shape == (1, s, n)
    assert not [k for k in plan.kernels if k.fused is not None]
