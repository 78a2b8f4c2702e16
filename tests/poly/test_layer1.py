"""Layer 1 end to end: micro-graph -> fused loop-IR kernels -> LLVM, against numpy."""
import time

import numpy as np
import pytest

import graphs
from apollo_py.codegen import loopir as L
from apollo_py.feedback.log import default_log_path, read_events
from apollo_py.ir.builder import GraphBuilder
from apollo_py.layers.layer1 import FusedKernel, fuse_micro_graph
from apollo_py.options import Options
from apollo_py.runtime.reference import evaluate

llvm = pytest.importorskip("apollo_py.codegen.llvm")


def _fuse(g, **kw):
    opts = kw.pop("options", None) or Options(**kw)
    return fuse_micro_graph(list(g.nodes), g.types, list(g.inputs), list(g.outputs), opts)


def _run(g, kernels, seed=0, chunks=None, feeds=None):
    rng = np.random.default_rng(seed)
    env = {v: rng.standard_normal(g.types[v].shape).astype(g.types[v].np_dtype) for v in g.inputs}
    env.update({v: np.asarray(a, g.types[v].np_dtype) for v, a in (feeds or {}).items()})
    ref = evaluate(g, dict(env))
    for n in g.nodes:
        if n.op == "constant":
            env[n.outputs[0]] = np.ascontiguousarray(n.attrs["value"].array)
    for k in kernels:
        ck = llvm.compile_llvm(k.loop)
        for v in k.outputs:
            env.setdefault(v, np.zeros(g.types[v].shape, g.types[v].np_dtype))
        args = [env[v] for v in k.param_values]
        if chunks and k.loop.parallel_extent:
            ext = k.loop.parallel_extent
            bounds = np.linspace(0, ext, chunks + 1).astype(int)
            for lo, hi in zip(bounds[:-1], bounds[1:]):
                ck(args, int(lo), int(hi))
        else:
            ck(args)
    for v, r in zip(g.outputs, ref, strict=True):
        got = env[v]
        assert got.shape == r.shape and got.dtype == r.dtype
        err = np.abs(got - r)
        assert np.allclose(got, r, rtol=1e-5, atol=1e-6), \
            f"{v}: l_inf {err.max():.3g}, rel l2 {np.linalg.norm(err) / max(np.linalg.norm(r), 1e-30):.3g}"


def _fors(s):
    """Loop structure; a lane-rewritten reduction loop counts once (its block loop b_*)."""
    if isinstance(s, L.Block):
        return [x for y in s.stmts for x in _fors(y)]
    if isinstance(s, L.For):
        if s.var.name.startswith(("l_", "t_")):
            return []
        if s.var.name.startswith("b_"):
            return [("lanes", [])]
        return [(s.kind, _fors(s.body))]
    if isinstance(s, L.If):
        return _fors(s.then)
    return []


def _allocs(k):
    return [s for s in k.loop.body.stmts if isinstance(s, L.Alloc)]


def test_softmax_one_kernel_row_parallel(tmp_path):
    g = graphs.softmax(64, 128)
    (k,) = _fuse(g, cache_dir=str(tmp_path))
    assert isinstance(k, FusedKernel) and k.strategy == "direct"
    loops = _fors(k.loop.body)
    assert len(loops) == 1 and loops[0][0] == "parallel" and len(loops[0][1]) == 3
    assert k.loop.parallel_var is not None and k.loop.parallel_extent == 64
    assert [p.name for p in k.loop.params] == ["x", k.outputs[0]]
    assert all(a.size <= 128 for a in _allocs(k))          # a row tile, never the tensor
    assert k.reduce_form.kind == "x" and k.parallel_dims == 1
    _run(g, [k])
    _run(g, [k], chunks=3)                                   # chunks of the parallel loop


def test_layernorm_one_kernel(tmp_path):
    g = graphs.layernorm(16, 64)
    (k,) = _fuse(g, cache_dir=str(tmp_path))
    loops = _fors(k.loop.body)
    assert len(loops) == 1 and len(loops[0][1]) == 3
    assert all(a.size <= 64 for a in _allocs(k))
    _run(g, [k], feeds={"inv_n": 1 / 64, "eps": 1e-5})


def test_listing1_bias_maxpool_one_kernel_no_full_intermediate(tmp_path):
    g = graphs.bias_maxpool(1, 8, 16, 16)
    (k,) = _fuse(g, cache_dir=str(tmp_path))
    assert len(_fors(k.loop.body)) == 1
    assert [p.name for p in k.loop.params] == ["x", "bias", k.outputs[0]]
    # layers/pool_kernel.py: one padded 16x16 plane per parallel iteration, not the 8 planes
    assert k.strategy == "pool" and [a.size for a in _allocs(k)] == [16 * 16]
    _run(g, [k])


def test_listing3_bias_reduce_axes_1_3_one_kernel(tmp_path):
    g = graphs.bias_reduce13(3, 4, 5, 6)
    (k,) = _fuse(g, cache_dir=str(tmp_path))
    assert len(_fors(k.loop.body)) == 1 and not _allocs(k)
    f = k.reduce_form
    assert (f.kind, f.P, f.R, f.transposed) == ("x", 15, 24, True)
    _run(g, [k])


def test_tiny_budget_logs_event_and_splits_correctly(tmp_path):
    opts = Options(cache_dir=str(tmp_path), schedule_budget=50, model_name="m")
    g = graphs.softmax(8, 32)
    t0 = time.perf_counter()
    ks = _fuse(g, options=opts)
    assert time.perf_counter() - t0 < 10
    assert len(ks) > 1
    events = read_events(default_log_path(opts), "schedule_budget_exceeded")
    assert events and events[0]["model"] == "m" and events[0]["detail"]["budget"] == 50
    assert "reduce_max" in events[0]["signature"]
    _run(g, ks)


@pytest.mark.parametrize("tiles", [(4,), (3,), (16,)])
def test_tiled_softmax(tmp_path, tiles):
    g = graphs.softmax(10, 16)
    (k,) = _fuse(g, cache_dir=str(tmp_path), tile_sizes=tiles)
    assert k.tile_sizes == tiles
    _run(g, [k])
    _run(g, [k], chunks=2)


def test_tiled_listing1(tmp_path):
    g = graphs.bias_maxpool(2, 3, 8, 12)
    (k,) = _fuse(g, cache_dir=str(tmp_path), tile_sizes=(2, 2, 4, 4))
    _run(g, [k])


def _multi_output():
    b = GraphBuilder("multi")
    x = b.input("x", [4, 8])
    a = b.add(x, x)
    s = b.reduce_sum(x, axes=(1,))
    return b.build([a, s])


def _pool3_padded():
    b = GraphBuilder("pool3")
    x = b.input("x", [1, 2, 7, 9])
    a = b.relu(x)
    p = b.window_reduce(a, reducer="max", kernel=(3, 3), strides=(1, 1), pads=(1, 1, 1, 1),
                        dilations=(1, 1))
    return b.build([p])


def _all_reduce():
    b = GraphBuilder("dot")
    x = b.input("x", [6, 10])
    y = b.input("y", [6, 10])
    return b.build([b.reduce_sum(b.mul(x, y), axes=(0, 1))])


def _y_reduce():
    b = GraphBuilder("colmax")
    x = b.input("x", [6, 10])
    return b.build([b.reduce_max(b.exp(x), axes=(0,), keepdims=True)])


def _constants():
    b = GraphBuilder("consts")
    x = b.input("x", [6, 10])
    y = b.mul(x, 2.0)
    return b.build([b.add(y, b.constant(np.arange(10, dtype=np.float32)))])


@pytest.mark.parametrize("make,n_kernels", [
    (_multi_output, 1), (_pool3_padded, 1), (lambda: graphs.bias_maxpool(1, 2, 9, 7), 1),
    (_all_reduce, 1), (_y_reduce, 1), (_constants, 1)])
def test_more_patterns(tmp_path, make, n_kernels):
    g = make()
    ks = _fuse(g, cache_dir=str(tmp_path))
    assert len(ks) == n_kernels
    _run(g, ks)


def test_opaque_op_is_rejected(tmp_path):
    from apollo_py.errors import CompileError
    b = GraphBuilder("t")
    x = b.input("x", [2, 3])
    # (a transpose is an index map now, docs/design/stitching.md; a reshape is not)
    g = b.build([b.reshape(x, shape=(3, 2))])
    with pytest.raises(CompileError, match="affine"):
        _fuse(g, cache_dir=str(tmp_path))


@pytest.mark.parametrize("rows,cols", [(5, 37), (3, 100), (2, 32)])
def test_lane_reductions_with_tails(tmp_path, rows, cols):
    g = graphs.softmax(rows, cols)
    (k,) = _fuse(g, cache_dir=str(tmp_path))
    text = L.format_node(k.loop)
    assert "vector" in text and "lanes_" in text
    _run(g, [k])
    g = graphs.layernorm(rows, cols)
    (k,) = _fuse(g, cache_dir=str(tmp_path))
    _run(g, [k], feeds={"inv_n": 1 / cols, "eps": 1e-5})


def _allreduce_then_sub():
    b = GraphBuilder("center")
    x = b.input("x", [6, 10])
    s = b.reduce_sum(x, axes=(0, 1), keepdims=True)
    return b.build([b.sub(x, s)])


def test_multiple_fusion_groups_event_and_split(tmp_path):
    opts = Options(cache_dir=str(tmp_path))
    g = _allreduce_then_sub()
    ks = _fuse(g, options=opts)
    assert len(ks) == 2
    (e,) = read_events(default_log_path(opts), "multiple_fusion_groups")
    assert e["detail"]["ops"] == ["reduce_sum", "sub"]
    _run(g, ks)


@pytest.mark.parametrize("make", [lambda: graphs.softmax(8, 40), lambda: graphs.bias_reduce13(3, 4, 5, 6),
                                  lambda: graphs.bias_maxpool(1, 2, 8, 8)])
def test_isl_scheduler_fallback_end_to_end(tmp_path, monkeypatch, make):
    """With the direct construction disabled, isl's scheduler gives the kernels (if one group)."""
    import apollo_py.layers.pool_kernel as pool_kernel
    import apollo_py.poly.schedule as S

    def refuse(prog, deps):
        raise S.NotOneGroup("disabled for the test")
    monkeypatch.setattr(S, "build_fused_schedule", refuse)
    monkeypatch.setattr(pool_kernel, "pool_kernel", lambda *a: None)   # the pooling kernel too
    g = make()
    ks = _fuse(g, cache_dir=str(tmp_path))
    assert ks and ks[0].strategy == "isl"
    _run(g, ks)


def test_micro_graph_entry_point(tmp_path):
    mg_mod = pytest.importorskip("apollo_py.partition.micrograph")
    g = graphs.softmax(4, 16)
    mg = mg_mod.MicroGraph.build(g, list(g.nodes), ["reduction"] * 5, "reduction", [], 0)
    (k,) = fuse_micro_graph(mg, g.types, options=Options(cache_dir=str(tmp_path)))
    assert k.micro_graphs == (mg,) and k.outputs == tuple(g.outputs)
    _run(g, [k])


def _leaky_relu_where():
    b = GraphBuilder("leaky")
    x = b.input("x", [5, 33])
    zero = b.input("zero", [])
    y = b.where(b.gt(x, zero), x, b.mul(x, 0.1))
    return b.build([y])


def _int_ops():
    b = GraphBuilder("ints")
    x = b.input("x", [4, 7], "int32")
    y = b.input("y", [7], "int32")
    s = b.add(b.mul(x, y), b.cast(b.iota(shape=(4, 7), axis=1, dtype="int64"), to="int32"))
    return b.build([b.reduce_max(s, axes=(1,)), b.cast(b.lt(x, y), to="float32")])


def _float64_mean():
    b = GraphBuilder("f64")
    x = b.input("x", [3, 50], "float64")
    return b.build([b.reduce_sum(b.exp(x), axes=(1,), keepdims=True)])


@pytest.mark.parametrize("make", [_leaky_relu_where, _int_ops, _float64_mean])
def test_dtypes_and_selects(tmp_path, make):
    g = make()
    ks = _fuse(g, cache_dir=str(tmp_path))
    _run(g, ks)
