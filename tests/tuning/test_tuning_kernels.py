"""Code decisions of layer-1 kernels (apollo_py/tuning/kernels.py): vector width and parallel
dim are applied to the loop IR before LLVM, change the compiled code and its cache key, and
never the numbers."""
import numpy as np
import pytest

import apollo_py as ap
from apollo_py.codegen import loopir as L
from apollo_py.errors import CompileError
from apollo_py.runtime.cpu import KernelStep
from apollo_py.tuning import db
from apollo_py.tuning.kernels import host_vector_width, kernel_code_candidates, second_parallel, tuned_loop
from apollo_py.tuning.tuner import plan_steps


def _graph():
    """exp(x) * y + 1 and a row sum of exp(x) over [3, 64, 128]: one kernel whose coincident
    band is (3, 64) -- the first member too short to split over many threads."""
    b = ap.GraphBuilder("bands")
    x = b.input("x", (3, 64, 128))
    y = b.input("y", (3, 64, 128))
    return b.build([b.exp(x) * y + 1.0, b.reduce_sum(b.exp(x), axes=(2,))])


def _run(tmp_path, **kw):
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal((3, 64, 128)).astype(np.float32) for k in ("x", "y")}
    f = ap.jit(_graph(), options=ap.Options(cache_dir=str(tmp_path), machine="dev-2core", **kw))
    out = f.run(**feeds)
    return f.specialization({k: v.shape for k, v in feeds.items()}), out


def _kernels(exe):
    return [s for s in exe.steps if isinstance(s, KernelStep) and s.fused is not None]


def test_second_parallel_member_moves_the_split_only_where_the_band_has_it(tmp_path):
    exe, _ = _run(tmp_path, tune="off")
    (s,) = [s for s in _kernels(exe) if s.fused.parallel_dims >= 2]
    assert tuple(s.fused.band_extents[:2]) == (3, 64) and s.fused.loop.parallel_extent == 3
    alt = second_parallel(s.fused)
    assert alt is not None and alt.parallel_extent == 64 and alt.parallel_var != s.fused.loop.parallel_var
    assert "parallel dim 1" in kernel_code_candidates(s.fused)
    # a tiled band (tile loops outermost) or a band of one: not offered
    from dataclasses import replace
    assert second_parallel(replace(s.fused, tile_sizes=(16,))) is None
    assert second_parallel(replace(s.fused, parallel_dims=1)) is None
    assert tuned_loop(s.fused, {"parallel_dim": 7, "vector_width": host_vector_width()}) is None
    with pytest.raises(CompileError, match="vector_width"):
        s.fused.loop.replace(vector_width=300)


def test_kernel_code_decisions_change_the_code_not_the_numbers(tmp_path):
    untuned, want = _run(tmp_path, tune="off")
    g = untuned.plan.graph
    decision = {"parallel_dim": 1, **({"vector_width": 256} if host_vector_width() == 512 else {})}
    records = {db.kernel_key(s.fused, g.types): {"kind": "kernel", "decision": decision} for s in _kernels(untuned)}
    db.write(str(tmp_path / "tuning.json"), records)
    exe, out = _run(tmp_path)
    ks = _kernels(exe)
    banded = [s for s in ks if s.fused.parallel_dims >= 2]
    assert banded and all(s.compiled.parallel_extent == 64 and s.compiled.kernel.parallel_extent == 64
                          for s in banded)
    if host_vector_width() == 512:
        assert all(s.compiled.kernel.vector_width == 256 for s in ks)
        assert all('"prefer-vector-width"="256"' in s.compiled.ir for s in ks if s.compiled.ir)
    assert plan_steps(exe) != plan_steps(untuned)
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_vector_width_is_in_the_rendered_text():
    from apollo_py.codegen.llvm import host, render_llvm, with_vector_width
    k = L.Kernel("k", (L.Param("a", "float32", 64),), L.Block())
    base = render_llvm(k, host().cpu_attrs)
    narrow = render_llvm(k.replace(vector_width=256), host().cpu_attrs)
    assert narrow != base and narrow.count('"prefer-vector-width"="256"') >= 1
    assert with_vector_width('"a"="b" "prefer-vector-width"="512"', 128) == '"a"="b" "prefer-vector-width"="128"'
