"""2-thread scaling of the generated GEMM against onnxruntime's, on the zoo's linear layers.

    python benchmarks/gemm_threads.py [--calls 200] [--only 768,dlrm]

Per shape (``x @ w``, ``w`` a constant weight: packed once on both sides), four contenders
interleaved call by call in one process: apollo_py's ``compile_gemm`` run inline (1 thread)
and on a 2-thread pool, onnxruntime with 1 and 2 intra-op threads (spinning off, IOBinding).
Reports the p10 and the median wall time per call, the GFLOP/s of the p10, and the ratios
apollo-2 / ort-2 and apollo-2 / apollo-1.  On a shared box the p10 is the figure that saw
a free core at all; print ``uptime`` next to what you report (docs/design/gemm.md).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (label, x shape, w shape): the zoo's linear layers (benchmarks/gemm_shapes.py) and 1024^3
SHAPES = [("bert qkv", (128, 768), (768, 768)), ("bert ffn-in", (128, 768), (768, 3072)),
          ("bert ffn-out", (128, 3072), (3072, 768)), ("gpt2 qkv", (128, 768), (768, 2304)),
          ("vit 768", (197, 768), (768, 768)), ("vit ffn-out", (197, 3072), (3072, 768)),
          ("t5 512", (128, 512), (512, 512)), ("t5 ffn-in", (128, 512), (512, 2048)),
          ("t5 ffn-out", (128, 2048), (2048, 512)), ("whisper ffn-in", (1500, 384), (384, 1536)),
          ("dlrm top", (64, 512), (512, 256)), ("dlrm 100", (64, 100), (100, 512)),
          ("dlrm 256", (64, 256), (256, 64)), ("square", (1024, 1024), (1024, 1024))]


def _ort(x, w, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    y = np.empty((x.shape[0], w.shape[1]), np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, y.shape)],
                          [numpy_helper.from_array(w, "w")])
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    s = ort.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(),
                             so, providers=["CPUExecutionProvider"])
    io = s.io_binding()
    io.bind_cpu_input("x", x)
    io.bind_output("y", "cpu", 0, np.float32, y.shape, y.ctypes.data)
    return lambda y=y, x=x: s.run_with_iobinding(io)     # y, x: kept alive with the closure


def main(argv=None) -> int:
    from apollo_py.codegen.gemm import compile_gemm, matmul_desc
    from apollo_py.runtime.threadpool import ThreadPool
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=200, help="calls per contender (fewer for big shapes)")
    p.add_argument("--only", default="", help="comma-separated substrings of the labels")
    a = p.parse_args(argv)
    pool = ThreadPool(2)
    rng = np.random.default_rng(0)
    print(f"load {os.getloadavg()}")
    print("| shape | apollo-1 | apollo-2 | ort-1 | ort-2 | apollo-2 GFLOP/s | ort-2 GFLOP/s | a2/o2 | a2/a1 | tiles |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, xs, ws in SHAPES:
        if a.only and not any(s in label for s in a.only.split(",")):
            continue
        x = rng.standard_normal(xs).astype(np.float32)
        w = (rng.standard_normal(ws) / math.sqrt(ws[0])).astype(np.float32)
        want = x.astype(np.float64) @ w
        d = replace(matmul_desc("mm", xs, ws, want.shape, "y", outputs=("y",), out_dtypes=("float32",)), b_const=True)
        g1, g2 = compile_gemm(d, 1), compile_gemm(d, 2)
        o1, o2 = np.empty(want.shape, np.float32), np.empty(want.shape, np.float32)
        fns = {"apollo-1": lambda: g1.run(None, x, w, [], [o1]), "apollo-2": lambda: g2.run(pool, x, w, [], [o2]),
               "ort-1": _ort(x, w, 1), "ort-2": _ort(x, w, 2)}
        for f in fns.values():
            f()
        for o in (o1, o2):
            np.testing.assert_allclose(o, want, rtol=1e-4, atol=1e-4 * math.sqrt(xs[-1]))
        flops = 2 * want.size * xs[-1]
        n = max(10, min(a.calls, int(2e10 / flops)))
        ts: dict = {k: [] for k in fns}
        for _ in range(n):
            for k, f in fns.items():
                t0 = time.perf_counter()
                f()
                ts[k].append(time.perf_counter() - t0)
        p10 = {k: sorted(v)[len(v) // 10] for k, v in ts.items()}
        med = {k: statistics.median(v) for k, v in ts.items()}
        cells = [f"{p10[k] * 1e3:.3f} ({med[k] * 1e3:.3f})" for k in fns]
        print(f"| {label} {xs}@{ws} | " + " | ".join(cells) +
              f" | {flops / p10['apollo-2'] / 1e9:.0f} | {flops / p10['ort-2'] / 1e9:.0f} | "
              f"{p10['apollo-2'] / p10['ort-2']:.2f} | {p10['apollo-2'] / p10['apollo-1']:.2f} | {g2.layout.tiles} |",
              flush=True)
    print("ms per call: p10 (median)")
    print(f"load {os.getloadavg()}")
    pool.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
