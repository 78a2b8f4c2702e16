"""Loop IR: construction, typing errors, structural keys, verification."""
import pytest

from apollo_py.codegen import loopir as L
from apollo_py.codegen.loopir import Const, Kernel, Param, Store, Un, Var, for_
from apollo_py.errors import CompileError

from codegen_kernels import softmax_rows


def test_operator_overloading_builds_int64_index():
    i, j = Var("i"), Var("j")
    e = i * 4 + j
    assert e == L.Bin("add", L.Bin("mul", i, Const(4)), j)
    assert e.dtype == "int64"
    assert L.format_expr(e) == "add(mul(i, 4:int64), j)"


def test_float_constants_follow_operand_dtype():
    x = Var("x", "float64")
    e = x * 2 + 1.5
    assert e.b == Const(1.5, "float64") and e.dtype == "float64"
    assert L.lt(x, 0.0).dtype == "bool"


def test_float16_loads_compute_in_float32():
    h = Param("h", "float16", 4)
    assert h[Const(0)].dtype == "float32"


@pytest.mark.parametrize("build", [
    lambda: L.Bin("add", Var("x", "float32"), Var("i")),        # mixed dtypes
    lambda: L.Bin("div", Var("i"), Var("j")),                   # int div
    lambda: Un("exp", Var("i")),                                # math on int
    lambda: L.Select(Var("i"), Var("i"), Var("j")),             # non-bool condition
    lambda: Un("nope", Var("x", "float32")),                    # unknown op
    lambda: Store(Param("p", "float32", 1), Const(0), Var("i")),  # store int to float
    lambda: Param("p", "float32", 4)[Var("x", "float32")],      # float index
    lambda: L.Alloc("t", "float32", 0),
    lambda: for_("i", 0, 4, [], kind="warp"),
])
def test_type_errors_raise_compile_error(build):
    with pytest.raises(CompileError):
        build()


def test_structural_key_is_stable_and_discriminating():
    a, b = softmax_rows(8, 128), softmax_rows(8, 128)
    assert a == b and hash(a) == hash(b)
    assert a.structural_key() == b.structural_key()
    assert len(a.structural_key()) == 64
    assert softmax_rows(8, 64).structural_key() != a.structural_key()
    assert a.replace(name="other").structural_key() != a.structural_key()


def test_verify_rejects_out_of_scope_names():
    x = Param("x", "float32", 4)
    i = Var("i")
    bad_var = Kernel("k", (x,), for_("i", 0, 4, Store(x, Var("q"), Const(0.0, "float32"))))
    with pytest.raises(CompileError, match="'q'"):
        L.verify_kernel(bad_var)
    bad_buf = Kernel("k", (x,), for_("i", 0, 4, Store(Param("y", "float32", 4), i,
                                                      Const(0.0, "float32"))))
    with pytest.raises(CompileError, match="'y'"):
        L.verify_kernel(bad_buf)
    no_par = Kernel("k", (x,), for_("i", 0, 4, Store(x, i, Const(0.0, "float32"))), "i", 4)
    with pytest.raises(CompileError, match="parallel loop"):
        L.verify_kernel(no_par)
    with pytest.raises(CompileError):
        Kernel("k", (x,), for_("i", 0, 4, []), "i", None)


def test_format_node_prints_loops():
    text = L.format_node(softmax_rows(2, 16))
    assert text.startswith("kernel softmax(x: float32[32], o: float32[32]) parallel r extent 2")
    assert "for r in [0:int64, 2:int64) parallel:" in text


def test_names_must_be_identifiers():
    for build in (lambda: Var("a.b"), lambda: Param("x y", "float32", 2),
                  lambda: L.Local("1s", "int64", 0), lambda: L.Alloc("t-1", "float32", 4)):
        with pytest.raises(CompileError, match="identifier"):
            build()


def test_int32_loop_bounds_follow_the_variable():
    loop = L.For(Var("i", "int32"), 0, 8, L.Block(()))
    assert loop.lo == Const(0, "int32") and loop.hi.dtype == "int32"
    with pytest.raises(CompileError, match="Cast"):
        L.For(Var("i", "int32"), 0, Var("n"), L.Block(()))
