"""In-process A/B of small generated matmuls shared with the native driver's helper thread
(``GemmStep.shares_tiles``, docs/design/gemm.md "Small products") on zoo models, onnxruntime
interleaved.

    python benchmarks/shared_gemm_ab.py [MODEL ...] [--rounds 9] [--threads 2]

MODEL is a zoo file name in ``~/.cache/apollo_py_zoo`` (default: DLRM, T5-small, Swin-T).
Arms, all on one compiled function (the driver program is rebuilt when an arm changes):
``one``: no helper (``drive.HELPER = False``: every driver step on the calling thread, the
larger GEMMs on the pool); ``pool``: the helper on, but the small matmuls dispatched to the
pool from Python as before this change; ``shared``: the helper on and the small matmuls driver
steps that the helper shares; ``solo``: the same steps but no helper ever started (what a call
runs when ``HELPER = "auto"`` finds other processes on the cores: every step on the calling
thread, no Python between them).  Prints the median ms per call of each arm and of onnxruntime
(all optimisations, no spinning) and the load average.  The helper only has a core to run on
when the machine is otherwise idle.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np

from helper_ab import ort_session, rebuild, timed    # benchmarks/ (the script's folder)

ZOO = os.path.expanduser("~/.cache/apollo_py_zoo")
DEFAULT = ["dlrm.torchscript.onnx", "t5_small.torchscript.onnx", "swin_t.torchscript.onnx"]


def _feeds(name: str) -> dict:
    man = json.load(open(os.path.join(ZOO, "manifest.json")))
    rng = np.random.default_rng(0)
    out = {}
    for inp in man[name]["inputs"]:
        if "high" in inp:
            out[inp["name"]] = rng.integers(0, inp["high"], inp["shape"]).astype(inp["dtype"])
        else:
            out[inp["name"]] = rng.standard_normal(inp["shape"]).astype(inp["dtype"])
    return out


def main() -> None:
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("models", nargs="*", default=DEFAULT)
    ap_.add_argument("--rounds", type=int, default=9)
    ap_.add_argument("--threads", type=int, default=2)
    ap_.add_argument("--calls", type=int, default=20, help="calls per arm and round (median taken)")
    args = ap_.parse_args()
    import apollo_py as ap
    from apollo_py.runtime import drive
    from apollo_py.runtime.cpu import CpuExecutable
    from apollo_py.runtime.gemm_step import GemmStep
    helper, shares, start = drive.HELPER, GemmStep.shares_tiles, drive._start_helper
    try:
        for name in args.models:
            path = os.path.join(ZOO, name)
            feeds = _feeds(name)
            f = ap.jit(path, options=ap.Options(num_threads=args.threads))
            f(**feeds)
            exes = [o for o in gc.get_objects() if isinstance(o, CpuExecutable)]

            def arm(which: str) -> None:
                drive.HELPER = which != "one"
                GemmStep.shares_tiles = shares if which in ("shared", "solo") else (lambda self, big=False: False)
                drive._start_helper = (lambda pool, tables: None) if which == "solo" else start
                rebuild(exes, f, feeds)

            sess = ort_session(path, args.threads)
            ref = sess.run(None, feeds)

            arms = ("one", "pool", "shared", "solo")
            res = {k: [] for k in (*arms, "ort")}
            worst = 0.0
            for _ in range(args.rounds):
                for which in arms:
                    arm(which)
                    res[which].append(timed(lambda: f(**feeds), args.calls))
                    got = f(**feeds)
                    got = got if isinstance(got, (list, tuple)) else [got]
                    worst = max(worst, max(float(np.abs(np.asarray(g) - r).max() / max(1e-30, np.abs(r).max()))
                                           for g, r in zip(got, ref)))
                    time.sleep(0.05)
                res["ort"].append(timed(lambda: sess.run(None, feeds), args.calls))
                time.sleep(0.05)
            med = {k: float(np.median(v)) for k, v in res.items()}
            print(f"{name}: one {med['one']:.3f} ms, pool {med['pool']:.3f}, shared {med['shared']:.3f}, "
                  f"solo {med['solo']:.3f}, onnxruntime {med['ort']:.3f}; shared/pool "
                  f"{med['shared'] / med['pool']:.3f}; apollo/ort " + " / ".join(
                      f"{med[a] / med['ort']:.2f}" for a in arms) + f"; max rel err {worst:.1e}; load "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
            del f
            gc.collect()
    finally:
        drive.HELPER, GemmStep.shares_tiles, drive._start_helper = helper, shares, start


if __name__ == "__main__":
    main()
