"""Lower-rank values recomputed at their consumers' shape (layers/expand.py): micro-graphs with
per-row scalars or masks on a smaller domain fuse into one kernel, scheduled in well under a
second, where isl's own scheduler ran for minutes (Swin-T's LayerNorm + global pool)."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.layers.expand import expand_lower_rank

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def _kernels(f):
    return [k for k in f.plan.kernels if k.fused is not None]


def test_row_scaled_pool_is_one_kernel():
    # ReduceMean over C, scale, ReduceSum over H and W: the Swin export's pattern
    b = ap.GraphBuilder("rowpool")
    x = b.input("x", (1, 8, 8, 32))
    r = b.reduce_sum(x, axes=(3,), keepdims=True) / b.constant(np.array(32, np.float32))
    g = b.build([b.reduce_sum(x * r, axes=(1, 2), keepdims=False)])
    f = ap.jit(g, options=ap.Options(machine="dev-2core", schedule_timeout=30.0))
    xv = np.random.default_rng(0).standard_normal((1, 8, 8, 32)).astype(np.float32)
    np.testing.assert_allclose(f(xv), (xv * xv.mean(axis=3, keepdims=True)).sum(axis=(1, 2)),
                               rtol=1e-5, atol=1e-5)
    ks = _kernels(f)
    assert [k.fused.strategy for k in ks] == ["direct", "direct+recompute"]
    assert [n.op for n in ks[1].fused.nodes] == ["div", "mul", "reduce_sum"]
    assert ks[1].fused.schedule_ms < 1000


def test_masked_attention_softmax_with_lower_rank_mask_schedules_fast():
    # GPT-2 style: a [1,1,S,S] boolean mask combined into [1,H,S,S] scores, then softmax
    H, S = 12, 128
    b = ap.GraphBuilder("masked_softmax")
    x = b.input("x", (1, H, S, S))
    m1, m2 = b.input("m1", (1, 1, S, S), "bool"), b.input("m2", (1, 1, S, S), "bool")
    m = b.op("and", m1, m2)[0]
    mask = b.where(m, b.constant(np.array(0.0, np.float32)), b.constant(np.array(-1e9, np.float32)))
    w = x * b.constant(np.array(0.125, np.float32)) + mask
    e = b.exp(w - b.reduce_max(w, axes=(3,), keepdims=True))
    g = b.build([e / b.reduce_sum(e, axes=(3,), keepdims=True)])
    f = ap.jit(g, options=ap.Options(machine="dev-2core", schedule_timeout=30.0))
    rng = np.random.default_rng(1)
    xv = rng.standard_normal((1, H, S, S)).astype(np.float32)
    m1v = np.broadcast_to(np.tril(np.ones((S, S), bool)), (1, 1, S, S)).copy()
    m2v = rng.random((1, 1, S, S)) > 0.1
    wv = xv * np.float32(0.125) + np.where(m1v & m2v, np.float32(0), np.float32(-1e9))
    ev = np.exp(wv - wv.max(axis=3, keepdims=True))
    np.testing.assert_allclose(f(xv, m1v, m2v), ev / ev.sum(axis=3, keepdims=True), rtol=1e-5, atol=1e-6)
    (k,) = _kernels(f)
    assert k.fused.schedule_ms < 1000


def test_expansion_before_and_expected():
    b = ap.GraphBuilder("t")
    x = b.input("x", (2, 3, 4))
    s = b.input("s", (2, 3, 1))
    r = b.sqrt(s + 1.0)            # internal [2,3,1], read by one [2,3,4] op
    g = b.build([x * r])
    nodes = [n for n in g.nodes if n.op != "constant"]
    got = expand_lower_rank(nodes, g.types, g.outputs)
    assert got is not None
    xn, xt = got
    assert [n.op for n in xn] == ["broadcast_to", "add", "sqrt", "mul"]
    assert xn[0].inputs == ("s",) and tuple(xn[0].attrs["shape"]) == (2, 3, 4)
    assert all(xt[n.outputs[0]].shape == (2, 3, 4) for n in xn)
    # a micro-graph output keeps its shape; nothing to expand then
    assert expand_lower_rank(nodes[:-1], g.types, [nodes[-2].outputs[0]]) is None
