"""Reshapes run as views of their input (runtime/cpu.py ``_reshape_aliases``): the memory plan
keeps the viewed buffer alive for the view's readers, outputs that are views are copied, and
in-place updates see reads through a view."""
import numpy as np

import apollo_py as ap

RTOL, ATOL = 1e-5, 1e-5


def _graph():
    """t = tanh(x); r = reshape(t); many intermediates in between; r read at the very end."""
    b = ap.GraphBuilder("alias")
    x = b.input("x", (64, 96))
    t = b.tanh(x)
    r = b.reshape(t, shape=(64, 8, 12))
    acc = x
    for k in range(4):      # arena slots that would reuse t's buffer if r did not keep it alive
        acc = b.reduce_sum(b.tanh(acc), axes=(1,), keepdims=True) * 0.01 + acc * 0.5
    out = b.reduce_sum(r, axes=(2,))                      # reads the view last
    return b.build([out, acc, r])


def _numpy(x):
    t = np.tanh(x.astype(np.float64))
    acc = x.astype(np.float64)
    for _ in range(4):
        acc = np.tanh(acc).sum(1, keepdims=True) * 0.01 + acc * 0.5
    return t.reshape(64, 8, 12).sum(2), acc, t.reshape(64, 8, 12)


def test_reshape_is_a_view_kept_alive_by_the_plan():
    f = ap.jit(_graph(), target="cpu")
    x = np.random.default_rng(0).standard_normal((64, 96)).astype(np.float32)
    got = f.run(x)
    for g, w in zip(got, _numpy(x)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL)
    exe = f.specialization({"x": (64, 96)})
    assert exe._root, "the reshape was not planned as a view"
    (view, root), = exe._root.items()
    if root in exe.memory.slots:                          # the viewed buffer lives past the view's readers
        readers = [k for k, s in enumerate(exe.steps) if view in s.inputs]
        assert exe.memory.slots[root].last >= max(readers)


def test_view_outputs_are_copies():
    f = ap.jit(_graph(), target="cpu")
    rng = np.random.default_rng(1)
    x1, x2 = (rng.standard_normal((64, 96)).astype(np.float32) for _ in range(2))
    r1 = f.run(x1)[2]
    keep = r1.copy()
    f.run(x2)                                             # reuses the arena
    np.testing.assert_array_equal(r1, keep)


def test_inplace_sees_reads_through_a_view():
    b = ap.GraphBuilder("upd_view")
    w, g = b.input("w", (8, 16)), b.input("g", (8, 16))
    w_new = b.sub(w, b.mul(g, b.constant(np.array(0.5, np.float32))))
    late = b.reduce_sum(b.reshape(w, shape=(128,)) * b.reshape(w_new, shape=(128,)), axes=(0,))
    f = ap.jit(b.build([w_new, late]), target="cpu")
    exe = f.specialization({"w": (8, 16), "g": (8, 16)})
    assert exe.inplace_reason(f.output_names[0], "w") != ""      # the view of w is read after
    rng = np.random.default_rng(2)
    wv, gv = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((8, 16)).astype(np.float32)
    w0 = wv.copy()
    outs = f.run_updating({f.output_names[0]: "w"}, w=wv, g=gv)
    want_new = w0 - 0.5 * gv
    np.testing.assert_allclose(wv, want_new, rtol=1e-6)
    np.testing.assert_allclose(outs[1], float((w0.astype(np.float64) * want_new).sum()), rtol=1e-5)
