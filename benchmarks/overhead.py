"""Per-call overhead: apollo_py against onnxruntime on models whose work is negligible.

Two models on tiny float32 tensors (issue 14, item 4):

* ``chain20``: 20 ``ReduceMax``/``Sub`` pairs on a [16, 16] tensor, reducing along axis 0 and
  axis 1 in turn, so each pair is one kernel that cannot fuse with the next (a reduction reads
  the whole previous result): 20 generated kernels of ~1 KiB each.
* ``add1``: one ``Add`` of a constant: one kernel, the fixed cost of a call.

Each contender runs in this process, interleaved round-robin in blocks of calls, and the
median (and best) over rounds of microseconds per call is reported (the machine may be
shared: the load average is printed next to the numbers).  onnxruntime runs with all graph optimisations, 2
intra-op threads and no spinning (as in benchmarks/run.py); apollo with 2 threads.

    python benchmarks/overhead.py [--rounds 15] [--kernels 20] [--profile]

``--profile`` also prints where one apollo call's time goes, by cProfile.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np


def chain_model(n: int, shape=(16, 16)):
    """ONNX model of ``n`` ReduceMax/Sub pairs alternating axes (``n`` kernels in apollo)."""
    from onnx import TensorProto, helper as h
    nodes, prev = [], "x"
    for i in range(n):
        nodes.append(h.make_node("ReduceMax", [prev], [f"m{i}"], axes=[i % 2], keepdims=1))
        nodes.append(h.make_node("Sub", [prev, f"m{i}"], [f"y{i}"]))
        prev = f"y{i}"
    g = h.make_graph(nodes, f"chain{n}", [h.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                     [h.make_tensor_value_info(prev, TensorProto.FLOAT, shape)])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 13)])


def add_model(shape=(16, 16)):
    """ONNX model of one Add of a constant (one kernel)."""
    from onnx import TensorProto, helper as h, numpy_helper
    c = numpy_helper.from_array(np.full(shape, 0.5, np.float32), "c")
    g = h.make_graph([h.make_node("Add", ["x", "c"], ["y"])], "add1",
                     [h.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, shape)], initializer=[c])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 13)])


def ort_session(model, threads: int):
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def time_interleaved(fns: dict, rounds: int, calls: int) -> dict:
    """(median, best) microseconds per call of each function over rounds of ``calls`` calls,
    the functions taking turns block by block."""
    for f in fns.values():
        for _ in range(10):
            f()
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            samples[k].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: (statistics.median(v), min(v)) for k, v in samples.items()}


def contenders(model, x, threads: int) -> dict:
    import apollo_py as ap
    sess = ort_session(model, threads)
    f = ap.jit(model, options=ap.Options(num_threads=threads))
    want = sess.run(None, {"x": x})[0]
    got = f(x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    out = np.empty_like(want)
    # the same plan with every step run from Python (the driver switched off), for an A/B
    g = ap.jit(model, options=ap.Options(num_threads=threads))
    np.testing.assert_array_equal(g(x), got)
    g.specialization({"x": x.shape}).use_driver = False
    np.testing.assert_array_equal(g(x), got)
    return {"apollo": lambda: f(x), "apollo out=": lambda: f(x, out=out),
            "apollo no driver": lambda: g(x), "onnxruntime": lambda: sess.run(None, {"x": x})}, f


def main(argv=None) -> int:
    ap_ = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap_.add_argument("--rounds", type=int, default=21)
    ap_.add_argument("--calls", type=int, default=100, help="calls per timed block")
    ap_.add_argument("--kernels", type=int, default=20)
    ap_.add_argument("--threads", type=int, default=2)
    ap_.add_argument("--profile", action="store_true")
    args = ap_.parse_args(argv)
    x = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    models = {f"chain{args.kernels}": chain_model(args.kernels), "add1": add_model()}
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}, {os.cpu_count()} cpus, "
          f"{args.threads} threads, {args.rounds} rounds of {args.calls} calls")
    for name, model in models.items():
        fns, f = contenders(model, x, args.threads)
        kernels = len(f.plan.kernels)
        res = time_interleaved(fns, args.rounds, args.calls)
        ort = res["onnxruntime"][0]
        cells = "  ".join(f"{k} {v:7.2f} us ({v / ort:.2f}x, best {b:.2f})" for k, (v, b) in res.items())
        print(f"{name:8s} ({kernels:2d} steps): {cells}")
        if args.profile:
            import cProfile
            import pstats
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(2000):
                f(x)
            pr.disable()
            pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
