"""ConvTranspose with kernel == stride (U-Net's 2x2 / stride 2 up-convolution) and DepthToSpace
(CRD) after a conv: the GEMM stores its result depth-to-space (codegen/gemm_subpixel.py,
layers/gemm_reshape_epilogue.fold_subpixel_stores), so the plan has one GEMM step and no
reshape / transpose step or copy kernel; a following ReLU is the GEMM's epilogue.  Against
onnxruntime at rtol / atol 1e-5; layouts it does not cover keep their transpose step."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap
from apollo_py.layers import gemm_reshape_epilogue as GRE

ort = pytest.importorskip("onnxruntime")
N_ = helper.make_node
TOL = 1e-5


def _model(nodes, x_shape, inits):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def convt_model(cin, cout, ks, sp, batch=1, bias=True, relu=False, seed=0):
    """``ConvTranspose(kernel = stride = ks)`` of ``[batch, cin, *sp]``, optional bias and ReLU."""
    rng = np.random.default_rng(seed)
    inits = {"w": (rng.standard_normal((cin, cout, *ks)) / np.sqrt(cin)).astype(np.float32)}
    ins = ["x", "w"]
    if bias:
        inits["b"] = rng.standard_normal(cout).astype(np.float32)
        ins.append("b")
    nodes = [N_("ConvTranspose", ins, ["t" if relu else "y"], kernel_shape=list(ks), strides=list(ks))]
    if relu:
        nodes.append(N_("Relu", ["t"], ["y"]))
    return _model(nodes, [batch, cin, *sp], inits)


def _run(model, x, tmp_path, flag=True, gemm="auto"):
    old = GRE.SUBPIXEL_STORES
    GRE.SUBPIXEL_STORES = flag
    try:
        f = ap.jit(model.SerializeToString(), options=ap.Options(cache_dir=str(tmp_path / str(flag)), gemm=gemm))
        got = np.asarray(f(x=x))
    finally:
        GRE.SUBPIXEL_STORES = old
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    return f.plan


def _moves(plan) -> list:
    """Steps other than GEMMs that move data: reshapes, transposes (numpy steps or copy kernels)."""
    return [k for k in plan.kernels if k.gemm is None
            and any(n.op in ("reshape", "transpose") for n in (k.fused.nodes if k.fused is not None else k.nodes))]


CASES = [
    # cin, cout, kernel == stride, spatial, batch, bias, relu
    (128, 64, (2, 2), (32, 32), 1, True, False),     # U-Net's up-conv: row-reading 1x1 conv
    (128, 64, (2, 2), (32, 32), 2, True, True),
    (16, 8, (2, 2), (8, 8), 2, True, True),          # small: implicit GEMM on the calling thread
    (24, 12, (2, 2), (5, 7), 1, False, True),        # odd spatial sizes, no bias
    (32, 5, (3, 3), (16, 16), 1, True, True),        # groups of 3 rows: implicit GEMM
    (96, 16, (3, 3), (24, 24), 1, True, True),       # ... row-reading conv, MR = 8: some straddle a tile
    (8, 16, (2, 1), (12, 10), 1, True, False),       # kw = 1: contiguous runs, no interleave
    (64, 32, (4, 4), (16, 16), 1, True, True),
    (32, 16, (2,), (40,), 2, True, True),            # 1-d
    (64, 48, (4,), (300,), 1, True, False),
    (48, 7, (3,), (33,), 1, False, True),
]


@pytest.mark.parametrize("cin, cout, ks, sp, batch, bias, relu", CASES)
def test_conv_transpose_stores_depth_to_space(cin, cout, ks, sp, batch, bias, relu, tmp_path):
    x = np.random.default_rng(1).standard_normal((batch, cin, *sp)).astype(np.float32)
    model = convt_model(cin, cout, ks, sp, batch, bias, relu)
    plan = _run(model, x, tmp_path)
    gemms = [k for k in plan.kernels if k.gemm is not None]
    assert len(plan.kernels) == 1 and len(gemms) == 1, [k.reason for k in plan.kernels]
    d = gemms[0].gemm
    assert d.out_perm is not None and "depth-to-space" in gemms[0].reason
    assert ("relu" in [n.op for n in d.nodes]) == relu
    assert not _moves(plan)
    # the old path (a flag for A/B runs): the reshape / transpose steps, the same numbers
    old = _run(model, x, tmp_path, flag=False)
    assert _moves(old) and len(old.kernels) > 1


def test_depth_to_space_crd_after_conv(tmp_path):
    """DepthToSpace (CRD) of a 1x1 conv's result, then a per-channel scale and a ReLU: one step."""
    rng = np.random.default_rng(0)
    inits = {"w": (rng.standard_normal((64, 32, 1, 1)) / 6).astype(np.float32),
             "b": rng.standard_normal(64).astype(np.float32),
             "s": rng.standard_normal((1, 16, 1, 1)).astype(np.float32)}
    model = _model([N_("Conv", ["x", "w", "b"], ["c"]), N_("DepthToSpace", ["c"], ["d"], blocksize=2, mode="CRD"),
                    N_("Mul", ["d", "s"], ["m"]), N_("Relu", ["m"], ["y"])], [2, 32, 20, 24], inits)
    x = rng.standard_normal((2, 32, 20, 24)).astype(np.float32)
    plan = _run(model, x, tmp_path)
    assert len(plan.kernels) == 1 and not _moves(plan), [k.reason for k in plan.kernels]
    assert [n.op for n in plan.kernels[0].gemm.nodes] == ["add", "mul", "relu"]


def test_layouts_it_does_not_cover_stay(tmp_path):
    """DepthToSpace in DCR mode (the sub-pixel rows are not adjacent rows of C) and a residual
    operand in the output's own layout (its memory is not C's order): as before."""
    rng = np.random.default_rng(0)
    inits = {"w": (rng.standard_normal((64, 32, 1, 1)) / 6).astype(np.float32)}
    dcr = _model([N_("Conv", ["x", "w"], ["c"]), N_("DepthToSpace", ["c"], ["y"], blocksize=2, mode="DCR")],
                 [1, 32, 16, 16], inits)
    x = rng.standard_normal((1, 32, 16, 16)).astype(np.float32)
    assert _moves(_run(dcr, x, tmp_path))
    # the ConvTranspose's result plus the up-sampled input itself: stored depth-to-space, but
    # the add stays a kernel of its own
    w = {"w": (rng.standard_normal((8, 8, 2, 2)) / 3).astype(np.float32), "u": np.ones((1, 8, 2, 2), np.float32)}
    res = _model([N_("ConvTranspose", ["x", "w"], ["t"], kernel_shape=[2, 2], strides=[2, 2]),
                  N_("Resize", ["x", "", "", "sz"], ["r"], mode="nearest"), N_("Add", ["t", "r"], ["y"])],
                 [1, 8, 16, 16], {**w, "sz": np.array([1, 8, 32, 32], np.int64)})
    x = rng.standard_normal((1, 8, 16, 16)).astype(np.float32)
    plan = _run(res, x, tmp_path)
    gemm = next(k for k in plan.kernels if k.gemm is not None)
    assert "depth-to-space" in gemm.reason and "add" not in [n.op for n in gemm.gemm.nodes]


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("batch", [1, 2])
def test_unet_small_up_conv_is_one_step(exporter, batch, tmp_path):
    """The zoo's small U-Net (both exporters): its up-conv is one GEMM step, no copy kernel, and
    the model still matches onnxruntime."""
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "models", "zoo", f"unet_small.{exporter}.onnx")
    x = np.random.default_rng(2).standard_normal((batch, 3, 16, 16)).astype(np.float32)
    f = ap.jit(path, options=ap.Options(cache_dir=str(tmp_path)))
    got = np.asarray(f(x=x))
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
    assert any("depth-to-space" in k.reason for k in f.plan.kernels if k.gemm is not None)
    # (the Resize's transposes are another matter)
    assert not [k for k in _moves(f.plan) if any("ConvTranspose" in "".join(n.source) for n in
                                                 (k.fused.nodes if k.fused is not None else k.nodes))]


def _matmul_chain(perm, split, final=None, scale=False):
    rng = np.random.default_rng(0)
    inits = {"w": (rng.standard_normal((32, 48)) / 6).astype(np.float32), "b": rng.standard_normal(48).astype(np.float32),
             "split": np.array(split, np.int64), "s": np.array(0.5, np.float32)}
    nodes = [N_("MatMul", ["x", "w"], ["m"]), N_("Add", ["m", "b"], ["a"]), N_("Reshape", ["a", "split"], ["r"]),
             N_("Transpose", ["r"], ["t" if final or scale else "y"], perm=list(perm))]
    if final:
        inits["final"] = np.array(final, np.int64)
        nodes.append(N_("Reshape", ["t", "final"], ["tf" if scale else "y"]))
    if scale:
        nodes.append(N_("Mul", ["tf" if final else "t", "s"], ["y"]))
    return _model(nodes, [16, 32], inits)


def test_matmul_result_stored_depth_to_space(tmp_path):
    """Any generated GEMM: a [16, 48] product split [4, 4, 2, 24] and stored transposed (0, 2, 3, 1),
    the last row dim innermost (groups of 4 rows), then reshaped and scaled: one step."""
    x = np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)
    plan = _run(_matmul_chain((0, 2, 3, 1), [4, 4, 2, 24], [4, 2, 96], scale=True), x, tmp_path, gemm="generated")
    assert len(plan.kernels) == 1 and "depth-to-space" in plan.kernels[0].reason, [k.reason for k in plan.kernels]


def test_matmul_head_split_stays(tmp_path):
    """BERT's head split (reshape [1, S, H, d] -> transpose (0, 2, 1, 3) -> one reader): not
    this fold's (no interleave; fold_operand_transposes and the attention fold own it)."""
    x = np.random.default_rng(1).standard_normal((16, 32)).astype(np.float32)
    plan = _run(_matmul_chain((0, 2, 1, 3), [1, 16, 4, 12], scale=True), x, tmp_path, gemm="generated")
    assert not any("depth-to-space" in k.reason for k in plan.kernels)
