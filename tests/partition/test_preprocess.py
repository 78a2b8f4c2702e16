"""Before/Expected tests of the preprocessing passes (structural comparison, names kept)."""
import numpy as np
import pytest

from apollo_py import GraphBuilder, Options
from apollo_py.ir import verify
from apollo_py.partition.preprocess import (FOLD_MAX_ELEMENTS, eliminate_common_subexpressions,
                                            eliminate_dead_code, fold_constants, preprocess,
                                            simplify_algebra)
from apollo_py.runtime.reference import evaluate

F32 = np.float32


def _check(before, after, expected):
    verify(after)
    assert after == expected, f"got\n{after}\nexpected\n{expected}"
    assert after.inputs == before.inputs
    assert after.outputs == before.outputs
    rng = np.random.default_rng(0)
    feeds = {v: rng.standard_normal(before.types[v].shape).astype(before.types[v].np_dtype)
             for v in before.inputs}
    for a, b in zip(evaluate(before, feeds), evaluate(after, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def test_fold_constants_chain():
    b = GraphBuilder()
    x = b.input("x", (3,))
    c = b.exp(b.constant(np.array([0.0, 1.0, 2.0], F32))) * 2.0
    before = b.build([b.add(x, c, name="y")])
    e = GraphBuilder()
    x = e.input("x", (3,))
    expected = e.build([e.add(x, e.constant((np.exp(np.array([0, 1, 2], F32)) * F32(2)).astype(F32)))])
    _check(before, eliminate_dead_code(fold_constants(before)), expected)


def test_fold_keeps_large_broadcast_and_iota():
    b = GraphBuilder()
    x = b.input("x", (512, 256))
    big = b.broadcast_to(b.constant(np.float32(1.5)), shape=(512, 256))
    idx = b.cast(b.iota(shape=(512, 256), axis=1), to="float32")
    small = b.broadcast_to(b.constant(np.float32(2.0)), shape=(4,))
    before = b.build([x * big + idx, small])
    after = fold_constants(before)
    ops = [n.op for n in after.nodes]
    assert 512 * 256 > FOLD_MAX_ELEMENTS
    assert "broadcast_to" in ops and "iota" in ops and "cast" in ops
    assert after.producers[after.outputs[1]].op == "constant"
    _check(before, after, after)


def test_fold_output_keeps_name():
    b = GraphBuilder()
    x = b.input("x", (2,))
    y = b.neg(b.constant(np.ones(2, F32)), name="y")
    before = b.build([x, y])
    after = fold_constants(before)
    assert after.outputs == ("x", "y") and after.producers["y"].op == "constant"


def test_cse():
    b = GraphBuilder()
    x = b.input("x", (4,))
    a1, a2 = b.exp(x), b.exp(x)
    before = b.build([b.add(a1 * 2.0, a2 * 2.0, name="y")])
    e = GraphBuilder()
    x = e.input("x", (4,))
    m = e.exp(x) * 2.0
    expected = e.build([e.add(m, m)])
    _check(before, eliminate_common_subexpressions(before), expected)


def test_cse_duplicate_output_renamed():
    b = GraphBuilder()
    x = b.input("x", (4,))
    a1 = b.exp(x, name="a1")
    a2 = b.exp(x, name="out")
    before = b.build([b.add(a1, x, name="s"), a2])
    after = eliminate_common_subexpressions(before)
    assert [n.op for n in after.nodes] == ["exp", "add"]
    assert after.producers["out"].op == "exp" and after.outputs == ("s", "out")
    _check(before, after, after)


def test_cse_two_outputs_both_kept():
    b = GraphBuilder()
    x = b.input("x", (4,))
    before = b.build([b.exp(x, name="o1"), b.exp(x, name="o2")])
    after = eliminate_common_subexpressions(before)
    assert after.outputs == ("o1", "o2") and set(after.producers) == {"o1", "o2"}


def test_dce():
    b = GraphBuilder()
    x = b.input("x", (4,))
    b.exp(x)
    b.neg(b.log(x))
    before = b.build([b.relu(x)])
    e = GraphBuilder()
    x = e.input("x", (4,))
    _check(before, eliminate_dead_code(before), e.build([e.relu(x)]))


def test_dce_keeps_unused_inputs():
    b = GraphBuilder()
    x = b.input("x", (4,))
    b.input("unused", (2,))
    g = eliminate_dead_code(b.build([b.relu(x)]))
    assert g.inputs == ("x", "unused")


@pytest.mark.parametrize("op,const,left", [("mul", 1, True), ("mul", 1, False), ("add", 0, True),
                                           ("add", 0, False), ("sub", 0, True), ("div", 1, True)])
def test_identities(op, const, left):
    b = GraphBuilder()
    x = b.input("x", (3, 4))
    c = b.constant(np.full((4,), const, F32))
    t = getattr(b, op)(x, c) if left else getattr(b, op)(c, x)
    before = b.build([b.exp(t)])
    e = GraphBuilder()
    x = e.input("x", (3, 4))
    _check(before, eliminate_dead_code(simplify_algebra(before)), e.build([e.exp(x)]))


def test_identities_keep_broadcasting():
    b = GraphBuilder()
    x = b.input("x", (4,))
    ones = b.constant(np.ones((3, 4), F32))
    before = b.build([b.exp(x * ones), b.exp(b.sub(b.constant(np.zeros(4, F32)), x))])
    assert simplify_algebra(before) == before      # shape changes / 0 - x is not x


def test_cast_same_dtype():
    b = GraphBuilder()
    x = b.input("x", (3,))
    before = b.build([b.exp(b.cast(x, to="float32")), b.cast(x, to="float64")])
    e = GraphBuilder()
    x = e.input("x", (3,))
    _check(before, simplify_algebra(before), e.build([e.exp(x), e.cast(x, to="float64")]))


def test_double_transpose_composes():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4))
    t = b.transpose(b.transpose(x, perm=(1, 2, 0)), perm=(0, 2, 1))
    before = b.build([b.exp(t)])
    e = GraphBuilder()
    x = e.input("x", (2, 3, 4))
    expected = e.build([e.exp(e.transpose(x, perm=(1, 0, 2)))])
    _check(before, eliminate_dead_code(simplify_algebra(before)), expected)


def test_double_transpose_identity_removed():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    before = b.build([b.exp(b.transpose(b.transpose(x, perm=(1, 0)), perm=(1, 0)))])
    e = GraphBuilder()
    x = e.input("x", (2, 3))
    _check(before, eliminate_dead_code(simplify_algebra(before)), e.build([e.exp(x)]))


def test_reshape_of_reshape():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4))
    before = b.build([b.exp(b.reshape(b.reshape(x, shape=(6, 4)), shape=(24,))),
                      b.relu(b.reshape(b.reshape(x, shape=(4, 6)), shape=(2, 3, 4)))])
    e = GraphBuilder()
    x = e.input("x", (2, 3, 4))
    expected = e.build([e.exp(e.reshape(x, shape=(24,))), e.relu(x)])
    _check(before, eliminate_dead_code(simplify_algebra(before)), expected)


def test_output_alias_of_input_gets_copy():
    b = GraphBuilder()
    x = b.input("x", (3,))
    before = b.build([b.mul(x, 1.0, name="y")])
    after = simplify_algebra(before)
    e = GraphBuilder()
    x = e.input("x", (3,))
    e.constant(np.float32(1.0))
    expected = e.build([e.broadcast_to(x, shape=(3,))])
    assert after.outputs == ("y",) and after.producers["y"].op == "broadcast_to"
    _check(before, eliminate_dead_code(after), eliminate_dead_code(expected))


def test_output_alias_renames_producer():
    b = GraphBuilder()
    x = b.input("x", (3,))
    before = b.build([b.add(b.exp(x, name="e"), 0.0, name="y")])
    after = eliminate_dead_code(simplify_algebra(before))
    assert [n.op for n in after.nodes] == ["exp"] and after.producers["y"].op == "exp"


def test_output_alias_of_other_output():
    b = GraphBuilder()
    x = b.input("x", (3,))
    e1 = b.exp(x, name="e")
    before = b.build([e1, b.mul(e1, 1.0, name="y")])
    after = eliminate_dead_code(simplify_algebra(before))
    assert after.outputs == ("e", "y")
    assert after.producers["y"].op == "broadcast_to" and after.producers["y"].inputs == ("e",)
    _check(before, after, after)


def test_preprocess_pipeline_and_switch():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    w = b.transpose(b.transpose(b.constant(np.arange(6, dtype=F32).reshape(2, 3)), perm=(1, 0)), perm=(1, 0))
    y = b.exp(x) + b.exp(x) * 1.0 + w
    before = b.build([b.cast(y, to="float32", name="out")])
    after = preprocess(before, Options())
    assert sorted(n.op for n in after.nodes) == ["add", "add", "constant", "exp"]
    assert after.outputs == ("out",)
    _check(before, after, after)
    assert preprocess(before, Options(preprocess=False)) is before


def test_fold_small_iota():
    b = GraphBuilder()
    x = b.input("x", (2, 3))
    before = b.build([x + b.cast(b.iota(shape=(2, 3), axis=1), to="float32")])
    e = GraphBuilder()
    x = e.input("x", (2, 3))
    expected = e.build([x + e.constant(np.array([[0, 1, 2], [0, 1, 2]], F32))])
    _check(before, preprocess(before, Options()), expected)


def test_zero_pad_and_whole_slice_removed():
    b = GraphBuilder()
    x = b.input("x", (2, 3, 4))
    p = b.pad(x, pads=(0,) * 6, mode="constant", value=0.0)
    s = b.slice(b.exp(p), starts=(0, -3, 0), ends=(2, 3, 4), steps=(1, 1, 1))
    kept = b.slice(x, starts=(0, 1, 0), ends=(2, 3, 4), steps=(1, 1, 1))      # not the whole: stays
    crop = b.pad(x, pads=(0, 1, 0, 0, -1, 0), mode="constant", value=0.0)      # same shape, moved: stays
    before = b.build([b.tanh(s), kept, crop])
    e = GraphBuilder()
    x = e.input("x", (2, 3, 4))
    expected = e.build([e.tanh(e.exp(x)), e.slice(x, starts=(0, 1, 0), ends=(2, 3, 4), steps=(1, 1, 1)),
                        e.pad(x, pads=(0, 1, 0, 0, -1, 0), mode="constant", value=0.0)])
    _check(before, eliminate_dead_code(simplify_algebra(before)), expected)
