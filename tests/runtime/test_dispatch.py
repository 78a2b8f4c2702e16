"""CPU runtime dispatch: independent kernels in one thread-pool job, reduction folds into
outputs, inlined scalar constants, and reuse of output arrays the caller has dropped."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.runtime.reference import evaluate
from apollo_py.runtime.threadpool import ThreadPool


def _branches(rows=64, cols=256):
    """Four independent reduce branches plus a dependent one."""
    b = ap.GraphBuilder("branches")
    xs = [b.input(f"x{i}", (rows, cols)) for i in range(4)]
    r0 = b.reduce_sum(b.exp(xs[0]), axes=(1,), keepdims=True)
    r1 = b.reduce_max(b.tanh(xs[1]), axes=(1,), keepdims=True)
    r2 = b.reduce_sum(xs[2] * xs[2], axes=(1,), keepdims=True)
    r3 = b.reduce_sum(b.abs(xs[3]), axes=(1,), keepdims=True)
    return b.build([r0, r1, r2, r3 * r0, r3])


def _feeds(rows=64, cols=256, seed=0):
    rng = np.random.default_rng(seed)
    return {f"x{i}": rng.standard_normal((rows, cols)).astype(np.float32) for i in range(4)}


# What layer 3 and the dispatcher decide for the 4 MiB reduce branches, by machine (the fourth
# branch's kernel also computes r3 * r0, so it runs after the first: three independent kernels,
# then one).  On "fast" (200 GB/s) each is predicted at ~21 us, under ParallelPolicy.max_cost, so
# the three share one launch, and 12 MiB together is above inline_bytes: one pool dispatch of
# three.  On "slow" (5 GB/s) each is predicted at ~0.8 ms and fills the machine alone: single
# entries, each under inline_bytes, run on the calling thread.
DECISIONS = {"fast": [3, 1], "slow": [1, 1, 1, 1]}


@pytest.mark.parametrize("machine", sorted(DECISIONS))
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_independent_kernels_share_one_dispatch(threads, machine):
    g = _branches(1024, 1024)
    f = ap.jit(g, options=ap.Options(target="cpu", num_threads=threads, machine=machine))
    feeds = _feeds(1024, 1024)
    got = f.run(**feeds)
    want = evaluate(g, feeds)
    assert len(got) == len(want)
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=2e-6, atol=1e-6)
    exe = f._last
    sizes = [len(item) for kind, item in exe._schedule if kind == "kernels"]
    assert sizes == DECISIONS[machine], exe._schedule


def test_fold_into_output_matches_sequential_lanes():
    # the sum folds straight into the output buffer; it gets 16 lane partial sums, in the
    # order of poly.ast_to_loopir.lane_reductions: lane l takes columns l, l+16, ..., tail to 0..
    g = _branches(rows=8, cols=1000)
    feeds = _feeds(rows=8, cols=1000, seed=1)
    got = ap.jit(g, target="cpu").run(**feeds)
    sq = np.abs(feeds["x3"])           # no multiply: FMA contraction cannot change the sums
    full = (1000 // 16) * 16
    lanes = np.zeros((8, 16), np.float32)
    for k in range(0, full, 16):
        lanes += sq[:, k:k + 16]
    for t in range(full, 1000):
        lanes[:, t - full] += sq[:, t]
    h = 8                              # then the lanes fold as a halving tree
    while h >= 1:
        lanes[:, :h] = lanes[:, :h] + lanes[:, h:2 * h]
        h //= 2
    np.testing.assert_array_equal(got[4][:, 0], lanes[:, 0])


def test_output_array_reused_only_when_dropped():
    g = _branches()
    f = ap.jit(g, target="cpu")
    feeds = _feeds()
    first = f.run(**feeds)
    held = first[0]
    addr_held = held.ctypes.data
    addr_dropped = first[2].ctypes.data
    del first
    second = f.run(**feeds)
    assert second[0].ctypes.data != addr_held        # still referenced: never overwritten
    assert second[2].ctypes.data == addr_dropped     # dropped: its memory is reused
    np.testing.assert_array_equal(held, second[0])
    view = second[1][:, :]
    third = f.run(**_feeds(seed=5))
    assert np.shares_memory(view, second[1]) and not np.shares_memory(view, third[1])
    np.testing.assert_allclose(third[1], evaluate(g, _feeds(seed=5))[1], rtol=2e-6, atol=1e-6)


def test_scalar_constant_exponent_is_inlined():
    b = ap.GraphBuilder("cube")
    x = b.input("x", (16, 64))
    three = b.constant(np.array(3.0, np.float32))
    g = b.build([b.pow(x, three) * b.constant(np.array(0.5, np.float32))])
    f = ap.jit(g, target="cpu")
    xv = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
    np.testing.assert_allclose(f(xv), evaluate(g, {"x": xv})[0], rtol=1e-6, atol=1e-7)
    (k,) = [s for s in f.plan.kernels if s.fused is not None]
    assert [p.name for p in k.fused.loop.params] == ["x", k.fused.loop.params[-1].name]
    assert "powf" not in k.source("c")


def test_run_many_matches_separate_runs():
    g = _branches(rows=37, cols=64)
    f = ap.jit(g, options=ap.Options(target="cpu", num_threads=1))
    f.run(**_feeds(37, 64))
    exe = f._last
    kernels = [item for kind, item in exe._schedule if kind == "kernels"][0]
    feeds = _feeds(37, 64, seed=3)
    with ThreadPool(3, chunks_per_thread=2) as pool:
        outs_a = {v: np.zeros(exe.graph.types[v].shape, np.float32) for s in kernels for v in s.outputs}
        outs_b = {v: np.zeros_like(a) for v, a in outs_a.items()}
        env_a, env_b = {**feeds, **outs_a}, {**feeds, **outs_b}
        pool.run_many([(s.compiled, [env_a[v] for v in s.param_values]) for s in kernels])
        for s in kernels:
            s.compiled([env_b[v] for v in s.param_values])
    for v in outs_a:
        np.testing.assert_array_equal(outs_a[v], outs_b[v])


def test_two_loop_fold_uses_one_lane_per_column():
    # sum over axes (1, 3) of [2, 8, 3, 32]: loops c0, c2 kept; j (axis 1) then l (axis 3)
    # folded; lane l sums x[:, j, :, l] over j in order, then lanes 0..31 left to right
    b = ap.GraphBuilder("listing3")
    x = b.input("x", (2, 8, 3, 32))
    g = b.build([b.reduce_sum(b.abs(x), axes=(1, 3), keepdims=False)])
    xv = np.random.default_rng(4).standard_normal((2, 8, 3, 32)).astype(np.float32)
    got = ap.jit(g, target="cpu")(xv)
    a = np.abs(xv)
    lanes = np.zeros((2, 3, 32), np.float32)
    for j in range(8):
        lanes += a[:, j, :, :]
    want = lanes[:, :, 0].copy()
    for l in range(1, 32):
        want = want + lanes[:, :, l]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("shape,perm", [((4, 32, 6, 32), (0, 2, 1, 3)), ((4, 32, 6, 32), (0, 2, 3, 1)),
                                        ((96, 64), (1, 0)), ((5, 7, 130), (2, 0, 1))])
def test_transpose_is_a_copy_kernel(shape, perm):
    xv = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    b = ap.GraphBuilder("t")
    x = b.input("x", shape)
    f = ap.jit(b.build([b.transpose(x, perm=perm)]), target="cpu")
    np.testing.assert_array_equal(f(xv), np.transpose(xv, perm))
    assert [(k.to_dict()["kind"], k.fused.strategy) for k in f.plan.kernels] == [("kernel", "copy")], f.plan
    # next to a kernel it is that kernel's index map (docs/design/stitching.md): one kernel
    b = ap.GraphBuilder("t")
    x = b.input("x", shape)
    g = b.build([b.transpose(x, perm=perm) + b.constant(np.array(1.0, np.float32))])
    f = ap.jit(g, target="cpu")
    np.testing.assert_array_equal(f(xv), np.transpose(xv, perm) + np.float32(1.0))
    assert [[n.op for n in k.fused.nodes if n.op != "constant"] for k in f.plan.kernels] == [["transpose", "add"]], f.plan
