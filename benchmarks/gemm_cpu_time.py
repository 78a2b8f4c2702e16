"""The generated GEMM's micro-kernel speed on one thread, by CPU time, against onnxruntime.

    python benchmarks/gemm_cpu_time.py [--rounds 5] [--sample-ms 30] [--kc 256 ...]

For a shared, loaded box: each sample repeats a call until the calling thread has used
``--sample-ms`` of CPU time (``time.thread_time``), so a neighbour that preempts it stretches
the wall time, not the figure.  Both sides run on the calling thread -- apollo_py's
``compile_gemm(desc, 1)`` run inline, onnxruntime with one intra-op thread -- interleaved
round-robin; the table gives median GFLOP/s and the median of per-round time ratios.  Shapes
are the zoo's (benchmarks/gemm_shapes.py) plus 1024^3; a 2-D right operand is a constant
(packed once on both sides).  ``--kc`` etc. override :class:`Blocking` fields.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = [((1024, 1024), (1024, 1024)), ((128, 768), (768, 768)), ((128, 768), (768, 3072)),
          ((128, 3072), (3072, 768)), ((197, 768), (768, 768)), ((1500, 384), (384, 1536)),
          ((64, 512), (512, 256)), ((64, 13), (13, 512)), ((1, 12, 128, 64), (1, 12, 64, 128)),
          ((1, 12, 128, 128), (1, 12, 128, 64)), ((1, 12, 197, 64), (1, 12, 64, 197)),
          ((1, 8, 64, 64), (1, 8, 64, 64)), ((1, 6, 1500, 64), (1, 6, 64, 1500)), ((64, 9, 64), (64, 64, 9))]


def _ort(x, w, const):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)]
    if not const:
        ins.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, w.shape))
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", ins,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, np.matmul(x, w).shape)],
                          [numpy_helper.from_array(w, "w")] if const else [])
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                             so, providers=["CPUExecutionProvider"])
    feeds = {"x": x} if const else {"x": x, "w": w}
    return lambda: s.run(None, feeds)


def _sample(fn, cpu_s):
    fn()
    t0, n = time.thread_time(), 0
    while time.thread_time() - t0 < cpu_s:
        fn()
        n += 1
    return (time.thread_time() - t0) / n


def main(argv=None) -> int:
    from apollo_py.codegen.gemm import compile_gemm, default_blocking, matmul_desc
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--sample-ms", type=float, default=30.0)
    for f in ("kc", "mr", "nr", "b_block_bytes", "max_panels"):
        p.add_argument(f"--{f.replace('_', '-')}", type=int, default=None)
    args = p.parse_args(argv)
    over = {f: getattr(args, f) for f in ("kc", "mr", "nr", "b_block_bytes", "max_panels")
            if getattr(args, f) is not None}
    rng = np.random.default_rng(0)
    print(f"load {os.getloadavg()}")
    print("| shape | apollo GFLOP/s | ort GFLOP/s | apollo/ort time |\n|---|---|---|---|")
    for xs, ys in SHAPES:
        x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ys).astype(np.float32)
        want = np.matmul(x, w)
        const = len(ys) == 2
        d = replace(matmul_desc("mm", xs, ys, want.shape, "y", outputs=("y",), out_dtypes=("float32",)),
                    b_const=const)
        cg = compile_gemm(d, 1, replace(default_blocking(d), **over))
        out = np.empty(want.shape, np.float32)
        fns = {"apollo": lambda: cg.run(None, x, w, [], [out]), "ort": _ort(x, w, const)}
        fns["apollo"]()
        np.testing.assert_allclose(out, want, rtol=1e-3, atol=1e-3 * np.sqrt(xs[-1]))
        ts: dict = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                ts[k].append(_sample(fn, args.sample_ms / 1e3))
        flops = 2 * want.size * xs[-1]
        ratio = statistics.median(a / b for a, b in zip(ts["apollo"], ts["ort"]))
        print(f"| {xs}@{ys} | {flops / statistics.median(ts['apollo']) / 1e9:.0f} | "
              f"{flops / statistics.median(ts['ort']) / 1e9:.0f} | {ratio:.2f} |", flush=True)
    print(f"load {os.getloadavg()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
