"""CompiledGraph.profile / `apollo-py bench` (apollo_py/runtime/profile.py)."""
import subprocess
import sys

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import ApolloError


def _graph():
    b = ap.GraphBuilder("prof")
    x = b.input("x", (256, 256))
    w = b.input("w", (256, 256))
    h = b.matmul(x, w)
    m = b.reduce_max(h, axes=(1,), keepdims=True)
    e = b.exp(h - m)
    return b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)])


def _feeds():
    rng = np.random.default_rng(5)
    return {"x": rng.standard_normal((256, 256)).astype(np.float32),
            "w": rng.standard_normal((256, 256)).astype(np.float32) * 0.05}


def test_profile_reports_every_step_with_plan_bytes_and_flops():
    g, feeds = _graph(), _feeds()
    machine = ap.machine.preset("dev-2core")
    f = ap.jit(g, options=ap.Options(machine="dev-2core"))
    want = f(**feeds)
    p = f.profile(repeat=3, **feeds)
    exe = f.specialization({k: v.shape for k, v in feeds.items()})
    assert exe.trace is None                              # the hook is off again
    assert len(p.steps) == len(exe._schedule) >= 2
    assert (p.bandwidth, p.peak) == (machine.bandwidth, machine.peak)
    assert sum(s.seconds for s in p.steps) <= p.total_seconds * 1.5 + 1e-3
    kinds = {}
    for s in p.steps:
        assert s.seconds > 0 and s.bytes > 0 and s.flops > 0
        assert s.gbps == pytest.approx(s.bytes / s.seconds / 1e9)
        assert s.gflops == pytest.approx(s.flops / s.seconds / 1e9)
        ridge = machine.peak / machine.bandwidth              # flop/byte where the roofs meet
        assert s.bound == ("compute" if s.intensity > ridge else "memory")
        kinds[s.what.split()[0]] = s
    mm = next(s for s in p.steps if "matmul" in s.what or s.what.startswith(("blas", "gemm")))
    assert mm.flops == 2 * 256 ** 3 and mm.bound == "compute"
    soft = next(s for s in p.steps if s.what.startswith("kernel") and "exp" in s.what)
    k = next(st.fused for st in exe.steps if getattr(st, "fused", None) is not None and
             any(n.op == "exp" for n in st.fused.nodes))
    assert (soft.bytes, soft.flops, soft.bound) == (k.bytes, k.flops, "memory")
    assert "GB/s" in str(p) and "roof" in str(p)
    np.testing.assert_array_equal(f(**feeds), want)      # profiling changed nothing


def test_profile_needs_the_cpu_target():
    f = ap.jit(_graph(), target="reference")
    with pytest.raises(ApolloError, match="target='cpu'"):
        f.profile(**_feeds())


def test_cli_bench_prints_the_profile_and_onnxruntime(tmp_path):
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples"))
    import make_models as mm
    import onnx
    path = tmp_path / "mlp.onnx"
    onnx.save(mm.make_mlp(), str(path))
    r = subprocess.run([sys.executable, "-m", "apollo_py.cli", "--cache-dir", str(tmp_path), "bench", str(path),
                        "--shape", "x=64,16", "--repeat", "3"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "per run (median of 3)" in r.stdout and "GFLOP/s" in r.stdout
    try:
        import onnxruntime  # noqa: F401
        assert "onnxruntime:" in r.stdout
    except ImportError:
        pass
    r = subprocess.run([sys.executable, "-m", "apollo_py.cli", "--cache-dir", str(tmp_path), "bench", str(path)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "--shape x=" in r.stderr
