"""Batch-1 conv path: apollo_py against onnxruntime, per conv shape and per whole model.

    python benchmarks/conv_bench.py [--threads 2] [--rounds 7] [--shapes-only | --models-only]
                                    [--zoo DIR] [--only SUBSTR ...] [--json PATH] [--ab MODULE.FLAG]

Shapes: single convs (dense 3x3 / 1x1 / 7x7 stem, strided, depthwise 3x3 / 5x5 / 7x7, grouped,
the squeeze-excitation 1x1 conv of a 1x1 image), each with BatchNormalization and an activation
after it, as ONNX models built here; squeeze-excitation block tails (``SE_BLOCKS``); then the
other conv-model steps (``EXTRA``: ResNet's stem max pool with its bias + ReLU, an average pool,
U-Net's 2x2 / stride 2 ConvTranspose, Whisper's two Conv1d).  Models: a ResNet-18-like network
built here (Conv + BatchNormalization + Relu, basic blocks, max pool, global average pool, Gemm;
1x3x224x224) and ResNet-50, MobileNetV3-large, EfficientNet-B0, RegNetY-1.6GF, U-Net and
Whisper-tiny's encoder from the zoo directory (benchmarks/zoo/export.py; default
``$APOLLO_PY_ZOO_DIR`` or ``~/.cache/apollo_py_zoo``) when present.

``--ab MODULE.FLAG`` (e.g. ``conv_cvec.ENABLED``, a switch of ``apollo_py.codegen.MODULE``) also
compiles every case with that switch off and times it in the same rounds ("old" column, and the
median per-round ratio new / old).

Each row: apollo_py (``Options(num_threads=N)``) and onnxruntime (all graph optimisations,
``intra_op_num_threads=N``, no spinning -- benchmarks/run.py's session) in one process,
interleaved in blocks of calls, median of ``--rounds`` rounds; the ratio is apollo / ort
(< 1: apollo faster), and max|Δ|/max|ref| against onnxruntime.  The load average is printed
with every table: on a shared machine only ratios taken in one interleaved run mean anything.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# name -> (x shape, w shape, strides, pads, group, activation)
SHAPES = {
    "stem7x7_s2_64": ((1, 3, 224, 224), (64, 3, 7, 7), (2, 2), (3, 3, 3, 3), 1, "Relu"),
    "3x3_64_56": ((1, 64, 56, 56), (64, 64, 3, 3), (1, 1), (1, 1, 1, 1), 1, "Relu"),
    "3x3_128_s2": ((1, 64, 56, 56), (128, 64, 3, 3), (2, 2), (1, 1, 1, 1), 1, "Relu"),
    "3x3_256_14": ((1, 256, 14, 14), (256, 256, 3, 3), (1, 1), (1, 1, 1, 1), 1, "Relu"),
    "1x1_256to64_56": ((1, 256, 56, 56), (64, 256, 1, 1), (1, 1), (0, 0, 0, 0), 1, "Relu"),
    "1x1_960to160_7": ((1, 960, 7, 7), (160, 960, 1, 1), (1, 1), (0, 0, 0, 0), 1, None),
    "dw3_144_56": ((1, 144, 56, 56), (144, 1, 3, 3), (1, 1), (1, 1, 1, 1), 144, "Clip6"),
    "dw3_s2_96_112": ((1, 96, 112, 112), (96, 1, 3, 3), (2, 2), (1, 1, 1, 1), 96, "HardSwish"),
    "dw5_s2_240_28": ((1, 240, 28, 28), (240, 1, 5, 5), (2, 2), (2, 2, 2, 2), 240, "SiLU"),
    "dw7_96_56": ((1, 96, 56, 56), (96, 1, 7, 7), (1, 1), (3, 3, 3, 3), 96, None),
    # MobileNetV3-large / EfficientNet-B0's other depthwise shapes
    "dw3_16_112": ((1, 16, 112, 112), (16, 1, 3, 3), (1, 1), (1, 1, 1, 1), 16, "Relu"),
    "dw3_32_112": ((1, 32, 112, 112), (32, 1, 3, 3), (1, 1), (1, 1, 1, 1), 32, "SiLU"),
    "dw3_s2_64_112": ((1, 64, 112, 112), (64, 1, 3, 3), (2, 2), (1, 1, 1, 1), 64, "Relu"),
    "dw3_72_56": ((1, 72, 56, 56), (72, 1, 3, 3), (1, 1), (1, 1, 1, 1), 72, "Relu"),
    "dw5_s2_72_56": ((1, 72, 56, 56), (72, 1, 5, 5), (2, 2), (2, 2, 2, 2), 72, "Relu"),
    "dw3_672_14": ((1, 672, 14, 14), (672, 1, 3, 3), (1, 1), (1, 1, 1, 1), 672, "HardSwish"),
    "dw5_960_7": ((1, 960, 7, 7), (960, 1, 5, 5), (1, 1), (2, 2, 2, 2), 960, "HardSwish"),
    "grouped24_3x3_48_56": ((1, 48, 56, 56), (48, 24, 3, 3), (1, 1), (1, 1, 1, 1), 2, "Relu"),
    # RegNetY-1.6GF's grouped 3x3 convs (24 channels per group, codegen/conv_group.py)
    "grouped24_s2_48_112": ((1, 48, 112, 112), (48, 24, 3, 3), (2, 2), (1, 1, 1, 1), 2, "Relu"),
    "grouped24_120_28": ((1, 120, 28, 28), (120, 24, 3, 3), (1, 1), (1, 1, 1, 1), 5, "Relu"),
    "grouped24_s2_120_56": ((1, 120, 56, 56), (120, 24, 3, 3), (2, 2), (1, 1, 1, 1), 5, "Relu"),
    "grouped24_336_14": ((1, 336, 14, 14), (336, 24, 3, 3), (1, 1), (1, 1, 1, 1), 14, "Relu"),
    "grouped24_s2_336_28": ((1, 336, 28, 28), (336, 24, 3, 3), (2, 2), (1, 1, 1, 1), 14, "Relu"),
    "grouped24_888_7": ((1, 888, 7, 7), (888, 24, 3, 3), (1, 1), (1, 1, 1, 1), 37, "Relu"),
    "grouped24_s2_888_14": ((1, 888, 14, 14), (888, 24, 3, 3), (2, 2), (1, 1, 1, 1), 37, "Relu"),
    # ResNeXt-50's 32x4d groups (stage 1, 4 -> 4 channels x 32 groups is depthwise-like; stage 3 8)
    "grouped8_3x3_256_28": ((1, 256, 28, 28), (256, 8, 3, 3), (1, 1), (1, 1, 1, 1), 32, "Relu"),
    "grouped16_3x3_512_14": ((1, 512, 14, 14), (512, 16, 3, 3), (1, 1), (1, 1, 1, 1), 32, "Relu"),
    "grouped64_3x3_256_14": ((1, 256, 14, 14), (256, 64, 3, 3), (1, 1), (1, 1, 1, 1), 4, "Relu"),
    # stems: Cin = 3, 3x3 stride 2 (MobileNetV3 16, EfficientNet / RegNetY 32 channels), U-Net's 3x3 s1
    "stem3x3_s2_16": ((1, 3, 224, 224), (16, 3, 3, 3), (2, 2), (1, 1, 1, 1), 1, "HardSwish"),
    "stem3x3_s2_32": ((1, 3, 224, 224), (32, 3, 3, 3), (2, 2), (1, 1, 1, 1), 1, "SiLU"),
    "stem3x3_s1_64_128": ((1, 3, 128, 128), (64, 3, 3, 3), (1, 1), (1, 1, 1, 1), 1, "Relu"),
    "se_960to240": ((1, 960, 1, 1), (240, 960, 1, 1), (1, 1), (0, 0, 0, 0), 1, "Relu"),
    # small output planes (codegen/conv_cvec.py): ResNet-50's stages 3-4, MobileNetV3 / EfficientNet /
    # RegNetY's 1x1 convs at 14x14 and 7x7
    "3x3_512_7": ((1, 512, 7, 7), (512, 512, 3, 3), (1, 1), (1, 1, 1, 1), 1, "Relu"),
    "3x3_512_s2_14": ((1, 512, 14, 14), (512, 512, 3, 3), (2, 2), (1, 1, 1, 1), 1, "Relu"),
    "1x1_2048to512_7": ((1, 2048, 7, 7), (512, 2048, 1, 1), (1, 1), (0, 0, 0, 0), 1, "Relu"),
    "1x1_512to2048_7": ((1, 512, 7, 7), (2048, 512, 1, 1), (1, 1), (0, 0, 0, 0), 1, None),
    "1x1_s2_1024to2048_14": ((1, 1024, 14, 14), (2048, 1024, 1, 1), (2, 2), (0, 0, 0, 0), 1, None),
    "1x1_1024to256_14": ((1, 1024, 14, 14), (256, 1024, 1, 1), (1, 1), (0, 0, 0, 0), 1, "Relu"),
    "1x1_672to112_14": ((1, 672, 14, 14), (112, 672, 1, 1), (1, 1), (0, 0, 0, 0), 1, None),
    "1x1_160to960_7": ((1, 160, 7, 7), (960, 160, 1, 1), (1, 1), (0, 0, 0, 0), 1, "HardSwish"),
    "1x1_888_7": ((1, 888, 7, 7), (888, 888, 1, 1), (1, 1), (0, 0, 0, 0), 1, "Relu"),
    "1x1_336_14": ((1, 336, 14, 14), (336, 336, 1, 1), (1, 1), (0, 0, 0, 0), 1, "Relu"),
}

# squeeze-excitation tails of mobile blocks (tests/conv/models.py se_block_model): depthwise conv +
# activation + SE (pool, FC1, FC2, gate, excitation) -- name -> se_block_model keyword arguments
SE_BLOCKS = {
    "se_effnet_dw5_240_28": dict(x_shape=(1, 240, 28, 28), k=5, mean="SumDiv"),
    "se_effnet_dw3_480_14": dict(x_shape=(1, 480, 14, 14), k=3, mean="SumDiv"),
    "se_mnv3_dw5_120_28": dict(x_shape=(1, 120, 28, 28), k=5, act="Relu", gate="HardSigmoid"),
    "se_mnv3_dw5_s2_672_14": dict(x_shape=(1, 672, 14, 14), k=5, stride=2, act="HardSwish", gate="HardSigmoid"),
}

# name -> (builder in tests/conv/models.py, input shape, arguments): the non-GEMM conv-model steps
EXTRA = {
    "maxpool_stem_bias_relu": ("pool_model", (1, 64, 112, 112),
                               ("MaxPool", True, False), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),
    "avgpool_3x3_s1_256_14": ("pool_model", (1, 256, 14, 14),
                              ("AveragePool", False, False), dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])),
    "convT_unet_2x2_s2_128": ("convt_model", (1, 128, 32, 32), ((128, 64, 2, 2),), dict(strides=[2, 2])),
    "conv1d_whisper_80to384": ("conv_model", (1, 80, 3000), ((384, 80, 3),),
                               dict(strides=(1,), pads=(1, 1), dilations=(1,))),
    "conv1d_whisper_s2_384": ("conv_model", (1, 384, 3000), ((384, 384, 3),),
                              dict(strides=(2,), pads=(1, 1), dilations=(1,))),
}

ZOO_MODELS = ("resnet50.dynamo.onnx", "mobilenetv3_large.dynamo.onnx", "efficientnet_b0.dynamo.onnx",
              "regnety_016.dynamo.onnx", "unet.dynamo.onnx", "whisper_tiny_encoder.dynamo.onnx")


def _load() -> str:
    try:
        return "load %.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        return "load ?"


def resnet18_like(seed: int = 0):
    """A ResNet-18-shaped ONNX model (random weights): Conv + BatchNormalization + Relu."""
    from onnx import TensorProto, helper, numpy_helper
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    count = [0]

    def fresh(p):
        count[0] += 1
        return f"{p}{count[0]}"

    def const(arr, p):
        name = fresh(p)
        inits.append(numpy_helper.from_array(np.asarray(arr, np.float32), name))
        return name

    def conv_bn(x, cin, cout, k, s, relu=True):
        w = const(rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k)), "w")
        c = fresh("c")
        nodes.append(helper.make_node("Conv", [x, w], [c], strides=[s, s], pads=[k // 2] * 4))
        bn = fresh("bn")
        nodes.append(helper.make_node("BatchNormalization", [
            c, const(rng.uniform(0.5, 1.5, cout), "g"), const(rng.standard_normal(cout) * 0.1, "b"),
            const(rng.standard_normal(cout) * 0.1, "m"), const(rng.uniform(0.5, 2, cout), "v")], [bn]))
        if not relu:
            return bn
        r = fresh("r")
        nodes.append(helper.make_node("Relu", [bn], [r]))
        return r

    y = conv_bn("x", 3, 64, 7, 2)
    p = fresh("p")
    nodes.append(helper.make_node("MaxPool", [y], [p], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    y, cin = p, 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        for blk in range(2):
            s = stride if blk == 0 else 1
            h = conv_bn(y, cin, cout, 3, s)
            h = conv_bn(h, cout, cout, 3, 1, relu=False)
            sc = y if (s == 1 and cin == cout) else conv_bn(y, cin, cout, 1, s, relu=False)
            a, r = fresh("a"), fresh("r")
            nodes += [helper.make_node("Add", [h, sc], [a]), helper.make_node("Relu", [a], [r])]
            y, cin = r, cout
    g, f = fresh("gap"), fresh("fl")
    nodes += [helper.make_node("GlobalAveragePool", [y], [g]), helper.make_node("Flatten", [g], [f])]
    fc_w, fc_b = const(rng.standard_normal((1000, 512)) * 0.03, "fw"), const(np.zeros(1000), "fb")
    nodes.append(helper.make_node("Gemm", [f, fc_w, fc_b], ["logits"], transB=1))
    graph = helper.make_graph(nodes, "resnet18_like",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 224, 224])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1000])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _shape_model(spec):
    sys.path.insert(0, str(HERE.parent / "tests" / "conv"))
    from models import conv_model
    xs, ws, st, pd, group, act = spec
    return conv_model(xs, ws, strides=st, pads=pd, group=group, bn=True, act=act)


def _extra_model(spec):
    sys.path.insert(0, str(HERE.parent / "tests" / "conv"))
    import models
    builder, xs, args, kw = spec
    return getattr(models, builder)(xs, *args, **kw)


def _switched_off(ab: str):
    """A context in which the module switch ``ab`` ("MODULE.FLAG" of apollo_py.codegen) is False."""
    import contextlib
    import importlib

    @contextlib.contextmanager
    def ctx():
        mod_name, flag = ab.rsplit(".", 1)
        mod = importlib.import_module(f"apollo_py.codegen.{mod_name}")
        was = getattr(mod, flag)
        setattr(mod, flag, False)
        try:
            yield
        finally:
            setattr(mod, flag, was)
    return ctx()


def bench(name: str, model, feeds: dict, threads: int, rounds: int, cache_dir: str, ab: str = "") -> dict:
    import apollo_py
    from apollo_py import Options
    from run import _ort_session
    from zoo import _rel_err, _time_interleaved
    import onnxruntime as ort
    data = model if isinstance(model, (str, bytes)) else model.SerializeToString()
    t0 = time.perf_counter()
    f = apollo_py.jit(model, options=Options(num_threads=threads, cache_dir=cache_dir))
    got = f(**feeds)
    compile_s = time.perf_counter() - t0
    s = _ort_session(data, ort.GraphOptimizationLevel.ORT_ENABLE_ALL, threads)
    want = s.run(None, feeds)
    fns = {"apollo": lambda: f(**feeds), "ort": lambda: s.run(None, feeds)}
    if ab:      # the same model with the switch off: its own cache directory (the plans differ)
        with _switched_off(ab):
            f_old = apollo_py.jit(model, options=Options(num_threads=threads, cache_dir=cache_dir + "_old"))
            f_old(**feeds)
        fns["old"] = lambda: f_old(**feeds)
    ms = _time_interleaved(fns, rounds)
    err = _rel_err(got if isinstance(got, (list, tuple)) else [got], want)
    kinds: dict = {}
    for k in f.plan.kernels:
        key = ("direct conv" if "direct conv" in k.reason else "implicit GEMM" if "implicit-GEMM" in k.reason
               else "channel-vector conv" if "channel-vector conv" in k.reason
               else "row-reading conv" if "row-reading conv" in k.reason
               else "blas" if k.blas is not None
               else "pool kernel" if k.fused is not None and k.fused.strategy == "pool"
               else "kernel" if k.fused is not None else "numpy")
        kinds[key] = kinds.get(key, 0) + 1
    row = {"name": name, "apollo_ms": ms["apollo"], "ort_ms": ms["ort"], "ratio": ms["apollo"] / ms["ort"],
           "rel_err": err, "compile_s": compile_s, "steps": kinds}
    if ab:
        row.update(old_ms=ms["old"], new_old=ms["apollo"] / ms["old"])
    return row


def _print(rows, title):
    print(f"\n{title}  ({_load()})")
    ab = any("old_ms" in r for r in rows)
    print(f"  {'case':<24} {'apollo ms':>10} {'ort ms':>9} {'ratio':>6} {'rel err':>8}"
          + (f" {'old ms':>9} {'new/old':>7}" if ab else "") + "  steps")
    for r in rows:
        print(f"  {r['name']:<24} {r['apollo_ms']:10.3f} {r['ort_ms']:9.3f} {r['ratio']:6.2f} {r['rel_err']:8.1e}"
              + (f" {r['old_ms']:9.3f} {r['new_old']:7.2f}" if ab else "") + "  "
              + ", ".join(f"{k} {v}" for k, v in sorted(r["steps"].items())))
    if rows:
        geo = float(np.exp(np.mean([np.log(r["ratio"]) for r in rows])))
        print(f"  geomean apollo/ort {geo:.2f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes-only", action="store_true")
    ap.add_argument("--models-only", action="store_true")
    ap.add_argument("--zoo", default=os.environ.get("APOLLO_PY_ZOO_DIR", str(Path.home() / ".cache" / "apollo_py_zoo")))
    ap.add_argument("--only", nargs="*", default=())
    ap.add_argument("--json", default="")
    ap.add_argument("--ab", default="", help="MODULE.FLAG of apollo_py.codegen: also time with it off")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    cache = tempfile.mkdtemp(prefix="conv_bench_")
    want = (lambda n: not args.only or any(s in n for s in args.only))
    out: dict = {"load_before": _load(), "threads": args.threads, "rounds": args.rounds}
    if not args.models_only:
        rows = []
        for name, spec in SHAPES.items():
            if want(name):
                x = rng.standard_normal(spec[0]).astype(np.float32)
                rows.append(bench(name, _shape_model(spec), {"x": x}, args.threads, args.rounds, cache, args.ab))
        sys.path.insert(0, str(HERE.parent / "tests" / "conv"))
        from models import se_block_model
        for name, kw in SE_BLOCKS.items():
            if want(name):
                x = rng.standard_normal(kw["x_shape"]).astype(np.float32)
                rows.append(bench(name, se_block_model(**kw), {"x": x}, args.threads, args.rounds, cache, args.ab))
        for name, spec in EXTRA.items():
            if want(name):
                x = rng.standard_normal(spec[1]).astype(np.float32)
                rows.append(bench(name, _extra_model(spec), {"x": x}, args.threads, args.rounds, cache, args.ab))
        _print(rows, f"single convs + BatchNorm + activation, SE blocks, other conv steps, batch 1, {args.threads} threads, "
                     f"median of {args.rounds} interleaved rounds")
        out["shapes"] = rows
    if not args.shapes_only:
        rows = []
        if want("resnet18_like"):
            x = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
            rows.append(bench("resnet18_like", resnet18_like(), {"x": x}, args.threads, args.rounds, cache, args.ab))
        zoo = Path(args.zoo)
        manifest = json.loads((zoo / "manifest.json").read_text()) if (zoo / "manifest.json").exists() else {}
        from zoo import _inputs
        for fn in ZOO_MODELS:
            if fn in manifest and (zoo / fn).exists() and want(fn):
                rows.append(bench(fn.replace(".onnx", ""), str(zoo / fn), _inputs(manifest[fn]), args.threads,
                                  args.rounds, cache, args.ab))
        _print(rows, f"whole models, batch 1, {args.threads} threads, median of {args.rounds} interleaved rounds")
        out["models"] = rows
    out["load_after"] = _load()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
