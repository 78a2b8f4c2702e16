"""In-process A/B of the native driver's helper thread (``apollo_py.runtime.drive.HELPER``,
docs/design/conv.md "Small convs on the calling thread") on zoo models, onnxruntime interleaved.

    python benchmarks/helper_ab.py [MODEL ...] [--rounds 9] [--threads 2]

MODEL is a zoo file stem (``mobilenetv3_large.dynamo``; default: the mobile CNNs) in
``~/.cache/apollo_py_zoo`` (benchmarks/zoo).  One compile per model; the driver program is
rebuilt when the flag flips, so both arms run the same kernels.  Prints median ms per call of
each arm and of onnxruntime (all optimisations, no spinning), and whether both arms' outputs
are bit-identical.  Run it on an otherwise idle machine: on a loaded one the helper has no
core to run on and the ratio says nothing.

``--share`` A/Bs the helper-shared conv and big steps instead (``gemm_step.SHARE_CONVS``,
``drive.SHARE_BIG``, docs/design/driver.md "Big steps in the driver"), every arm with
``HELPER = True``: ``base`` (neither), ``convs`` (shared convs), ``big`` (shared convs and the
big-step program), and ``base_solo`` / ``solo`` (``base`` / ``big`` with the helper never
asked for: the busy-box path of ``HELPER = "auto"``, where a call runs the first program
without a helper).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import time

import numpy as np

ZOO = os.path.expanduser("~/.cache/apollo_py_zoo")
DEFAULT = ["mobilenetv3_large.dynamo", "efficientnet_b0.dynamo", "rapidocr_rec.trained", "rapidocr_cls.trained"]


def _feeds(name: str) -> dict:
    import onnx
    man = json.load(open(os.path.join(ZOO, "manifest.json")))
    shapes = {i["name"]: i["shape"] for i in man[name + ".onnx"]["inputs"]}
    rng = np.random.default_rng(0)
    return {i.name: rng.standard_normal(shapes[i.name]).astype(np.float32)
            for i in onnx.load(os.path.join(ZOO, name + ".onnx")).graph.input}


def rebuild(exes, f, feeds) -> None:
    """Drop the driver programs of ``exes`` (and their arenas' tables) so that the next call of
    ``f`` builds them under the flags now set, and make that call."""
    for e in exes:
        e._program = None
        for a in e._arenas._free:
            a.driver = None
    f(**feeds)


def ort_session(path: str, threads: int):
    """onnxruntime with all optimisations, ``threads`` intra-op threads, no spinning."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def timed(fn, calls: int) -> float:
    """Median ms per call of ``calls`` calls of ``fn``."""
    ts = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) * 1e3


def main() -> None:
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("models", nargs="*", default=DEFAULT)
    ap_.add_argument("--rounds", type=int, default=9)
    ap_.add_argument("--threads", type=int, default=2)
    ap_.add_argument("--on", choices=["true", "auto"], default="true",
                     help='the helper arm\'s HELPER: True (always a helper) or "auto" (only while the '
                          "cores are free of other processes)")
    ap_.add_argument("--share", action="store_true", help="A/B the shared conv / big steps (see above)")
    ap_.add_argument("--calls", type=int, default=10, help="calls per arm and round (median taken)")
    args = ap_.parse_args()
    if args.share:
        _share_ab(args)
        return
    import apollo_py as ap
    from apollo_py.runtime import drive
    from apollo_py.runtime.cpu import CpuExecutable
    default = drive.HELPER
    for name in args.models:
        path = os.path.join(ZOO, name + ".onnx")
        feeds = _feeds(name)
        f = ap.jit(path, options=ap.Options(num_threads=args.threads))
        f(**feeds)
        exes = [o for o in gc.get_objects() if isinstance(o, CpuExecutable)]

        on_value = True if args.on == "true" else "auto"

        def arm(on) -> None:
            drive.HELPER = on
            rebuild(exes, f, feeds)

        sess = ort_session(path, args.threads)
        arm(False)
        off = f(**feeds)
        off = [np.array(r) for r in (off if isinstance(off, (list, tuple)) else [off])]
        arm(on_value)
        on = f(**feeds)
        on = [np.array(r) for r in (on if isinstance(on, (list, tuple)) else [on])]
        same = all(np.array_equal(a, b) for a, b in zip(off, on))

        res = {"off": [], "helper": [], "ort": []}
        for _ in range(args.rounds):
            arm(False)
            res["off"].append(timed(lambda: f(**feeds), args.calls))
            arm(on_value)
            res["helper"].append(timed(lambda: f(**feeds), args.calls))
            res["ort"].append(timed(lambda: sess.run(None, feeds), args.calls))
        med = {k: float(np.median(v)) for k, v in res.items()}
        print(f"{name}: off {med['off']:.3f} ms, helper {med['helper']:.3f} ms, onnxruntime {med['ort']:.3f} ms; "
              f"helper/off {med['helper'] / med['off']:.3f}, apollo/ort {med['off'] / med['ort']:.2f} -> "
              f"{med['helper'] / med['ort']:.2f}; bit-identical {same}; load {os.getloadavg()[0]:.1f}", flush=True)
        drive.HELPER = default


def _share_ab(args) -> None:
    """The ``--share`` arms, interleaved per round; median of per-call medians."""
    import apollo_py as ap
    from apollo_py.runtime import drive, gemm_step
    from apollo_py.runtime.cpu import CpuExecutable
    saved = drive.HELPER, drive.SHARE_BIG, gemm_step.SHARE_CONVS, drive._start_helper, drive.helper_wanted
    arms = ("base", "convs", "big", "base_solo", "solo")
    try:
        for name in args.models:
            path = os.path.join(ZOO, name + ".onnx")
            feeds = _feeds(name)
            f = ap.jit(path, options=ap.Options(num_threads=args.threads, cache_dir=os.environ.get("AB_CACHE") or
                                               ap.Options().cache_dir))
            f(**feeds)
            exes = [o for o in gc.get_objects() if isinstance(o, CpuExecutable)]

            def arm(which: str) -> None:
                drive.HELPER = True
                gemm_step.SHARE_CONVS = which in ("convs", "big", "solo")
                drive.SHARE_BIG = which in ("big", "solo")
                # a call that does not ask for the helper: the first program, no helper
                drive.helper_wanted = (lambda: False) if which.endswith("solo") else saved[4]
                rebuild(exes, f, feeds)

            sess = ort_session(path, args.threads)
            ref = sess.run(None, feeds)

            from apollo_py.cpuload import cpu_busy, others_share, own_cpu
            res = {k: [] for k in (*arms, "ort")}
            worst, loads, others = 0.0, [], []
            for _ in range(args.rounds):
                b0, o0, t0 = cpu_busy(), own_cpu(), time.perf_counter()
                for which in arms:
                    arm(which)
                    res[which].append(timed(lambda: f(**feeds), args.calls))
                    got = f(**feeds)
                    got = got if isinstance(got, (list, tuple)) else [got]
                    worst = max(worst, max(float(np.abs(np.asarray(g) - r).max() / max(1e-30, np.abs(r).max()))
                                           for g, r in zip(got, ref)))
                res["ort"].append(timed(lambda: sess.run(None, feeds), args.calls))
                loads.append(os.getloadavg()[0])
                # what other processes ran during the round, in cores (the quiet rounds: < 0.4)
                share = others_share(b0, o0, cpu_busy(), own_cpu(), time.perf_counter() - t0)
                others.append((share or 0.0) * (os.cpu_count() or 1))
            quiet = [r for r, o in enumerate(others) if o < 0.4]
            if quiet:
                print(f"{name}: {len(quiet)} of {len(others)} rounds with others under 0.4 core; their medians: " +
                      ", ".join(f"{k} {np.median([res[k][r] for r in quiet]):.3f}" for k in (*arms, "ort")) +
                      " ms; paired vs base: " + " / ".join(
                          f"{k} {np.median([res[k][r] / res['base'][r] for r in quiet]):.3f}" for k in arms[1:]),
                      flush=True)
            med = {k: float(np.median(v)) for k, v in res.items()}
            print(f"{name}: " + ", ".join(f"{k} {med[k]:.3f}" for k in (*arms, "ort")) + " ms; vs base " +
                  " / ".join(f"{k} {med[k] / med['base']:.3f}" for k in arms[1:]) + " (paired, median of rounds: " +
                  " / ".join(f"{np.median(np.array(res[k]) / np.array(res['base'])):.3f}" for k in arms[1:]) +
                  "); apollo/ort " +
                  " / ".join(f"{med[k] / med['ort']:.2f}" for k in arms) +
                  f"; max rel err vs ort {worst:.1e}; load {min(loads):.1f}-{max(loads):.1f}, others' cores per round "
                  f"median {np.median(others):.2f}", flush=True)
            del f
            gc.collect()
    finally:
        drive.HELPER, drive.SHARE_BIG, gemm_step.SHARE_CONVS, drive._start_helper, drive.helper_wanted = saved


if __name__ == "__main__":
    main()
