"""A second process compiles a traced function from the disk cache."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import apollo_py as ap
    from apollo_py.codegen.cached import piece_cache

    @ap.jit(options=ap.Options(cache_dir=sys.argv[1]))
    def f(x, b):
        y = np.tanh(x + b)
        return ap.nn.softmax(y * 2.0), ap.nn.layer_norm(y)

    x = np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)
    b = np.linspace(-1, 1, 32).astype(np.float32)
    s, l = f(x, b)
    y = np.tanh(x + b) * 2
    e = np.exp(y - y.max(-1, keepdims=True))
    ok = bool(np.allclose(s, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6))
    info = piece_cache(sys.argv[1]).info()
    print(json.dumps({"ok": ok, "misses": info["misses"], "disk_hits": info["disk_hits"],
                      "traces": f.trace_count}))
""")


def _run(cache_dir):
    env = dict(os.environ, APOLLO_PY_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_process_compiles_from_the_disk_cache(tmp_path):
    first = _run(tmp_path)
    assert first["ok"] and first["misses"] > 0 and first["disk_hits"] == 0 and first["traces"] == 1
    second = _run(tmp_path)
    assert second["ok"] and second["traces"] == 1
    assert second["misses"] == 0 and second["disk_hits"] == first["misses"]
