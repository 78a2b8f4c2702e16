"""Fused attention (layers/attention.py, codegen/attention.py) against onnxruntime: the
exporters' spellings (BERT's scale + additive mask with the head transposes read in place,
T5's position bias without scale, GPT-2's causal where / additive -inf, Llama's GQA
repeat_kv), odd sequence lengths, plan pins, and the fallback when the pattern differs."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap

ort = pytest.importorskip("onnxruntime")
N_ = helper.make_node


def _model(nodes, inputs, outputs, inits=()):
    g = helper.make_graph(nodes, "attn", [helper.make_tensor_value_info(n, TensorProto.FLOAT if t is None else t, s)
                                          for n, s, t in inputs],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
                          initializer=list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _bert(b, h, m, n, d):
    """[B, S, H, d] heads transposed by the exporters' Transpose nodes, / sqrt(d), + mask."""
    nodes = [N_("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]), N_("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
             N_("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]), N_("MatMul", ["q", "kt"], ["s0"]),
             N_("Div", ["s0", "sq"], ["s1"]), N_("Add", ["s1", "mask"], ["s"]),
             N_("Softmax", ["s"], ["p"], axis=-1), N_("MatMul", ["p", "v"], ["c0"]),
             N_("Transpose", ["c0"], ["y"], perm=[0, 2, 1, 3])]
    ins = [("q1", [b, m, h, d], None), ("k1", [b, n, h, d], None), ("v1", [b, n, h, d], None),
           ("mask", [b, 1, 1, n], None)]
    return _model(nodes, ins, ["y"], [numpy_helper.from_array(np.array(np.sqrt(d), np.float32), "sq")])


def _bert_scaled_heads(b, h, m, n, d):
    """HF BERT as torch exports it: Q and K^T each multiplied by d^-1/4 after their head
    transposes (a transpose-mul kernel each, unfused), + mask."""
    nodes = [N_("Transpose", ["q1"], ["q0"], perm=[0, 2, 1, 3]), N_("Mul", ["q0", "c"], ["q"]),
             N_("Transpose", ["k1"], ["kt0"], perm=[0, 2, 3, 1]), N_("Mul", ["kt0", "c"], ["kt"]),
             N_("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]), N_("MatMul", ["q", "kt"], ["s0"]),
             N_("Add", ["s0", "mask"], ["s"]), N_("Softmax", ["s"], ["p"], axis=-1), N_("MatMul", ["p", "v"], ["c0"]),
             N_("Transpose", ["c0"], ["y"], perm=[0, 2, 1, 3])]
    ins = [("q1", [b, m, h, d], None), ("k1", [b, n, h, d], None), ("v1", [b, n, h, d], None),
           ("mask", [b, 1, 1, n], None)]
    return _model(nodes, ins, ["y"], [numpy_helper.from_array(np.array([d ** -0.25], np.float32), "c")])


def _t5(b, h, m, n, d):
    """No scale; a relative position bias [1, H, M, N] added to the scores."""
    nodes = [N_("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), N_("MatMul", ["q", "kt"], ["s0"]),
             N_("Add", ["s0", "bias"], ["s"]), N_("Softmax", ["s"], ["p"], axis=-1), N_("MatMul", ["p", "v"], ["y"])]
    ins = [("q", [b, h, m, d], None), ("k", [b, h, n, d], None), ("v", [b, h, n, d], None), ("bias", [1, h, m, n], None)]
    return _model(nodes, ins, ["y"])


def _causal_where(b, h, m, n, d):
    """GPT-2 (torchscript): where(tril, s * scale, -inf) with a constant boolean mask."""
    tril = np.tril(np.ones((m, n), bool), k=n - m).reshape(1, 1, m, n)
    nodes = [N_("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), N_("MatMul", ["q", "kt"], ["s0"]),
             N_("Mul", ["s0", "sc"], ["s1"]), N_("Where", ["tril", "s1", "ninf"], ["s"]),
             N_("Softmax", ["s"], ["p"], axis=-1), N_("MatMul", ["p", "v"], ["y"])]
    ins = [("q", [b, h, m, d], None), ("k", [b, h, n, d], None), ("v", [b, h, n, d], None)]
    inits = [numpy_helper.from_array(tril, "tril"), numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
             numpy_helper.from_array(np.array(d ** -0.5, np.float32), "sc")]
    return _model(nodes, ins, ["y"], inits)


def _causal_add(b, h, m, n, d):
    """Additive -inf causal mask, then dynamo's where(p != p, 0, p) after the softmax."""
    tri = np.where(np.tril(np.ones((m, n), bool), k=n - m), 0, -np.inf).astype(np.float32).reshape(1, 1, m, n)
    nodes = [N_("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]), N_("MatMul", ["q", "kt"], ["s0"]),
             N_("Add", ["s0", "tri"], ["s"]), N_("Softmax", ["s"], ["p0"], axis=-1),
             N_("IsNaN", ["p0"], ["nan"]), N_("Where", ["nan", "zero", "p0"], ["p"]), N_("MatMul", ["p", "v"], ["y"])]
    ins = [("q", [b, h, m, d], None), ("k", [b, h, n, d], None), ("v", [b, h, n, d], None)]
    inits = [numpy_helper.from_array(tri, "tri"), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    return _model(nodes, ins, ["y"], inits)


def _gqa(b, h, m, n, d):
    """Llama: K and V have h/2 heads, repeated by Unsqueeze / Expand / Reshape (repeat_kv)."""
    hk = h // 2
    nodes = []
    for t in "kv":
        nodes += [N_("Unsqueeze", [t, "ax2"], [t + "u"]), N_("Expand", [t + "u", "rep"], [t + "e"]),
                  N_("Reshape", [t + "e", "full"], [t + "r"])]
    nodes += [N_("Transpose", ["kr"], ["kt"], perm=[0, 1, 3, 2]), N_("MatMul", ["q", "kt"], ["s0"]),
              N_("Mul", ["s0", "sc"], ["s"]), N_("Softmax", ["s"], ["p"], axis=-1), N_("MatMul", ["p", "vr"], ["y"])]
    ins = [("q", [b, h, m, d], None), ("k", [b, hk, n, d], None), ("v", [b, hk, n, d], None)]
    inits = [numpy_helper.from_array(np.array([2], np.int64), "ax2"),
             numpy_helper.from_array(np.array([b, hk, 2, n, d], np.int64), "rep"),
             numpy_helper.from_array(np.array([b, h, n, d], np.int64), "full"),
             numpy_helper.from_array(np.array(d ** -0.5, np.float32), "sc")]
    return _model(nodes, ins, ["y"], inits)


def _dynamo_heads(b, h, m, n, d):
    """HF BERT as the dynamo exporter writes it: projections [B, S, H*d] split into heads by
    Reshape / Transpose, K^T as reshape [B*H, S, d] -> transpose -> reshape [B, H, d, S]
    (copies before the views were folded), Q and K^T scaled by d^-1/4, + mask."""
    c = [numpy_helper.from_array(np.array(v, np.int64), nm) for nm, v in
         (("sq", [b, m, h, d]), ("sk", [b, n, h, d]), ("f3", [b * h, n, d]), ("f4", [b, h, d, n]))]
    nodes = [N_("Reshape", ["q2", "sq"], ["q1"]), N_("Transpose", ["q1"], ["q0"], perm=[0, 2, 1, 3]),
             N_("Mul", ["q0", "c"], ["q"]),
             N_("Reshape", ["k2", "sk"], ["k1"]), N_("Transpose", ["k1"], ["k0"], perm=[0, 2, 1, 3]),
             N_("Reshape", ["k0", "f3"], ["k3"]), N_("Transpose", ["k3"], ["k4"], perm=[0, 2, 1]),
             N_("Reshape", ["k4", "f4"], ["k5"]), N_("Mul", ["k5", "c"], ["kt"]),
             N_("Reshape", ["v2", "sk"], ["v1"]), N_("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
             N_("MatMul", ["q", "kt"], ["s0"]), N_("Add", ["s0", "mask"], ["s"]),
             N_("Softmax", ["s"], ["p"], axis=-1), N_("MatMul", ["p", "v"], ["c0"]),
             N_("Transpose", ["c0"], ["y"], perm=[0, 2, 1, 3])]
    ins = [("q2", [b, m, h * d], None), ("k2", [b, n, h * d], None), ("v2", [b, n, h * d], None),
           ("mask", [b, 1, 1, n], None)]
    return _model(nodes, ins, ["y"], [numpy_helper.from_array(np.array([d ** -0.25], np.float32), "c"), *c])


SPELLINGS = {"bert": _bert, "bert_scaled_heads": _bert_scaled_heads, "t5": _t5, "causal_where": _causal_where,
             "causal_add": _causal_add, "gqa": _gqa, "dynamo_heads": _dynamo_heads}


def _feeds(model, seed=0, masked_keys=()):
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [dim.dim_value for dim in vi.type.tensor_type.shape.dim]
        feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    if "mask" in feeds:
        mask = np.zeros(feeds["mask"].shape, np.float32)
        mask[..., list(masked_keys)] = -1e4
        feeds["mask"] = mask
    return feeds


def _run(model, feeds, options=None):
    f = ap.jit(model, target="cpu", options=options)
    got = f(**feeds)
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)[0]
    return f, np.asarray(got), want


def _fused(f):
    return [k for k in f.plan.kernels if k.reason.startswith("fused attention")]


# (9, 64): one partial query block, every key block full (mask / bias operands read without
# the column clamp); (129, 129): several query and key blocks, the last ones partial; (1, 7):
# one query row (a decode step) and one partial key block, for a few spellings only (each case
# is a compile: the file's run time)
CASES = ([(s, 9, 64) for s in sorted(SPELLINGS)] + [(s, 129, 129) for s in sorted(SPELLINGS)]
         + [(s, 1, 7) for s in ("bert", "causal_add", "gqa")])


@pytest.mark.parametrize("spelling,m,n", CASES)
def test_spelling_is_one_kernel_and_matches_onnxruntime(spelling, m, n):
    b, h, d = 1, 4, 16
    model = SPELLINGS[spelling](b, h, m, n, d)
    f, got, want = _run(model, _feeds(model, masked_keys=range(0, n, 3)))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    fused = _fused(f)
    assert len(fused) == 1, str(f.plan)
    # scores, softmax and P @ V are one step: no softmax kernel and no batched GEMM left
    assert not any(k.fused is not None and any(nd.op == "exp" for nd in k.fused.nodes) for k in f.plan.kernels)
    assert not any(k.gemm is not None and k not in fused for k in f.plan.kernels), str(f.plan)
    if spelling.startswith("bert") or spelling == "dynamo_heads":
        # head transposes (and scales) read in place, result stored transposed
        assert "stores its result transposed (0, 2, 1, 3)" in fused[0].reason
        assert len(f.plan.kernels) == 1, str(f.plan)
    if spelling in ("gqa", "dynamo_heads"):
        # repeat_kv's broadcast and the head split / K^T copies are index maps of the attention
        assert len(f.plan.kernels) == 1, str(f.plan)
        assert "moving steps folded" in fused[0].reason, fused[0].reason
    if spelling == "bert_scaled_heads":
        assert "scales Q by" in fused[0].reason and "K by" in fused[0].reason, fused[0].reason
    assert "define" in fused[0].source("llvm")


def test_moved_operand_views():
    """The composed index map of a moving chain becomes a strided view and an index table
    (GQA's repeated heads read one matrix), and a map that is not strided is refused."""
    from apollo_py.layers.attention import _batched_view
    src = np.arange(2 * 5 * 3).reshape(1, 5, 2, 3)                    # [B, S, Hkv, d]
    heads = np.repeat(np.transpose(src, (0, 2, 1, 3)), 2, axis=1)      # repeat_kv: [B, 4, S, d]
    view, index = _batched_view(heads.reshape(4, 5, 3), (0, 1, 2, 3), src.size)
    assert index == (0, 0, 1, 1) and view.shape == (2, 5, 3) and view.strides == (3, 6, 1)
    assert _batched_view(heads.reshape(4, 5, 3), (3, 2, 1, 0), src.size)[1] == (1, 1, 0, 0)
    swapped = np.ascontiguousarray(heads[:, :, ::-1]).reshape(4, 5, 3)  # keys reversed: no strides
    assert _batched_view(swapped, (0, 1, 2, 3), src.size) is None
    odd = heads.reshape(4, 5, 3) + np.array([0, 0, 1, 5])[:, None, None] * 7   # offsets 0, 10, 38: not 0, s, 2 s
    assert _batched_view(odd, (0, 1, 2, 3), src.size) is None


def test_long_rows_and_wide_heads():
    """Several key blocks and query groups per head; dv not a multiple of the micro-tile."""
    model = _t5(2, 3, 300, 257, 40)
    f, got, want = _run(model, _feeds(model, seed=3))
    assert len(_fused(f)) == 1
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_fully_masked_rows_match_onnxruntime():
    """A row whose every score is -inf: NaN from the plain softmax, 0 after dynamo's
    where(p != p, 0, p) -- as onnxruntime gives."""
    b, h, m, n, d = 1, 2, 5, 9, 8
    model = _causal_where(b, h, m, n, d)
    tril = np.zeros((1, 1, m, n), bool)
    tril[..., 1:, :] = np.tril(np.ones((m - 1, n), bool), k=n - m)
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(tril, "tril"))
    f, got, want = _run(model, _feeds(model))
    assert len(_fused(f)) == 1
    assert np.isnan(want[0, :, 0]).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5, equal_nan=True)
    model = _causal_add(b, h, m, n, d)
    tri = np.full((1, 1, m, n), -np.inf, np.float32)
    tri[..., 1:, :] = 0
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(tri, "tri"))
    f, got, want = _run(model, _feeds(model))
    assert len(_fused(f)) == 1 and "NaN rows -> 0" in _fused(f)[0].reason
    assert (want[0, :, 0] == 0).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_unfused_option_keeps_the_three_steps():
    model = _bert(1, 2, 17, 17, 8)
    feeds = _feeds(model)
    f, got, want = _run(model, feeds, ap.Options(attention="unfused"))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not _fused(f)
    assert sum(k.gemm is not None for k in f.plan.kernels) == 2, str(f.plan)
    with pytest.raises(ap.errors.OptionsError):
        ap.Options(attention="flash")


def _falls_back(nodes_edit, outputs=("y",)):
    b, h, m, n, d = 1, 2, 9, 9, 8
    model = _t5(b, h, m, n, d)
    nodes_edit(model.graph)
    del model.graph.output[:]
    model.graph.output.extend(helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs)
    feeds = _feeds(model)
    f = ap.jit(model, target="cpu")
    got = f(**feeds)
    got = got if isinstance(got, (list, tuple)) else [got]
    want = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-5)
    return f


@pytest.mark.parametrize("extra", ["p", "s"])
def test_fallback_when_scores_or_probabilities_are_an_output(extra):
    f = _falls_back(lambda g: None, outputs=("y", extra))
    assert not _fused(f), str(f.plan)


def test_fallback_when_softmax_is_not_over_the_last_axis():
    def edit(g):
        for node in g.node:
            if node.op_type == "Softmax":
                node.attribute[0].i = 2      # over the queries: not attention's softmax
    f = _falls_back(edit)
    assert not _fused(f), str(f.plan)


def test_fallback_when_the_softmax_is_followed_by_other_ops():
    def edit(g):
        for node in g.node:
            if node.op_type == "MatMul" and node.input[0] == "p":
                node.input[0] = "p2"
        g.node.append(N_("Sqrt", ["p"], ["p2"]))
        # keep the node list in topological order: move the last matmul to the end
        mm = [x for x in g.node if x.op_type == "MatMul" and x.input[0] == "p2"][0]
        g.node.remove(mm)
        g.node.append(mm)
    f = _falls_back(edit)
    assert not _fused(f), str(f.plan)


def test_t5_export_every_attention_fused():
    """torch's T5 exports (tests/models/zoo): encoder self-attention with position bias,
    causal decoder self-attention, cross-attention -- 6 attentions, all fused, including the
    ones whose softmax layer 2 splits into two kernels in the torchscript export."""
    import os
    zoo = os.path.join(os.path.dirname(__file__), "..", "models", "zoo")
    for exporter in ("torchscript", "dynamo"):
        path = os.path.join(zoo, f"t5_tiny.{exporter}.onnx")
        rng = np.random.default_rng(5)
        feeds = {"input_ids": rng.integers(0, 128, (1, 16)), "decoder_input_ids": rng.integers(0, 127, (1, 8))}
        f = ap.jit(path, target="cpu", input_shapes={k: v.shape for k, v in feeds.items()})
        got = f(**feeds)
        got = got if isinstance(got, (list, tuple)) else [got]
        want = ort.InferenceSession(path).run(None, feeds)
        for g, w in zip(got, want):
            np.testing.assert_allclose(np.asarray(g), w, rtol=1e-4, atol=1e-4 * float(np.abs(w).max()))
        assert len(_fused(f)) == 6, str(f.plan)
        assert not any(k.fused is not None and any(nd.op == "exp" for nd in k.fused.nodes) for k in f.plan.kernels)


def _desc(h, m, n, d, **kw):
    from apollo_py.codegen.attention import AttentionDesc
    return AttentionDesc(name="t", batch=h, m=m, n=n, dk=d, dv=d, q_index=tuple(range(h)), k_index=tuple(range(h)),
                         v_index=tuple(range(h)), q_value="q", k_value="k", v_value="v", q_size=h * m * d,
                         k_size=h * n * d, v_size=h * n * d, head="s", x="s", s_shape=(1, h, m, n), s_row_dims=3,
                         out_shape=(1, h, m, d), out_row_dims=3, output="o", **kw)


def test_key_block_pads_least():
    """Keys per block: one block of every key where that pads fewer than blocks of ``bn``
    (ViT's 197 keys: 224, not 4 x 64 = 256), ``bn`` where it divides them (BERT's 128)."""
    from apollo_py.codegen.attention import attn_layout
    from apollo_py.codegen.gemm import host_blocking
    nr = host_blocking().nr
    vit, bert = attn_layout(_desc(12, 197, 197, 64), 2), attn_layout(_desc(12, 128, 128, 64), 2)
    assert vit.bn == -(-197 // nr) * nr and bert.bn == 64
    assert attn_layout(_desc(6, 1500, 1500, 64), 2).bn == 64     # many keys: blocks of bn


@pytest.mark.parametrize("blocking", ["host", "avx2"])
@pytest.mark.parametrize("kw", [{}, {"bn": 32, "qblocks": 1}, {"bn": 128, "qblocks": 3}])
def test_kernel_block_sizes_and_avx2_blocking(monkeypatch, blocking, kw):
    """The tuner's knobs (keys per block, query blocks per tile) and the AVX2 micro-tile (6 x 16,
    8 lanes) give the same numbers as numpy."""
    from apollo_py.codegen import gemm
    from apollo_py.codegen.attention import compile_attention, reference
    from apollo_py.runtime.threadpool import ThreadPool
    if blocking == "avx2":
        monkeypatch.setattr(gemm, "host_blocking", lambda: gemm.Blocking(8, 6, 16))
    h, m, n, d = 3, 37, 70, 24
    ca = compile_attention(_desc(h, m, n, d, **kw), 2)
    assert ca.layout.vl == (8 if blocking == "avx2" else ca.layout.vl)
    rng = np.random.default_rng(7)
    q, kt, v = (rng.standard_normal(s).astype(np.float32) for s in ((h, m, d), (h, d, n), (h, n, d)))
    out = np.empty((1, h, m, d), np.float32)
    with ThreadPool(2) as pool:
        ca.run(pool, q, kt, v, [], out)
    np.testing.assert_allclose(out[0], reference(q.astype(np.float64), kt, v), rtol=1e-4, atol=1e-5)


def test_kernel_on_the_pool_claims_every_tile():
    """A product big enough for the pool (the workers' lent calls and the caller's claim tiles
    from one counter, codegen/gemm_ir.counter_ir): every call, back to back, computes every
    tile exactly once."""
    from apollo_py.codegen.attention import compile_attention, reference
    from apollo_py.runtime.threadpool import ThreadPool
    h, m, n, d = 8, 100, 130, 64
    ca = compile_attention(_desc(h, m, n, d), 2)
    assert not ca.inline and ca.layout.tiles >= 4
    rng = np.random.default_rng(8)
    q, kt, v = (rng.standard_normal(s).astype(np.float32) for s in ((h, m, d), (h, d, n), (h, n, d)))
    want = reference(q.astype(np.float64), kt, v)
    with ThreadPool(2) as pool:
        for _ in range(20):
            out = np.full((1, h, m, d), np.nan, np.float32)
            ca.run(pool, q, kt, v, [], out)
            np.testing.assert_allclose(out[0], want, rtol=1e-4, atol=1e-5)
