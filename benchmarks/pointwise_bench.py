"""Dense 1x1 (pointwise) convs of zoo models, one node each: apollo_py against onnxruntime.

    python benchmarks/pointwise_bench.py [--models regnety_016 resnet50] [--threads 2] [--rounds 7]
                                         [--only SUBSTR ...] [--ab MODULE.FLAG] [--json PATH]

Every distinct dense (group 1) 1x1 Conv of each model (``<model>.torchscript.onnx`` in the zoo
directory, ``$APOLLO_PY_ZOO_DIR`` or ``~/.cache/apollo_py_zoo``) -- input shape after ONNX shape
inference, Cout, stride, whether it has a bias and which activation (Relu / SiLU = x*Sigmoid(x))
follows it in the model -- becomes a one-conv ONNX model (tests/conv/models.conv_model, random
weights).  Squeeze-excitation convs of a 1x1 image are left out (another kernel).  Each row:
apollo (``Options(num_threads=N)``) and onnxruntime (``intra_op_num_threads=N``) interleaved in
one process (benchmarks/zoo._time_interleaved, median of rounds), the ratio apollo / ort, both
GFLOP/s, how many times the model has that conv, the step kind apollo chose, and the time
weighted by the count (the model's share).  ``--ab`` as conv_bench.py: also the same conv with
the module switch off ("old").
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def pointwise_shapes(path: str) -> dict:
    """Distinct dense 1x1 convs of an ONNX model: key -> dict(x, w, strides, act, count)."""
    import onnx
    from onnx import numpy_helper, shape_inference
    m = shape_inference.infer_shapes(onnx.load(path))
    g = m.graph
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in list(g.value_info) + list(g.input) + list(g.output)}
    inits = {i.name: numpy_helper.to_array(i).shape for i in g.initializer}
    consumers: dict = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    out: dict = {}
    for n in g.node:
        if n.op_type != "Conv" or n.input[1] not in inits:
            continue
        w = inits[n.input[1]]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        xs = [d or 1 for d in shapes.get(n.input[0], [])]  # a symbolic batch: batch 1
        if len(w) != 4 or tuple(w[2:]) != (1, 1) or attrs.get("group", 1) != 1 or len(xs) != 4:
            continue
        if xs[2] * xs[3] == 1 or any(attrs.get("pads", [0] * 4)):
            continue
        strides = tuple(attrs.get("strides", (1, 1)))
        nxt = consumers.get(n.output[0], [])
        act = None
        if len(nxt) == 1 and nxt[0].op_type == "Relu":
            act = "Relu"
        elif len(nxt) == 2 and {c.op_type for c in nxt} == {"Sigmoid", "Mul"}:
            act = "SiLU"
        key = f"1x1_{xs[1]}to{w[0]}_{xs[2]}" + (f"_s{strides[0]}" if strides != (1, 1) else "") + (
            f"_{act.lower()}" if act else "")
        rec = out.setdefault(key, dict(x=tuple(xs), w=tuple(int(v) for v in w), strides=strides, act=act,
                                       count=0))
        rec["count"] += 1
    return out


def flops(rec) -> float:
    n, cin, h, w = rec["x"]
    oh, ow = -(-h // rec["strides"][0]), -(-w // rec["strides"][1])
    return 2.0 * n * cin * rec["w"][0] * oh * ow


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=["regnety_016", "resnet50"])
    ap.add_argument("--zoo", default=os.environ.get("APOLLO_PY_ZOO_DIR", str(Path.home() / ".cache" / "apollo_py_zoo")))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--only", nargs="*", default=())
    ap.add_argument("--ab", default="")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE.parent / "tests" / "conv"))
    from conv_bench import _load, bench
    from models import conv_model
    cache = os.environ.get("APOLLO_PY_BENCH_CACHE") or tempfile.mkdtemp(prefix="pw_bench_")
    rng = np.random.default_rng(0)
    out: dict = {"load_before": _load(), "threads": args.threads, "rounds": args.rounds, "models": {}}
    for model in args.models:
        recs = pointwise_shapes(str(Path(args.zoo) / f"{model}.torchscript.onnx"))
        rows = []
        print(f"\n{model}: {len(recs)} distinct dense 1x1 convs, {sum(r['count'] for r in recs.values())} in all"
              f"  ({_load()})", flush=True)
        hdr = (f"  {'conv':<26} {'n':>2} {'apollo us':>9} {'ort us':>8} {'ratio':>6} {'ap GF/s':>7} {'ort GF/s':>8}"
               + (f" {'old us':>8} {'new/old':>7}" if args.ab else "") + "  kernel")
        print(hdr)
        for key, rec in recs.items():
            if args.only and not any(s in key for s in args.only):
                continue
            m = conv_model(rec["x"], rec["w"], strides=rec["strides"], act=rec["act"])
            x = rng.standard_normal(rec["x"]).astype(np.float32)
            r = bench(key, m, {"x": x}, args.threads, args.rounds, cache, args.ab)
            fl = flops(rec)
            r.update(count=rec["count"], gflops=fl / r["apollo_ms"] * 1e-6, ort_gflops=fl / r["ort_ms"] * 1e-6)
            rows.append(r)
            print(f"  {key:<26} {rec['count']:>2} {r['apollo_ms']*1e3:9.1f} {r['ort_ms']*1e3:8.1f} {r['ratio']:6.2f}"
                  f" {r['gflops']:7.0f} {r['ort_gflops']:8.0f}"
                  + (f" {r['old_ms']*1e3:8.1f} {r['new_old']:7.2f}" if args.ab else "")
                  + "  " + ", ".join(f"{k} {v}" for k, v in sorted(r["steps"].items())), flush=True)
        ap_ms = sum(r["apollo_ms"] * r["count"] for r in rows)
        ort_ms = sum(r["ort_ms"] * r["count"] for r in rows)
        line = f"  weighted by count: apollo {ap_ms:.2f} ms, ort {ort_ms:.2f} ms, ratio {ap_ms / max(ort_ms, 1e-9):.2f}"
        if args.ab:
            old = sum(r["old_ms"] * r["count"] for r in rows)
            line += f", old {old:.2f} ms, new/old {ap_ms / max(old, 1e-9):.2f}"
        print(line + f"  ({_load()})")
        out["models"][model] = rows
    out["load_after"] = _load()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
