"""Batch-1 matrix-vector products: the generated GEMM's 1-row micro-tile against codegen/gemv.py
on one thread and on the pool's threads, per shape and inside zoo models.

    python benchmarks/gemv_ab.py [--shapes-only | --models-only] [--rounds 7] [--copies 4]
                                 [--zoo DIR] [--only SUBSTR ...]

Shapes: ``x[1, K] @ W[K, N] + b`` for the zoo's classifiers; ``--copies`` models of each, every
one with its own weight, called round robin so that the weight comes from L3 or memory as in a
whole model (a weight called twice in a row is in L2 and every variant reads it at ~100 GB/s).
Each call times the step's kernel alone (``compiled.run``), median of ``--rounds`` rounds of
5 x copies calls.  Models (MobileNetV3-large, EfficientNet-B0, ResNet-50 from the zoo directory):
each variant compiled in one process, the executable's per-step trace (``exe.trace``) of the
matrix-vector steps over interleaved rounds (p10 and median) and whole-model calls (median of
round medians).  Variants: ``gemm`` (``gemv.ENABLED`` off), ``gemv1`` (one thread, a native
driver step), ``gemv2`` (the pool's threads claim tiles).  Print the load average with every
number: on a shared machine only the quiet-box rows say which is faster.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

VARIANTS = {"gemm": (False, 0), "gemv1": (True, 1 << 60), "gemv2": (True, 0)}
SHAPES = {"mnv3_960x1280": (960, 1280), "mnv3_1280x1000": (1280, 1000), "effnet_1280x1000": (1280, 1000),
          "resnet50_2048x1000": (2048, 1000), "regnety_888x1000": (888, 1000)}
MODELS = ("mobilenetv3_large.torchscript.onnx", "efficientnet_b0.torchscript.onnx", "resnet50.torchscript.onnx")


def _variant(name):
    from apollo_py.codegen import gemv
    gemv.ENABLED, gemv.POOL_WEIGHT_BYTES = VARIANTS[name]


def _matmul(k, n, seed):
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])],
                          "mv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, n])],
                          [numpy_helper.from_array((rng.standard_normal((k, n)) * 0.05).astype(np.float32), "w"),
                           numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), rng.standard_normal((1, k)).astype(np.float32)


def _kernel_call(f, x):
    """A function timing one call of the model's only GEMM step's kernel."""
    from apollo_py.runtime.gemm_step import GemmStep
    exe = f.specialization({"x": x.shape})
    s, = [s for s in exe.steps if isinstance(s, GemmStep)]
    d = s.compiled.desc
    a, b = x, exe.constants[d.b_value]
    ops = [exe.constants[o.value] for o in d.operands]
    outs = [np.empty(shape, dt) for _, shape, dt in s._stored]

    def one():
        t0 = time.perf_counter()
        s.compiled.run(exe._pool, a, b, ops, outs)
        return time.perf_counter() - t0
    return one


def shapes(args) -> None:
    import apollo_py as ap
    print(f"per shape, weight out of L2 ({args.copies} copies round robin), kernel calls, "
          f"median of {args.rounds} rounds  (load {os.getloadavg()[0]:.1f})")
    for name, (k, n) in SHAPES.items():
        if args.only and not any(s in name for s in args.only):
            continue
        calls = {}
        for v in VARIANTS:
            _variant(v)
            calls[v] = []
            for c in range(args.copies):
                m, x = _matmul(k, n, c)
                f = ap.jit(m, options=ap.Options(num_threads=args.threads))
                f(x=x)
                calls[v].append(_kernel_call(f, x))
        res = {v: [] for v in calls}
        for _ in range(args.rounds):
            for v, ones in calls.items():
                res[v].append(np.median([one() for _ in range(5) for one in ones]))
        med = {v: float(np.median(t)) for v, t in res.items()}
        print(f"  {name:<20} " + "  ".join(f"{v} {med[v] * 1e6:7.1f} us ({4 * k * n / med[v] / 1e9:5.1f} GB/s)"
                                           for v in med) + f"  load {os.getloadavg()[0]:.1f}")
    _variant("gemm")


def models(args) -> None:
    import onnx

    import apollo_py as ap
    from apollo_py.runtime.gemm_step import GemmStep
    zoo = Path(args.zoo)
    for fn in MODELS:
        if not (zoo / fn).exists() or (args.only and not any(s in fn for s in args.only)):
            continue
        inp = onnx.load(str(zoo / fn), load_external_data=False).graph.input[0]
        x = np.random.default_rng(0).standard_normal(
            [d.dim_value or 1 for d in inp.type.tensor_type.shape.dim]).astype(np.float32)
        runs = {}
        for v in VARIANTS:
            _variant(v)
            f = ap.jit(str(zoo / fn), options=ap.Options(num_threads=args.threads, cache_dir=tempfile.mkdtemp()))
            f(x)
            exe = f.specialization({inp.name: x.shape})
            idx = [k for k, (kind, s) in enumerate(exe._schedule) if kind == "step" and isinstance(s, GemmStep)
                   and s.compiled.desc.conv is None and s.compiled.desc.m == 1 and s.compiled.desc.batch == 1]
            runs[v] = (f, exe, idx)
        _variant("gemm")
        steps, whole = {}, {v: [] for v in runs}
        for _ in range(args.rounds):
            for v, (f, exe, idx) in runs.items():
                tr: list = []
                exe.trace = tr
                for _ in range(5):
                    del tr[:]
                    exe.run({inp.name: x})
                    for k, sec in tr:
                        if k in idx:
                            steps.setdefault((v, k), []).append(sec)
                exe.trace = None
                ts = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    f(x)
                    ts.append(time.perf_counter() - t0)
                whole[v].append(np.median(ts))
        print(f"{fn}  (load {os.getloadavg()[0]:.1f})")
        for (v, k), t in sorted(steps.items(), key=lambda e: (e[0][1], e[0][0])):
            print(f"  step {k:3d} {v:<6} p10 {np.percentile(t, 10) * 1e6:7.1f} us  median {np.median(t) * 1e6:7.1f} us")
        print("  whole model: " + "  ".join(f"{v} {np.median(t) * 1e3:.3f} ms" for v, t in whole.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--shapes-only", action="store_true")
    ap.add_argument("--models-only", action="store_true")
    ap.add_argument("--zoo", default=os.environ.get("APOLLO_PY_ZOO_DIR", str(Path.home() / ".cache" / "apollo_py_zoo")))
    ap.add_argument("--only", nargs="*", default=())
    args = ap.parse_args(argv)
    if not args.models_only:
        shapes(args)
    if not args.shapes_only:
        models(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
