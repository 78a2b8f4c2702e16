"""The zoo's matmul shapes: apollo_py against onnxruntime and numpy, interleaved.

    python benchmarks/gemm_shapes.py [--rounds 5] [--only bert,dlrm] [--markdown] [--contenders ...]

Each row is one ``MatMul`` as the zoo's full-size models run it (benchmarks/zoo: BERT-base /
DistilBERT / GPT-2 at 128 tokens, ViT-B/16 at 197, T5-small at 128, the Whisper-tiny encoder at
1500 frames, DLRM at batch 64; the attention products ``[B, H, S, d] @ [B, H, d, S]`` and
``[B, H, S, S] @ [B, H, S, d]``).  The same one-node ONNX model -- the right operand a constant
initializer for a linear layer (a weight: onnxruntime and apollo_py may pack it ahead), a graph
input for attention and DLRM's interaction -- is run by

* ``apollo``: ``apollo_py.jit(model)`` with the default ``Options`` (``gemm="auto"``);
* ``gen`` / ``blas``: apollo_py with ``gemm="generated"`` / ``gemm="blas"`` (the two sides of
  the auto rule; a batched right operand has no BLAS step, so ``blas`` runs numpy there);
* ``ort``: onnxruntime, 2 intra-op threads, spinning off, all graph optimisations;
* ``numpy``: ``x @ w`` (numpy's BLAS as configured, here OpenBLAS with its own threads).

Contenders run interleaved round-robin in one process after a warm-up; each sample repeats a
call for ``--sample-ms`` after a pause (OpenBLAS's threads spin after a call and would slow
the next contender on a 2-core box).  The table gives median ms per contender and the median
of the per-round ratios apollo / ort and apollo / best(ort, numpy), and the geometric means.
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

#: (model family, x shape, w shape, w is a constant weight)
SHAPES = [
    ("bert", (128, 768), (768, 768), True),
    ("bert", (128, 768), (768, 3072), True),
    ("bert", (128, 3072), (3072, 768), True),
    ("bert", (1, 12, 128, 64), (1, 12, 64, 128), False),
    ("bert", (1, 12, 128, 128), (1, 12, 128, 64), False),
    ("gpt2", (128, 768), (768, 2304), True),
    ("vit", (197, 768), (768, 768), True),
    ("vit", (197, 3072), (3072, 768), True),
    ("vit", (1, 12, 197, 64), (1, 12, 64, 197), False),
    ("vit", (1, 12, 197, 197), (1, 12, 197, 64), False),
    ("t5", (128, 512), (512, 512), True),
    ("t5", (128, 512), (512, 2048), True),
    ("t5", (128, 2048), (2048, 512), True),
    ("t5", (1, 8, 128, 64), (1, 8, 64, 128), False),
    ("t5", (1, 8, 64, 64), (1, 8, 64, 64), False),
    ("whisper", (1500, 384), (384, 384), True),
    ("whisper", (1500, 384), (384, 1536), True),
    ("whisper", (1500, 1536), (1536, 384), True),
    ("whisper", (1, 6, 1500, 64), (1, 6, 64, 1500), False),
    ("whisper", (1, 6, 1500, 1500), (1, 6, 1500, 64), False),
    ("dlrm", (64, 13), (13, 512), True),
    ("dlrm", (64, 512), (512, 256), True),
    ("dlrm", (64, 256), (256, 64), True),
    ("dlrm", (64, 100), (100, 512), True),
    ("dlrm", (64, 256), (256, 1), True),
    ("dlrm", (64, 9, 64), (64, 64, 9), False),
]
CONTENDERS = ("apollo", "gen", "blas", "ort", "numpy")


def one_matmul(xs, ws, const: bool, seed: int = 0):
    """``(model bytes, feeds, w)``: an opset-18 model ``y = MatMul(x, w)``."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(xs).astype(np.float32)
    w = (rng.standard_normal(ws) / math.sqrt(ws[-2])).astype(np.float32)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(xs))]
    inits, feeds = [], {"x": x}
    if const:
        inits.append(numpy_helper.from_array(w, "w"))
    else:
        inputs.append(helper.make_tensor_value_info("w", TensorProto.FLOAT, list(ws)))
        feeds["w"] = w
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "mm", inputs,
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    return m.SerializeToString(), feeds, w


def _sample(fn, sample_s: float, settle_s: float) -> float:
    time.sleep(settle_s)
    fn()
    t0, n = time.perf_counter(), 0
    while True:
        fn()
        n += 1
        el = time.perf_counter() - t0
        if el >= sample_s:
            return el / n * 1e3


def contenders(model: bytes, feeds: dict, w, names, threads: int) -> dict:
    """name -> zero-argument callable, each checked against numpy (rtol 1e-4 of the max)."""
    import apollo_py as ap
    x = feeds["x"]
    ref = x.astype(np.float64) @ w.astype(np.float64)
    fns = {}
    for name in names:
        if name in ("apollo", "gen", "blas"):
            opts = ap.Options(num_threads=threads, gemm={"apollo": "auto", "gen": "generated", "blas": "blas"}[name])
            f = ap.jit(model, options=opts)
            out = np.empty(ref.shape, np.float32)
            args = tuple(feeds.values())
            fn = (lambda f=f, args=args, out=out: f(*args, out=out))
        elif name == "ort":
            from benchmarks.run import _ort_iobinding, _ort_session
            import onnxruntime as ort
            sess = _ort_session(model, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, threads)
            fn, bufs = _ort_iobinding(sess, feeds, [ref.astype(np.float32)])
            out = bufs[0]
        else:
            wv = w
            out = np.empty(ref.shape, np.float32)
            fn = (lambda x=x, wv=wv, out=out: np.matmul(x, wv, out=out))
        fn()
        got = out
        err = float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))
        if err > 1e-4:
            raise SystemExit(f"{name}: relative error {err:.2e} on {x.shape} @ {w.shape}")
        fns[name] = fn
    return fns


def main(argv=None) -> int:
    ap_ = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap_.add_argument("--rounds", type=int, default=5)
    ap_.add_argument("--sample-ms", type=float, default=40.0)
    ap_.add_argument("--settle-ms", type=float, default=100.0)
    ap_.add_argument("--threads", type=int, default=2)
    ap_.add_argument("--only", default="", help="comma-separated families (bert, gpt2, vit, t5, whisper, dlrm)")
    ap_.add_argument("--contenders", default=",".join(CONTENDERS))
    ap_.add_argument("--markdown", action="store_true")
    a = ap_.parse_args(argv)
    names = [c for c in a.contenders.split(",") if c]
    fams = set(a.only.split(",")) if a.only else None
    rows = []
    for fam, xs, ws, const in SHAPES:
        if fams and fam not in fams:
            continue
        model, feeds, w = one_matmul(xs, ws, const)
        fns = contenders(model, feeds, w, names, a.threads)
        times = {n: [] for n in fns}
        for _ in range(a.rounds):
            for n, fn in fns.items():
                times[n].append(_sample(fn, a.sample_ms / 1e3, a.settle_ms / 1e3))
        rows.append((fam, xs, ws, times))
        _print_row(rows[-1], names, a.markdown, header=len(rows) == 1)
    _print_geomeans(rows, a.markdown)
    print(f"load: {os.getloadavg()}")
    return 0


def _ratio(times, num, dens) -> float | None:
    if num not in times or not all(d in times for d in dens):
        return None
    return statistics.median(times[num][r] / min(times[d][r] for d in dens) for r in range(len(times[num])))


def _print_row(row, names, md: bool, header: bool) -> None:
    fam, xs, ws, times = row
    cols = [n for n in names if n in times]
    r_ort = _ratio(times, "apollo", ["ort"])
    r_best = _ratio(times, "apollo", ["ort", "numpy"])
    cells = [fam, f"{xs}@{ws}", *(f"{statistics.median(times[n]):.3f}" for n in cols),
             f"{r_ort:.2f}" if r_ort else "-", f"{r_best:.2f}" if r_best else "-"]
    if header:
        head = ["model", "shape", *(f"{n} ms" for n in cols), "apollo/ort", "apollo/best"]
        print("| " + " | ".join(head) + " |" if md else "  ".join(head))
        if md:
            print("|" + "---|" * len(head))
    print("| " + " | ".join(cells) + " |" if md else "  ".join(cells), flush=True)


def _print_geomeans(rows, md: bool) -> None:
    for label, dens in (("apollo/ort", ["ort"]), ("apollo/best(ort,numpy)", ["ort", "numpy"])):
        rs = [_ratio(t, "apollo", dens) for *_, t in rows]
        rs = [r for r in rs if r]
        if rs:
            g = math.exp(sum(math.log(r) for r in rs) / len(rs))
            print(f"geomean {label}: {g:.3f} over {len(rs)} shapes (max {max(rs):.2f})")


if __name__ == "__main__":
    raise SystemExit(main())
