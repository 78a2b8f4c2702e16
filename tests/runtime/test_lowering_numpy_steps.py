"""target="cpu": zero-size micro-graphs run as numpy steps whose reason is in the plan, with
numpy's numbers (reductions over empty sets give the identity); int8/16 and unsigned integers
compile to kernels that wrap and compare like numpy; layer 1 is memoised by structure without
mixing up value names."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.layers import fuse_memo
from apollo_py.runtime.reference import evaluate


def _reasons(f):
    return [k.to_dict().get("reason", "") for k in f.plan.kernels]


@pytest.mark.parametrize("op,want", [("reduce_sum", 0.0), ("reduce_max", -np.inf), ("reduce_min", np.inf),
                                     ("reduce_prod", 1.0)])
def test_reduction_over_empty_set_is_identity(op, want):
    b = ap.GraphBuilder("empty_reduce")
    x = b.input("x", (3, 0, 4))
    g = b.build([getattr(b, op)(b.exp(x), axes=(1,))])
    f = ap.jit(g, target="cpu")
    out = f(np.zeros((3, 0, 4), np.float32))
    np.testing.assert_array_equal(out, np.full((3, 4), want, np.float32))
    assert any("zero-size" in r for r in _reasons(f)), _reasons(f)


def test_zero_size_elementwise_output():
    b = ap.GraphBuilder("empty_add")
    x, y = b.input("x", (0, 5)), b.input("y", (1, 5))
    g = b.build([b.relu(x + y)])
    out = ap.jit(g, target="cpu")(np.zeros((0, 5), np.float32), np.ones((1, 5), np.float32))
    assert out.shape == (0, 5) and out.dtype == np.float32


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32", "uint64"])
def test_small_and_unsigned_int_kernels_agree_with_numpy(dtype):
    """Wrapping adds, unsigned compares/max and the max-reduction identity, in one LLVM kernel."""
    b = ap.GraphBuilder("small_ints")
    x, y = b.input("x", (4, 6), dtype), b.input("y", (6,), dtype)
    g = b.build([b.reduce_max(b.max(x + y, y), axes=(1,))])
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    feeds = {"x": rng.integers(info.min, info.max, (4, 6), dtype=dtype, endpoint=True),
             "y": rng.integers(info.min, info.max, (6,), dtype=dtype, endpoint=True)}
    f = ap.jit(g, target="cpu")
    out = f(**feeds)
    want = evaluate(g, feeds)[0]
    assert out.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(want, np.maximum(feeds["x"] + feeds["y"], feeds["y"]).max(axis=1))
    assert [k.to_dict()["kind"] for k in f.plan.kernels] == ["kernel"], _reasons(f)


def test_memo_shares_structure_not_names(monkeypatch):
    """Two graphs of the same structure: the second hits the memo, keeps its own names and numbers."""
    def build(prefix, scale):
        b = ap.GraphBuilder(prefix)
        x = b.input(prefix + "_x", (8, 16))
        y = b.exp(x * scale) + x
        return b.build([b.reduce_sum(y, axes=(1,))])
    from cachetools import LRUCache
    monkeypatch.setattr(fuse_memo, "_MEMO", LRUCache(fuse_memo.MAX_ENTRIES))   # empty: misses count
    real, misses = fuse_memo._stored_or_fused, []
    monkeypatch.setattr(fuse_memo, "_stored_or_fused", lambda *a: misses.append(a[0]) or real(*a))
    fused_after = []
    g1, g2, g3 = build("first", 0.5), build("second", 0.5), build("third", 0.25)
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    outs = []
    for g in (g1, g2, g3):
        f = ap.jit(g, target="cpu")
        outs.append(f(x))
        fused_after.append(len(misses))
        np.testing.assert_allclose(outs[-1], evaluate(g, {g.inputs[0]: x})[0], rtol=1e-5, atol=1e-5)
        loop = f.plan.kernels[0].fused.loop
        assert all(p.name.startswith(g.name) or p.name in g.outputs for p in loop.params), loop.params
    assert not np.allclose(outs[0], outs[2])   # a different constant is a different structure
    # the first graph fuses, the second (same structure, other names) hits the memo, the third
    # (another constant) fuses again
    assert fused_after[0] >= 1 and fused_after[1] == fused_after[0] and fused_after[2] > fused_after[1], fused_after
