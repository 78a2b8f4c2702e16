"""``make soak``: the full soak of issue #16 item 7 (``tests/test_soak.py`` runs reduced counts).

1. 100,000 calls of a small model (tests/models/zoo/dlrm_small), and 10,000 more with ``out=``;
2. 1,000 calls of a large one (the zoo's full-size DLRM, 206 MB of weights; skipped when
   ``~/.cache/apollo_py_zoo`` or ``$APOLLO_PY_ZOO_DIR`` does not hold it: ``make zoo``);
3. shape churn: a small graph called at 48 shapes, 3 rounds (over ``api.MAX_SPECIALIZATIONS``,
   so specialisations are compiled, dropped and compiled again);
4. 20 compiles killed by SIGKILL at random moments into one cache directory;
5. interpreter exit with a daemon thread still calling (the thread pool's exit hook).

Tolerances (after a warm-up): no new file descriptor; RSS growth at most 8 MiB over the small
model's calls, 32 MiB over the large model's, 64 MiB between churn rounds 1 and 3.  Prints one
line per check and a summary row for benchmarks/RESULTS.md; exit 1 on any failure.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MiB = 1 << 20


def _report(name, ok, detail):
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    return ok


def _calls(name, f, feeds, calls, tol, out=None):
    from soak_lib import soak_calls
    r = soak_calls(f, feeds, calls, out=out)
    ok = r["mismatches"] == 0 and r["fds_growth"] == 0 and r["rss_growth"] <= tol
    return _report(name, ok, f"{calls} calls in {r['seconds']:.1f} s, RSS {r['rss'][0] / MiB:.1f} -> "
                   f"{r['rss'][-1] / MiB:.1f} MiB (max {max(r['rss']) / MiB:.1f}, tolerance +{tol / MiB:.0f}), "
                   f"fds {r['fds'][0]} -> {r['fds'][-1]}, {r['mismatches']} mismatches"), calls


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--small-calls", type=int, default=100_000)
    p.add_argument("--large-calls", type=int, default=1_000)
    p.add_argument("--kills", type=int, default=20)
    args = p.parse_args(argv)
    import numpy as np

    import apollo_py as ap
    from soak_lib import SMALL_ZOO, as_list, killed_compiles, open_fds, rss_bytes, zoo_feeds

    t0 = time.perf_counter()
    results, soaked = [], 0
    cache = tempfile.mkdtemp(prefix="apollo_soak_")
    opts = ap.Options(cache_dir=cache)

    small = "dlrm_small.dynamo.onnx"
    f = ap.jit(str(SMALL_ZOO / small), options=opts)
    feeds = zoo_feeds(small)
    ok, n = _calls(f"small model {small}", f, feeds, args.small_calls, 8 * MiB)
    results.append(ok)
    soaked += n
    out = [np.empty_like(o) for o in as_list(f(**feeds))]
    ok, n = _calls(f"small model {small}, out=", f, feeds, max(1, args.small_calls // 10), 8 * MiB, out=out)
    results.append(ok)
    soaked += n

    zoo = Path(os.environ.get("APOLLO_PY_ZOO_DIR") or Path.home() / ".cache" / "apollo_py_zoo")
    large = "dlrm.torchscript.onnx"
    if (zoo / large).exists():
        g = ap.jit(str(zoo / large), options=opts)
        ok, n = _calls(f"large model {large}", g, zoo_feeds(large, zoo), args.large_calls, 32 * MiB)
        results.append(ok)
        soaked += n
        del g
    else:
        print(f"skip large model: {zoo / large} not found (make zoo)", flush=True)

    from onnx import TensorProto, helper
    node = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Add", ["e", "x"], ["y"])]
    model = helper.make_model(helper.make_graph(node, "churn", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", 8])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])]),
        opset_imports=[helper.make_opsetid("", 17)])
    h = ap.jit(model.SerializeToString(), options=opts)
    rss_rounds, fds_rounds, bad = [], [], 0
    for _ in range(3):
        for rows in range(1, 49):
            a = np.full((rows, 8), 0.25, np.float32)
            if not np.allclose(h(a), np.exp(a) + a, rtol=1e-6):
                bad += 1
        soaked += 48
        rss_rounds.append(rss_bytes())
        fds_rounds.append(open_fds())
    ok = bad == 0 and fds_rounds[-1] == fds_rounds[0] and rss_rounds[-1] - rss_rounds[0] <= 64 * MiB
    results.append(_report("shape churn (48 shapes x 3 rounds)", ok, f"RSS after each round "
                           f"{[round(r / MiB, 1) for r in rss_rounds]} MiB (tolerance +64 between rounds 1 and 3), "
                           f"fds {fds_rounds}, {bad} mismatches"))

    kcache = tempfile.mkdtemp(prefix="apollo_soak_kill_")
    r = killed_compiles(SMALL_ZOO / "mobilenetv3_small.dynamo.onnx", kcache, args.kills, seed=0, max_delay=6.0)
    ok = not r["problems"] and r["started"] == args.kills
    results.append(_report("killed compiles", ok, f"{r['started']} started compiling, {r['killed']} killed, "
                           f"{r['finished']} finished "
                           f"before the kill, {len(r['problems'])} bad entries, {len(r['stale'])} stale files "
                           "(temp files / half entries, ignored by readers, swept after 10 min)"))

    exit_script = Path(__file__).resolve().parents[1] / "tests" / "test_soak.py"
    import importlib.util
    spec = importlib.util.spec_from_file_location("test_soak", exit_script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    e = subprocess.run([sys.executable, "-c", mod._EXIT_SCRIPT, cache], capture_output=True, text=True, timeout=300)
    results.append(_report("interpreter exit", e.returncode == 0 and not e.stderr
                           and "pool workers alive after exit hooks: 0" in e.stdout,
                           f"rc {e.returncode}, {e.stdout.strip().splitlines()[-1:]}, stderr {e.stderr[-200:]!r}"))

    fails = results.count(False)
    print(f"soak: {soaked} calls soaked, {len(results)} checks, {fails} failing, "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
