"""The class of every primitive, computed from its isl access relations (DESIGN §4)."""
import numpy as np
import pytest

from apollo_py.ir import GraphBuilder
from apollo_py.ir.graph import ConstArray
from apollo_py.ops import all_ops, classify

F = "float32"


def _relu_node_hex():
    import onnx
    return onnx.helper.make_node("Relu", ["x"], ["y"], name="r").SerializeToString().hex()


def _node_class(build):
    b = GraphBuilder()
    out = build(b)
    g = b.build([out])
    n = g.producers[out.name]
    return classify(n.op, tuple(g.types[v] for v in n.inputs), tuple(g.types[v] for v in n.outputs), n.attrs)


def x(b, shape=(4, 8), dtype=F, name="x"):
    return b.input(name, shape, dtype)


CASES = {
    # elementwise: same-shape operands, or single-element operands (registers)
    **{op: ("elementwise", lambda b, op=op: b.op(op, x(b), x(b, name="y"))[0])
       for op in ["add", "sub", "mul", "div", "pow", "max", "min", "eq", "ne", "lt", "le", "gt", "ge"]},
    **{op: ("elementwise", lambda b, op=op: b.op(op, x(b, dtype="bool"), x(b, dtype="bool", name="y"))[0])
       for op in ["and", "or", "xor"]},
    **{op: ("elementwise", lambda b, op=op: b.op(op, x(b))[0])
       for op in ["neg", "abs", "exp", "log", "sqrt", "rsqrt", "reciprocal", "tanh", "erf", "sigmoid",
                  "relu", "floor", "ceil", "stop_gradient"]},
    "not": ("elementwise", lambda b: b.op("not", x(b, dtype="bool"))[0]),
    "where": ("elementwise", lambda b: b.where(x(b, dtype="bool"), x(b, name="a"), x(b, name="c"))),
    "cast": ("elementwise", lambda b: b.cast(x(b), to="int64")),
    "iota": ("elementwise", lambda b: b.iota(shape=(4, 8), axis=1)),
    # broadcast: some output elements share an input element
    "broadcast_to": ("broadcast", lambda b: b.broadcast_to(x(b, (8,)), shape=(4, 8))),
    # reductions: the write relation is not injective
    **{f"reduce_{r}": ("reduction", lambda b, r=r: b.op(f"reduce_{r}", x(b), axes=(1,), keepdims=True)[0])
       for r in ["sum", "prod", "max", "min"]},
    "window_reduce": ("reduction", lambda b: b.window_reduce(x(b, (1, 2, 8, 8)), reducer="max", kernel=(2, 2),
                                                             strides=(2, 2), pads=(0, 0, 0, 0), dilations=(1, 1))),
    # opaque by declaration
    "reshape": ("opaque", lambda b: b.reshape(x(b), shape=(32,))),
    "transpose": ("opaque", lambda b: b.transpose(x(b), perm=(1, 0))),
    "slice": ("opaque", lambda b: b.slice(x(b), starts=(0, 1), ends=(4, 8), steps=(1, 2))),
    "concat": ("opaque", lambda b: b.concat(x(b), x(b, name="y"), axis=0)),
    "pad": ("opaque", lambda b: b.pad(x(b), pads=(1, 1, 1, 1))),
    "gather": ("opaque", lambda b: b.gather(x(b), x(b, (3,), "int64", "i"), axis=0)),
    "matmul": ("opaque", lambda b: b.matmul(x(b), x(b, (8, 2), name="w"))),
    "onnx_op": ("opaque", lambda b: b.op("onnx_op", x(b), node=_relu_node_hex(), opset=17, op_type="Relu",
                                         out_types=(((4, 8), "float32"),))[0]),
    "recurrent": ("opaque", lambda b: b.op(
        "recurrent", x(b, (3, 2, 4)), x(b, (1, 4, 4), name="r"), x(b, (1, 2, 4), name="h0"),
        x(b, (2,), "int32", "lens"), x(b, (1, 1), name="aux"), cell="rnn", hidden=4, directions=("forward",),
        acts=((("Tanh", 0.0, 0.0),),))[0]),
    # a resize from tap tables reads input positions named by data (the tables): opaque, as gather
    "resize2d": ("opaque", lambda b: b.op(
        "resize2d", x(b, (1, 2, 4, 4)), x(b, (2, 8), "int64", "ty"), x(b, (2, 8), name="wy"),
        x(b, (2, 8), "int64", "tx"), x(b, (2, 8), name="wx"), taps=2)[0]),
    "conv": ("opaque", lambda b: b.conv(x(b, (1, 2, 8, 8)), x(b, (3, 2, 3, 3), name="w"), strides=(1, 1),
                                        pads=(1, 1, 1, 1), dilations=(1, 1))),
}


@pytest.mark.parametrize("op", sorted(CASES))
def test_class_of_primitive(op):
    want, build = CASES[op]
    assert _node_class(build) == want


def test_every_primitive_has_a_class_test():
    # every primitive defined in apollo_py.ops is pinned here (others, e.g. training's, pin theirs)
    ours = {name for name, d in all_ops().items() if d.reference.__module__.startswith("apollo_py.ops")}
    missing = ours - set(CASES) - {"constant"}
    assert not missing, f"no class test for {sorted(missing)}"


@pytest.mark.parametrize("shapes,want", [
    (((4, 8), (8,)), "broadcast"),       # row bias
    (((4, 8), (4, 1)), "broadcast"),     # column operand
    (((4, 8), (1, 1)), "elementwise"),   # single element: a register, not a layout
    (((4, 8), ()), "elementwise"),
    (((1, 8), (1, 8)), "elementwise"),
])
def test_binary_broadcast_classes(shapes, want):
    def build(b):
        return b.add(b.input("a", shapes[0]), b.input("c", shapes[1]))
    assert _node_class(build) == want


def test_reduction_over_unit_axis_is_elementwise():
    # summing a size-1 axis copies: the write relation stays injective
    assert _node_class(lambda b: b.reduce_sum(x(b, (4, 1)), axes=(1,))) == "elementwise"


def test_avg_pool_window_with_padding_is_reduction():
    def build(b):
        return b.window_reduce(x(b, (1, 1, 5, 5)), reducer="sum", kernel=(3, 3), strides=(2, 2),
                               pads=(1, 1, 1, 1), dilations=(1, 1))
    assert _node_class(build) == "reduction"


def test_fallback_op_runs_through_onnx_reference():
    from apollo_py.runtime.reference import evaluate
    b = GraphBuilder()
    v = b.input("x", (4, 8))
    y = b.op("onnx_op", v, node=_relu_node_hex(), opset=17, op_type="Relu", out_types=(((4, 8), "float32"),))[0]
    g = b.build([y])
    a = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    np.testing.assert_array_equal(evaluate(g, {"x": a})[0], np.maximum(a, 0))
