"""target="cpu": batched matmuls (attention), transposed operands read in place and constant
weights packed once, on the generated GEMM through ap.jit -- numbers against numpy."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.codegen.gemm import OperandView, compile_gemm, matmul_desc
from apollo_py.runtime.threadpool import ThreadPool

RTOL, ATOL = 1e-4, 1e-4


def _rand(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def _check(got, want):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * max(1.0, float(np.abs(want).max())))


def _kinds(f):
    return [k.to_dict()["kind"] for k in f.plan.kernels]


def _matmul_graph(xs, src_shape, perm=None, const=None, epilogue=None):
    """``x @ transpose(w, perm)`` (w an input, or the constant ``const``), then ``epilogue``."""
    b = ap.GraphBuilder("mm")
    x = b.input("x", xs)
    w = b.constant(const) if const is not None else b.input("w", src_shape)
    if perm is not None:
        w = b.transpose(w, perm=perm)
    y = b.matmul(x, w)
    return b.build([epilogue(b, y) if epilogue else y])


@pytest.mark.parametrize("xs,ws", [
    ((1, 12, 17, 8), (1, 12, 8, 17)),      # attention scores, odd sequence
    ((2, 3, 1, 5), (2, 3, 5, 3)),          # one query row
    ((2, 1, 127, 3), (1, 4, 3, 129)),      # broadcast batch dims on both sides
    ((4, 17, 129), (4, 129, 1)),           # thin
    ((3, 17), (5, 17, 127)),               # 2-D left, batched right
    ((2, 2, 129, 127), (2, 2, 127, 17)),   # probs @ V, sizes around the micro-tile
])
def test_batched_matmul_is_one_generated_kernel(xs, ws):
    f = ap.jit(_matmul_graph(xs, ws), target="cpu")
    assert _kinds(f) == ["gemm"], str(f.plan)
    assert "batched right operand" in str(f.plan)
    rng = np.random.default_rng(0)
    x, w = _rand(rng, *xs), _rand(rng, *ws)
    _check(f(x, w), np.matmul(x.astype(np.float64), w))


@pytest.mark.parametrize("xs,src,perm", [
    ((2, 3, 17, 5), (2, 3, 129, 5), (0, 1, 3, 2)),      # x @ kᵀ, k [B, H, S, d]
    ((1, 4, 17, 8), (1, 17, 4, 8), (0, 2, 3, 1)),       # the exporters' key: [B, S, H, d] -> [B, H, d, S]
    ((1, 4, 9, 9), (1, 9, 4, 3), (0, 2, 1, 3)),         # the exporters' value: [B, S, H, d] -> [B, H, S, d]
    ((3, 1, 17), (17, 5, 3), (2, 0, 1)),
])
def test_operand_transpose_is_read_in_place(xs, src, perm):
    f = ap.jit(_matmul_graph(xs, src, perm), target="cpu")
    assert _kinds(f) == ["gemm"], str(f.plan)
    assert "in place" in str(f.plan)
    rng = np.random.default_rng(1)
    x, w = _rand(rng, *xs), _rand(rng, *src)
    _check(f(x, w), np.matmul(x.astype(np.float64), w.transpose(perm)))


def test_transposed_left_operand_in_place():
    b = ap.GraphBuilder("mm")
    q = b.transpose(b.input("q", (1, 17, 3, 8)), perm=(0, 2, 1, 3))     # [1, 3, 17, 8]
    k = b.transpose(b.input("k", (1, 129, 3, 8)), perm=(0, 2, 3, 1))    # [1, 3, 8, 129]
    f = ap.jit(b.build([b.matmul(q, k)]), target="cpu")
    assert _kinds(f) == ["gemm"], str(f.plan)
    rng = np.random.default_rng(2)
    qv, kv = _rand(rng, 1, 17, 3, 8), _rand(rng, 1, 129, 3, 8)
    _check(f(qv, kv), np.matmul(qv.transpose(0, 2, 1, 3).astype(np.float64), kv.transpose(0, 2, 3, 1)))


def test_shared_transpose_is_not_folded():
    b = ap.GraphBuilder("mm")
    x = b.input("x", (2, 9, 5))
    kt = b.transpose(b.input("k", (2, 7, 5)), perm=(0, 2, 1))
    f = ap.jit(b.build([b.matmul(x, kt), kt]), target="cpu")
    assert "in place" not in str(f.plan)
    rng = np.random.default_rng(3)
    xv, kv = _rand(rng, 2, 9, 5), _rand(rng, 2, 7, 5)
    y, t = f(xv, kv)
    _check(y, np.matmul(xv.astype(np.float64), kv.transpose(0, 2, 1)))
    np.testing.assert_array_equal(t, kv.transpose(0, 2, 1))


@pytest.mark.parametrize("xs,ws", [((1, 3), (3, 17)), ((17, 127), (127, 129)), ((3, 129, 300), (300, 700)),
                                   ((128, 600), (600, 1100))])
def test_constant_weight_packed_once(xs, ws):
    rng = np.random.default_rng(4)
    w = _rand(rng, *ws)
    f = ap.jit(_matmul_graph(xs, ws, const=w), target="cpu", options=ap.Options(gemm="generated"))
    for seed in (5, 6):      # the second call reuses the packed weight
        x = _rand(np.random.default_rng(seed), *xs)
        _check(f(x), np.matmul(x.astype(np.float64), w))


def test_bias_gelu_residual_epilogue_on_batched_product():
    rng = np.random.default_rng(8)
    bias, res = _rand(rng, 1, 1, 129), _rand(rng, 2, 3, 17, 129)

    def epi(b, y):
        z = y + b.constant(bias)
        g = z * b.constant(np.float32(0.5)) * (b.erf(z * b.constant(np.float32(0.7071067811865476)))
                                                + b.constant(np.float32(1.0)))
        return g + b.constant(res)
    f = ap.jit(_matmul_graph((2, 3, 17, 8), (2, 3, 8, 129), epilogue=epi), target="cpu")
    assert _kinds(f) == ["gemm"], str(f.plan)
    x, w = _rand(rng, 2, 3, 17, 8), _rand(rng, 2, 3, 8, 129)
    z = np.matmul(x.astype(np.float64), w) + bias
    from math import erf
    want = z * 0.5 * (np.vectorize(erf)(z / np.sqrt(2)) + 1) + res
    _check(f(x, w), want)


def test_operand_view_in_the_kernel():
    """OperandView directly: A and B both transposed sources, through compile_gemm."""
    from dataclasses import replace
    rng = np.random.default_rng(9)
    a_src, b_src = _rand(rng, 2, 5, 17), _rand(rng, 33, 2, 5)     # A = a_src (0,2,1), B = b_src (1,2,0)
    d = matmul_desc("v", (2, 17, 5), (2, 5, 33), (2, 17, 33), "h", outputs=("h",), out_dtypes=("float32",))
    d = replace(d, a_view=OperandView.transposed(a_src.shape, (0, 2, 1)),
                b_view=OperandView.transposed(b_src.shape, (1, 2, 0)))
    cg = compile_gemm(d, 2)
    out = np.empty((2, 17, 33), np.float32)
    with ThreadPool(2) as pool:
        cg.run(pool, a_src, b_src, [], [out])
    _check(out, np.matmul(a_src.transpose(0, 2, 1).astype(np.float64), b_src.transpose(1, 2, 0)))


def _attention_model(s=17, heads=3, d=8, seed=10):
    """A BERT self-attention block as torch's exporters write it: projections with constant
    weights, Reshape to [B, S, H, d], Transpose (0, 2, 1, 3) / (0, 2, 3, 1), scaled scores plus
    a mask, Softmax, probs @ V, Transpose back, Reshape, output projection."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    hid = heads * d
    w = {k: (rng.standard_normal((hid, hid)) / np.sqrt(hid)).astype(np.float32) for k in "qkvo"}
    inits = [numpy_helper.from_array(v, "w" + k) for k, v in w.items()]
    inits += [numpy_helper.from_array(np.array([1, s, heads, d], np.int64), "split"),
              numpy_helper.from_array(np.array([1, s, hid], np.int64), "merge"),
              numpy_helper.from_array(np.array(1 / np.sqrt(d), np.float32), "scale")]
    N = helper.make_node
    nodes = [N("MatMul", ["x", "wq"], ["q0"]), N("MatMul", ["x", "wk"], ["k0"]), N("MatMul", ["x", "wv"], ["v0"]),
             N("Reshape", ["q0", "split"], ["q1"]), N("Reshape", ["k0", "split"], ["k1"]),
             N("Reshape", ["v0", "split"], ["v1"]),
             N("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]), N("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
             N("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
             N("MatMul", ["q", "kt"], ["sc0"]), N("Mul", ["sc0", "scale"], ["sc1"]), N("Add", ["sc1", "mask"], ["sc"]),
             N("Softmax", ["sc"], ["p"], axis=-1), N("MatMul", ["p", "v"], ["ctx0"]),
             N("Transpose", ["ctx0"], ["ctx1"], perm=[0, 2, 1, 3]), N("Reshape", ["ctx1", "merge"], ["ctx"]),
             N("MatMul", ["ctx", "wo"], ["y"])]
    g = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, s, hid]),
                                               helper.make_tensor_value_info("mask", TensorProto.FLOAT, [1, 1, 1, s])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), w


def test_attention_block_has_no_numpy_matmul_step():
    s, heads, d = 17, 3, 8
    model, w = _attention_model(s, heads, d)
    # the two-GEMM form (Options.attention="fused"/"auto" makes it one step: tests/layers/test_attention.py)
    f = ap.jit(model, target="cpu", options=ap.Options(attention="unfused"))
    x = _rand(np.random.default_rng(11), 1, s, heads * d)
    mask = np.where(np.arange(s) < 13, 0.0, -1e4).astype(np.float32).reshape(1, 1, 1, s)
    got = f(x, mask)
    steps = f.plan.kernels
    mm_steps = [k for k in steps if any(n.op == "matmul" for n in k.nodes)]
    assert len(mm_steps) == 6, str(f.plan)       # three projections, scores, context, output
    assert all(k.gemm is not None or k.blas is not None for k in mm_steps), str(f.plan)
    batched = [k for k in mm_steps if k.gemm is not None and k.gemm.batch == heads]
    assert len(batched) == 2, str(f.plan)
    # the key and value transposes are read in place by the two batched GEMMs
    assert sum("in place" in k.reason for k in batched) == 2, str(f.plan)
    # ... and the context's transpose back to [B, S, H, d] is the second one's store layout
    assert "stores its result transposed (0, 2, 1, 3)" in batched[1].reason, str(f.plan)
    assert not any(n.op == "transpose" for k in steps if k.gemm is None for n in k.nodes), str(f.plan)
    # reference computation in float64
    x64 = x.astype(np.float64)
    q, k, v = ((x64 @ w[c]).reshape(1, s, heads, d).transpose(0, 2, 1, 3) for c in "qkv")
    sc = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d) + mask
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = (p @ v).transpose(0, 2, 1, 3).reshape(1, s, heads * d) @ w["o"]
    _check(got, want)


@pytest.mark.parametrize("xs,ws,perm", [((2, 3, 17, 8), (2, 3, 8, 5), (0, 2, 1, 3)),
                                        ((3, 17, 129), (3, 129, 3), (2, 0, 1)),
                                        ((1, 17, 8), (8, 129), (0, 2, 1))])
def test_result_transpose_is_stored_in_place(xs, ws, perm):
    rng = np.random.default_rng(12)
    bias = _rand(rng, ws[-1])
    f = ap.jit(_matmul_graph(xs, ws, epilogue=lambda b, y: b.transpose(b.relu(y + b.constant(bias)), perm=perm)),
               target="cpu", options=ap.Options(gemm="generated"))
    assert _kinds(f) == ["gemm"], str(f.plan)
    assert "stores its result transposed" in str(f.plan)
    x, w = _rand(rng, *xs), _rand(rng, *ws)
    want = np.maximum(np.matmul(x.astype(np.float64), w) + bias, 0).transpose(perm)
    _check(f(x, w), want)


def test_same_product_in_two_layers_is_one_piece():
    """Two linear layers of one shape and epilogue, differently named values: one engine."""
    rng = np.random.default_rng(13)
    w1, w2, bias = _rand(rng, 24, 24), _rand(rng, 24, 24), _rand(rng, 24)
    b = ap.GraphBuilder("two")
    x = b.input("x", (5, 24))
    h = b.relu(b.matmul(x, b.constant(w1)) + b.constant(bias))
    y = b.relu(b.matmul(h, b.constant(w2)) + b.constant(bias))
    f = ap.jit(b.build([y]), target="cpu", options=ap.Options(gemm="generated"))
    gemms = [k.gemm for k in f.plan.kernels if k.gemm is not None]
    assert len(gemms) == 2, str(f.plan)
    from apollo_py.codegen.gemm import canonical
    assert canonical(gemms[0]) == canonical(gemms[1])
    xv = _rand(rng, 5, 24)
    h64 = np.maximum(xv.astype(np.float64) @ w1 + bias, 0)
    _check(f(xv), np.maximum(h64 @ w2 + bias, 0))


@pytest.mark.parametrize("xs,ws,kind,why", [
    ((5, 24), (24, 24), "blas", "small product"),
    ((128, 256), (256, 64), "gemm", "constant right operand, packed once"),
    ((128, 256), (256, 8), "blas", "thin product"),
])
def test_auto_rule_for_constant_weights(xs, ws, kind, why):
    rng = np.random.default_rng(14)
    w = _rand(rng, *ws)
    f = ap.jit(_matmul_graph(xs, ws, const=w), target="cpu")
    from apollo_py.runtime.blas import cblas
    if kind == "blas" and cblas() is None:
        kind = "reference"
    assert _kinds(f) == [kind] and why in str(f.plan), str(f.plan)
    x = _rand(rng, *xs)
    _check(f(x), x.astype(np.float64) @ w)


@pytest.mark.parametrize("xs,ws,group", [((2, 64, 14, 14), (64, 64, 3, 3), 1), ((1, 48, 9, 9), (96, 24, 3, 3), 2),
                                         ((1, 64, 28, 28), (100, 64, 3, 3), 1)])
def test_constant_conv_weight_packed_once(xs, ws, group):
    """A conv's constant weight (A) packed once for all row groups gives the per-tile result."""
    from dataclasses import replace

    from apollo_py.codegen.gemm import conv_desc
    attrs = {"group": group, "strides": (1, 1), "pads": (1, 1, 1, 1), "dilations": (1, 1)}
    out_shape = (xs[0], ws[0], xs[2], xs[3])
    d = conv_desc("c", xs, ws, out_shape, attrs, "h", outputs=("h",), out_dtypes=("float32",))
    rng = np.random.default_rng(15)
    x, w = _rand(rng, *xs), _rand(rng, *ws)
    got = []
    with ThreadPool(2) as pool:
        for a_const in (False, True):
            cg = compile_gemm(replace(d, a_const=a_const), 2)
            for _ in range(2):      # the second call reuses the packed weight
                out = np.empty(out_shape, np.float32)
                cg.run(pool, w, x, [], [out])
                got.append(out)
    for g in got[1:]:
        np.testing.assert_allclose(g, got[0], rtol=1e-6, atol=1e-5)
