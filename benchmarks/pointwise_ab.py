"""Whole-model A/B of a codegen switch, in one process: apollo with ``MODULE.FLAG`` on (new) and
off (old), and onnxruntime, interleaved (benchmarks/zoo._time_interleaved), 2 threads, batch 1.

    python benchmarks/pointwise_ab.py [--ab conv_cvec.BALANCE] [--models regnety_016 resnet50]
                                      [--rounds 9] [--threads 2]

Each variant compiles into its own cache directory (the plans differ); the median per-round
ratio new / old is printed with the load average (a shared machine: direction only)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ab", default="conv_cvec.BALANCE")
    ap.add_argument("--models", nargs="*", default=["regnety_016", "resnet50"])
    ap.add_argument("--zoo", default=os.environ.get("APOLLO_PY_ZOO_DIR", str(Path.home() / ".cache" / "apollo_py_zoo")))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import onnxruntime as ort
    import apollo_py
    from apollo_py import Options
    from conv_bench import _load, _switched_off
    from run import _ort_session
    from zoo import _inputs, _rel_err
    zoo = Path(args.zoo)
    manifest = json.loads((zoo / "manifest.json").read_text())
    cache = tempfile.mkdtemp(prefix="pw_ab_")
    for model in args.models:
        fn = f"{model}.torchscript.onnx"
        feeds = _inputs(manifest[fn])
        path = str(zoo / fn)
        f_new = apollo_py.jit(path, options=Options(num_threads=args.threads, cache_dir=cache + "/new"))
        got = f_new(**feeds)
        with _switched_off(args.ab):
            f_old = apollo_py.jit(path, options=Options(num_threads=args.threads, cache_dir=cache + "/old"))
            f_old(**feeds)
        s = _ort_session(open(path, "rb").read(), ort.GraphOptimizationLevel.ORT_ENABLE_ALL, args.threads)
        want = s.run(None, feeds)
        fns = {"new": lambda: f_new(**feeds), "old": lambda: f_old(**feeds), "ort": lambda: s.run(None, feeds)}
        per = {k: [] for k in fns}
        for fn_ in fns.values():
            fn_()
        for r in range(args.rounds):
            names = list(fns)[r % 3:] + list(fns)[:r % 3]
            for k in names:
                time.sleep(0.05)
                t0 = time.perf_counter()
                for _ in range(3):
                    fns[k]()
                per[k].append((time.perf_counter() - t0) / 3 * 1e3)
        med = {k: statistics.median(v) for k, v in per.items()}
        ratio = statistics.median(n / o for n, o in zip(per["new"], per["old"]))
        err = _rel_err(got if isinstance(got, (list, tuple)) else [got], want)
        print(f"{model}: new {med['new']:.2f} ms, old {med['old']:.2f} ms, ort {med['ort']:.2f} ms; "
              f"new/old {ratio:.3f}, new/ort {med['new'] / med['ort']:.2f}, rel err {err:.1e}  ({_load()})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
