"""The zoo's attention blocks: fused attention against the three-step path and onnxruntime.

    python benchmarks/attention_shapes.py [--rounds 7] [--only bert,whisper] [--markdown]

Each row is one attention as the zoo's full-size models run it (BERT-base / DistilBERT at 128
tokens, ViT-B/16 at 197, T5-small's encoder at 128 and decoder at 64, GPT-2 at 128 with a
causal mask, the Whisper-tiny encoder at 1500 frames, Swin-T's first stage: 64 windows of 49 tokens) in the exporters' spelling: heads
``[B, S, H, d]`` transposed by ``Transpose`` nodes, scores scaled and masked (T5: a position
bias, no scale; GPT-2: ``where(causal, s, -inf)``), ``Softmax``, ``P @ V``, the context
transposed back.  The same ONNX model is run by

* ``fused``: ``apollo_py.jit`` with ``Options(attention="fused")`` (one generated kernel);
* ``unfused``: ``Options(attention="unfused")`` (two generated GEMMs and a stitched softmax);
* ``ort``: onnxruntime, 2 intra-op threads, spinning off, all graph optimisations.

Contenders run interleaved round-robin in one process after a warm-up; each sample repeats a
call for ``--sample-ms``.  The table gives median ms and the medians of the per-round ratios.
Print ``uptime`` next to the numbers you report: the box is shared.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: (name, batch, heads, queries, keys, head dim, spelling)
SHAPES = [
    ("bert", 1, 12, 128, 128, 64, "mask"),
    ("vit", 1, 12, 197, 197, 64, "scale"),
    ("t5-enc", 1, 8, 128, 128, 64, "bias"),
    ("t5-dec", 1, 8, 64, 64, 64, "bias"),
    ("gpt2", 1, 12, 128, 128, 64, "causal"),
    ("whisper", 1, 6, 1500, 1500, 64, "scale"),
    ("swin", 64, 3, 49, 49, 32, "bias"),      # Swin-T stage 1: 64 windows of 7 x 7, bias [1, H, 49, 49]
]


def attention_model(b, h, m, n, d, spelling):
    """The ONNX model of one attention block (see the module docstring)."""
    from onnx import TensorProto, helper, numpy_helper
    N = helper.make_node
    nodes = [N("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]), N("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
             N("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]), N("MatMul", ["q", "kt"], ["s0"])]
    inits = [numpy_helper.from_array(np.array(d ** -0.5, np.float32), "sc")]
    ins = [("q1", [b, m, h, d]), ("k1", [b, n, h, d]), ("v1", [b, n, h, d])]
    if spelling == "mask":
        nodes += [N("Mul", ["s0", "sc"], ["s1"]), N("Add", ["s1", "mask"], ["s"])]
        ins.append(("mask", [b, 1, 1, n]))
    elif spelling == "bias":
        nodes += [N("Add", ["s0", "bias"], ["s"])]
        ins.append(("bias", [1, h, m, n]))
    elif spelling == "causal":
        tril = np.tril(np.ones((m, n), bool), k=n - m).reshape(1, 1, m, n)
        inits += [numpy_helper.from_array(tril, "tril"), numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf")]
        nodes += [N("Mul", ["s0", "sc"], ["s1"]), N("Where", ["tril", "s1", "ninf"], ["s"])]
    else:
        nodes += [N("Mul", ["s0", "sc"], ["s"])]
    nodes += [N("Softmax", ["s"], ["p"], axis=-1), N("MatMul", ["p", "v"], ["c"]),
              N("Transpose", ["c"], ["y"], perm=[0, 2, 1, 3])]
    g = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(k, TensorProto.FLOAT, s) for k, s in ins],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(s).astype(np.float32) for k, s in ins}
    if "mask" in feeds:
        feeds["mask"] = np.where(np.arange(n) < n - 5, 0, -1e4).astype(np.float32).reshape(b, 1, 1, n)
    return model, feeds


def _sample(fn, sample_ms: float) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        t = time.perf_counter() - t0
        if t * 1e3 >= sample_ms:
            return t / n * 1e3


def main(argv=None) -> int:
    ap_ = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap_.add_argument("--rounds", type=int, default=7)
    ap_.add_argument("--sample-ms", type=float, default=30.0)
    ap_.add_argument("--only", default="")
    ap_.add_argument("--markdown", action="store_true")
    args = ap_.parse_args(argv)
    import onnxruntime as ort

    import apollo_py
    rows = []
    for name, b, h, m, n, d, spelling in SHAPES:
        if args.only and name.split("-")[0] not in args.only.split(","):
            continue
        model, feeds = attention_model(b, h, m, n, d, spelling)
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sess = ort.InferenceSession(model.SerializeToString(), so)
        fused = apollo_py.jit(model, options=apollo_py.Options(attention="fused"))
        unfused = apollo_py.jit(model, options=apollo_py.Options(attention="unfused"))
        want = sess.run(None, feeds)[0]
        for f in (fused, unfused):
            np.testing.assert_allclose(np.asarray(f(**feeds)), want, rtol=1e-4, atol=1e-5)
        fns = {"fused": lambda: fused(**feeds), "unfused": lambda: unfused(**feeds),
               "ort": lambda: sess.run(None, feeds)}
        res = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                res[k].append(_sample(fn, args.sample_ms))
        med = {k: statistics.median(v) for k, v in res.items()}
        ratio = {k: statistics.median(a / c for a, c in zip(res["fused"], res[k])) for k in ("unfused", "ort")}
        rows.append((name, (b, h, m, n, d), spelling, med, ratio))
        print(f"{name} {(b, h, m, n, d)} {spelling}: fused {med['fused']:.3f} ms, unfused {med['unfused']:.3f}, "
              f"ort {med['ort']:.3f}; fused/unfused {ratio['unfused']:.2f}, fused/ort {ratio['ort']:.2f}",
              flush=True)
    if args.markdown:
        print("\n| block | B, H, M, N, d | spelling | fused ms | unfused ms | ort ms | fused/unfused | fused/ort |")
        print("|---|---|---|---|---|---|---|---|")
        for name, shp, sp, med, ratio in rows:
            print(f"| {name} | {shp} | {sp} | {med['fused']:.3f} | {med['unfused']:.3f} | {med['ort']:.3f} | "
                  f"{ratio['unfused']:.2f} | {ratio['ort']:.2f} |")
    for k in ("unfused", "ort"):
        if rows:
            g = math.exp(statistics.mean(math.log(r[4][k]) for r in rows))
            print(f"geomean fused/{k}: {g:.3f} over {len(rows)} blocks")
    print("load average:", " ".join(f"{x:.1f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
