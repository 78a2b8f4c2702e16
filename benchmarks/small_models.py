"""Small models: recurrent ops and DLRM, apollo_py against onnxruntime (docs/design/small_models.md).

Models: single LSTM / GRU nodes (hidden 256, input 256, T 50, batch 4, torch's weight scale
1/sqrt(hidden): a larger scale makes the recurrence chaotic and any two implementations drift
apart), a bidirectional LSTM, a tiny LSTM (hidden 16, T 10, batch 2: per-call overhead), and the
zoo's full-size ``lstm_gru`` and ``dlrm`` exports where ``~/.cache/apollo_py_zoo`` has them
(``make zoo``).  Every contender runs in this process, interleaved block by block; the median
over rounds of ms per call is reported with the load average (the machine may be shared).
onnxruntime: all graph optimisations, 2 intra-op threads, no spinning; apollo: 2 threads.

    python benchmarks/small_models.py [--rounds 9]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

ZOO = os.path.expanduser("~/.cache/apollo_py_zoo")
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def recurrent_model(op: str, hid: int, inp: int, t_len: int, batch: int, direction="forward", seed=0):
    """One ``op`` node (constant W, R, B of scale 1/sqrt(hid)) and its feeds."""
    from onnx import TensorProto, helper as h, numpy_helper
    rng = np.random.default_rng(seed)
    nd, g = 2 if direction == "bidirectional" else 1, GATES[op]
    s = 1 / np.sqrt(hid)
    inits = [numpy_helper.from_array(rng.uniform(-s, s, shape).astype(np.float32), name)
             for name, shape in (("W", (nd, g * hid, inp)), ("R", (nd, g * hid, hid)), ("B", (nd, 2 * g * hid)))]
    outs = ["y", "yh"] + (["yc"] if op == "LSTM" else [])
    node = h.make_node(op, ["x", "W", "R", "B"], outs, hidden_size=hid, direction=direction)
    graph = h.make_graph([node], op.lower(), [h.make_tensor_value_info("x", TensorProto.FLOAT, [t_len, batch, inp])],
                         [h.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], initializer=inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    return model.SerializeToString(), {"x": rng.standard_normal((t_len, batch, inp)).astype(np.float32)}


def cases() -> list:
    out = [("LSTM H256 T50 B4", *recurrent_model("LSTM", 256, 256, 50, 4)),
           ("GRU H256 T50 B4", *recurrent_model("GRU", 256, 256, 50, 4)),
           ("LSTM bidirectional H256 T50 B4", *recurrent_model("LSTM", 256, 256, 50, 4, "bidirectional")),
           ("LSTM H16 T10 B2 (tiny)", *recurrent_model("LSTM", 16, 8, 10, 2))]
    rng = np.random.default_rng(0)
    for name in ("lstm_gru.torchscript.onnx", "lstm_gru.dynamo.onnx"):
        if os.path.exists(os.path.join(ZOO, name)):
            out.append((name, os.path.join(ZOO, name), {"x": rng.standard_normal((50, 4, 64)).astype(np.float32)}))
    for name in ("dlrm.torchscript.onnx", "dlrm.dynamo.onnx"):
        if os.path.exists(os.path.join(ZOO, name)):
            out.append((name, os.path.join(ZOO, name),
                        {"dense": rng.standard_normal((64, 13)).astype(np.float32),
                         "sparse": rng.integers(0, 99862, (64, 8)).astype(np.int64)}))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    import onnxruntime as ort

    import apollo_py
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 2
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    runs = []
    for name, model, feeds in cases():
        sess = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
        f = apollo_py.jit(model, options=apollo_py.Options(num_threads=2))
        args_ = [feeds[i.name] for i in sess.get_inputs()]
        got = f(*args_)
        got = got if isinstance(got, (list, tuple)) else [got]
        want = sess.run(None, feeds)
        err = max(float(np.max(np.abs(g - w)) / max(float(np.max(np.abs(w))), 1e-30)) for g, w in zip(got, want))
        calls = 200 if "tiny" in name else 5 if "H256" in name or "lstm" in name else 50
        runs.append((name, f, sess, feeds, args_, err, calls))

    def per_call(fn, n):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e3

    times = {r[0]: ([], []) for r in runs}
    loads = []
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        for name, f, sess, feeds, args_, err, calls in runs:
            times[name][0].append(per_call(lambda: f(*args_), calls))
            times[name][1].append(per_call(lambda: sess.run(None, feeds), calls))
    print(f"load average {min(loads):.1f}-{max(loads):.1f}; median of {args.rounds} interleaved blocks, ms per call")
    print("| model | apollo | onnxruntime | apollo / ort | max rel. diff |")
    print("|---|---|---|---|---|")
    for name, *_, err, _calls in runs:
        a, o = statistics.median(times[name][0]), statistics.median(times[name][1])
        print(f"| {name} | {a:.3f} | {o:.3f} | {a / o:.2f} | {err:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
