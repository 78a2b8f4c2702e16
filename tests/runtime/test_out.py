"""out=: caller-provided output arrays are written in place, on every target; bad ones refused."""
import weakref

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import InputError


def _two_outputs():
    b = ap.GraphBuilder("two")
    x = b.input("x", (64, 96))
    w = b.input("w", (96, 32))
    e = b.exp(x - b.reduce_max(x, axes=(1,), keepdims=True))
    sm = e / b.reduce_sum(e, axes=(1,), keepdims=True)
    return b.build([sm, b.matmul(x, w), b.transpose(x, perm=(1, 0))])


def _feeds():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((64, 96)).astype(np.float32),
            "w": rng.standard_normal((96, 32)).astype(np.float32)}


@pytest.mark.parametrize("target", ["reference", "cpu"])
@pytest.mark.parametrize("form", ["list", "dict", "partial"])
def test_out_is_written_and_returned(target, form):
    f = ap.jit(_two_outputs(), target=target)
    feeds = _feeds()
    want = f.run(**feeds)
    bufs = [np.full(w.shape, np.nan, w.dtype) for w in want]
    if form == "list":
        arg = bufs
    elif form == "dict":
        arg = dict(zip(f.output_names, bufs))
    else:
        arg = [bufs[0], None, bufs[2]]
    for _ in range(2):          # the second call reuses the buffers
        got = f.run(**feeds, out=arg)
        for k, (g, w) in enumerate(zip(got, want)):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6)
            if form != "partial" or k != 1:
                assert g is bufs[k]
                np.testing.assert_allclose(bufs[k], w, rtol=1e-6, atol=1e-6)


def test_single_output_takes_one_array():
    b = ap.GraphBuilder("one")
    x = b.input("x", (8, 16))
    g = b.build([b.tanh(x) * 2.0])
    f = ap.jit(g, target="cpu")
    x0 = np.linspace(-2, 2, 128, dtype=np.float32).reshape(8, 16)
    buf = np.empty((8, 16), np.float32)
    assert f(x0, out=buf) is buf
    np.testing.assert_allclose(buf, np.tanh(x0) * 2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad, msg", [
    (lambda: [np.empty((64, 96), np.float64), None, None], "dtype"),
    (lambda: [np.empty((64, 95), np.float32), None, None], "shape"),
    (lambda: [np.empty((96, 64), np.float32).T, None, None], "C-contiguous"),
    (lambda: [None, None], "entries"),
    (lambda: {"nope": np.empty(3)}, "not an output"),
    (lambda: np.empty((64, 96), np.float32), "one array"),
])
def test_bad_out_is_refused(bad, msg):
    f = ap.jit(_two_outputs(), target="cpu")
    with pytest.raises(InputError, match=msg):
        f.run(**_feeds(), out=bad())


def test_out_sharing_memory_is_refused():
    f = ap.jit(_two_outputs(), target="cpu")
    feeds = _feeds()
    block = np.empty(64 * 96 * 2, np.float32)
    with pytest.raises(InputError, match="share memory"):
        f.run(**feeds, out=[block[:64 * 96].reshape(64, 96), None, block[:96 * 64].reshape(96, 64)])
    with pytest.raises(InputError, match="input 'x'"):
        f.run(**feeds, out=[feeds["x"], None, None])


def test_out_call_keeps_the_recycled_output_of_fresh_calls():
    """A call with out= must not make the next fresh call allocate (and page-fault) anew."""
    b = ap.GraphBuilder("one")
    x = b.input("x", (64, 256))
    f = ap.jit(b.build([b.exp(x)]), target="cpu")
    x0 = np.zeros((64, 256), np.float32)
    first = f(x0)
    ref = weakref.ref(first)
    del first                       # dropped: the arena may hand it out again
    buf = np.empty((64, 256), np.float32)
    f(x0, out=buf)
    again = f(x0)
    assert ref() is not None and again is ref()
    np.testing.assert_array_equal(again, np.ones((64, 256), np.float32))
