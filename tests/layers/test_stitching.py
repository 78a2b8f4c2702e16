"""Layer 2 stitching as exporters write the patterns, and concats absorbed into their producers'
kernel (docs/design/stitching.md): kernel and launch counts are pinned, and every result is
compared with onnxruntime (rtol 1e-4, atol 1e-5).

The ``stitch_models/*.onnx`` files are tiny torch modules exported by torch.onnx's TorchScript
(opset 17) and dynamo (opset 18) exporters (tools/export_stitch_models.py, torch 2.x; committed,
so no torch is needed here).  Before this change: logsumexp over a y / all / interleaved form 3
kernels, mean -> sqrt over a y or all form 2, a four-branch concat 4 kernels + a numpy concat.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

pytest.importorskip("onnxruntime")
sys.path.insert(0, str(Path(__file__).parent))
from layer_counts import compile_and_count  # noqa: E402

HERE = Path(__file__).resolve().parent / "stitch_models"


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    feeds = {}
    for i in model.graph.input:
        shape = [d.dim_value for d in i.type.tensor_type.shape.dim]
        if i.type.tensor_type.elem_type == T.BOOL:
            feeds[i.name] = rng.random(shape) < 0.3
        else:   # positive: mean -> sqrt needs it; others do not mind
            feeds[i.name] = (np.abs(rng.standard_normal(shape)) + 0.05).astype(np.float32)
    if "m" in feeds and feeds["m"].dtype == bool:
        feeds["m"][..., 0] = False      # no fully masked row (softmax of all -inf is nan)
    return feeds


def _counts(model: onnx.ModelProto, tmp_path, feeds=None):
    """(kernels, launches, numpy steps other than reshape views, plan) after checking the
    outputs against onnxruntime; random inputs unless ``feeds`` are given."""
    return compile_and_count(model, tmp_path, feeds or _feeds(model))


# file stem -> (kernels, launches); the same for both exporters
EXPORTED = {
    "logsumexp": (1, 1),
    "mean_sqrt": (1, 1),
    "rmsnorm_div": (1, 1),
    "rmsnorm_rsqrt": (1, 1),
    "rmsnorm_recip": (1, 1),
    "l2norm": (1, 1),
    "masked_softmax_where": (1, 1),
    "masked_softmax_add": (1, 1),
    # reshape [N, C, H, W] -> [N, G, C/G*H*W] -> InstanceNorm -> reshape back -> per-channel
    # affine: the region is refined to [N*G, C/G, H*W] (partition/refine_reshape.py), so the
    # mean / var / normalise / affine are one kernel (2 before: the affine across the reshape)
    "groupnorm": (1, 1),
    # four elementwise branches and the concat: one kernel writing each branch into its slice
    "four_branch": (1, 1),
}


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
@pytest.mark.parametrize("stem", sorted(EXPORTED))
def test_exported_patterns_pinned_counts(stem, exporter, tmp_path):
    model = onnx.load(HERE / f"{stem}.{exporter}.onnx")
    kernels, launches, copies, plan = _counts(model, tmp_path)
    assert (kernels, launches) == EXPORTED[stem], str(plan)
    assert copies == 0, str(plan)


def _model(nodes, shape, inits=(), extra_inputs=(), outputs=("y",)):
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", T.FLOAT, shape), *extra_inputs],
                     [h.make_tensor_value_info(o, T.FLOAT, None) for o in outputs], list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18)])


def _axes(*a):
    return h.make_tensor("axes", T.INT64, [len(a)], list(a))


# (shape, axes) -> kernels of ReduceLogSumExp (opened to reduce_max | abs eq where sub exp
# reduce_sum | log add) and of ReduceMean -> Sqrt; before: 3 and 2 everywhere but the x form
FORMS = [
    ((64, 256), (1,), 1, 1),        # x-reduce
    ((8, 16, 32), (0, 2), 1, 1),    # interleaved dims, transposed to an x-reduce
    ((64, 16384), (1,), 1, 1),      # a 64 KiB row: over L1, within the stitch scratch
    ((64, 256), (0,), 2, 1),        # y-reduce: only the row-space tail stitches
    ((64, 256), (0, 1), 2, 1),      # all-reduce: likewise
]


@pytest.mark.parametrize("shape,axes,lse,mean_sqrt", FORMS)
def test_reduce_forms_stitch(shape, axes, lse, mean_sqrt, tmp_path):
    m = _model([h.make_node("ReduceLogSumExp", ["x", "axes"], ["y"], keepdims=1)], shape, [_axes(*axes)])
    assert _counts(m, tmp_path)[0] == lse
    m = _model([h.make_node("ReduceMean", ["x", "axes"], ["m"], keepdims=0), h.make_node("Sqrt", ["m"], ["y"])],
               shape, [_axes(*axes)])
    assert _counts(m, tmp_path)[0] == mean_sqrt


def test_four_reduction_branches_concat_one_kernel(tmp_path):
    """benchmarks/workloads.py's four_branches: four row reductions (one a ReduceMean, whose
    div is its own micro-graph) concatenated: one kernel, the concat absorbed."""
    ins = [h.make_tensor_value_info(f"x{i}", T.FLOAT, (64, 1024)) for i in range(1, 4)]
    nodes = [h.make_node("Exp", ["x"], ["e0"]), h.make_node("ReduceSum", ["e0", "axes"], ["r0"], keepdims=1),
             h.make_node("Tanh", ["x1"], ["e1"]), h.make_node("ReduceMax", ["e1", "axes"], ["r1"], keepdims=1),
             h.make_node("Mul", ["x2", "x2"], ["e2"]), h.make_node("ReduceSum", ["e2", "axes"], ["r2"], keepdims=1),
             h.make_node("Abs", ["x3"], ["e3"]), h.make_node("ReduceMean", ["e3", "axes"], ["r3"], keepdims=1),
             h.make_node("Concat", ["r0", "r1", "r2", "r3"], ["y"], axis=1)]
    kernels, launches, copies, plan = _counts(_model(nodes, (64, 1024), [_axes(-1)], ins), tmp_path)
    assert (kernels, launches, copies) == (1, 1, 0), str(plan)


def test_concat_with_graph_input_and_shared_branch(tmp_path):
    """A concat input that is a graph input is copied into its slice by the same kernel; a
    branch value also read after the concat stays a kernel output; concat on axis 0."""
    ins = [h.make_tensor_value_info("z", T.FLOAT, (3, 16))]
    nodes = [h.make_node("Relu", ["x"], ["a"]), h.make_node("Tanh", ["x"], ["b"]),
             h.make_node("Concat", ["a", "z", "b", "a"], ["c"], axis=0),
             h.make_node("Sigmoid", ["c"], ["y"]), h.make_node("Neg", ["b"], ["w"])]
    model = _model(nodes, (5, 16), extra_inputs=ins, outputs=("y", "w"))
    feeds = {"x": np.random.default_rng(1).standard_normal((5, 16)).astype(np.float32),
             "z": np.random.default_rng(2).standard_normal((3, 16)).astype(np.float32)}
    kernels, launches, copies, plan = _counts(model, tmp_path, feeds)
    assert copies == 0 and "concat" in str(plan), str(plan)


def test_plan_shows_layer3_launch_groups(tmp_path):
    """Four independent kernels big enough for the pool (pinned cheap launches): one launch,
    shown as one entry of str(plan) with its four members."""
    shape = (1024, 1024)
    ops = ["Exp", "Tanh", "Sigmoid", "Abs"]
    nodes = [h.make_node(op, [f"x{i}"], [f"y{i}"]) for i, op in enumerate(ops)]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info(f"x{i}", T.FLOAT, shape) for i in range(4)],
                     [h.make_tensor_value_info(f"y{i}", T.FLOAT, None) for i in range(4)])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 18)])
    feeds = {f"x{i}": np.full(shape, 0.5 + i, np.float32) for i in range(4)}
    kernels, launches, copies, plan = _counts(model, tmp_path, feeds)
    assert (kernels, launches) == (4, 1)
    text = str(plan)
    assert "4 steps (4 generated kernels, 0 numpy steps, 1 kernel launch)" in text
    entry = [line for line in text.splitlines() if "launch of 4 independent kernels" in line]
    assert len(entry) == 1 and entry[0].strip().startswith("0") and "steps 0, 1, 2, 3" in entry[0]
    members = text.splitlines()[text.splitlines().index(entry[0]) + 1:][:4]
    assert all(line.startswith("      ") and "kernel" in line for line in members)
    assert [sorted(g) for g in json.loads(plan.to_json())["launches"]] == [[0, 1, 2, 3]]


def _ints(name, v):
    return h.make_tensor(name, T.INT64, [len(v)], list(v))


# name -> (nodes, shape, initializers, pinned steps: each a kernel's ops); before this change
# every slice / transpose / split was a numpy step (or a transpose copy kernel) between kernels
INDEX_MAPS = {
    "transpose_then_relu": ([h.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]), h.make_node("Relu", ["t"], ["y"])],
                            (4, 96, 80), [], [["transpose", "relu"]]),
    "exp_then_transpose": ([h.make_node("Exp", ["x"], ["e"]), h.make_node("Transpose", ["e"], ["y"], perm=[1, 0])],
                           (96, 80), [], [["exp", "transpose"]]),
    "strided_slice_sigmoid": ([h.make_node("Slice", ["x", "s0", "e0", "ax", "st"], ["t"]),
                               h.make_node("Sigmoid", ["t"], ["y"])], (16, 64),
                              [_ints("s0", [60]), _ints("e0", [3]), _ints("ax", [1]), _ints("st", [-2])],
                              [["slice", "sigmoid"]]),
    "split_then_add": ([h.make_node("Split", ["x"], ["p", "q"], axis=1, num_outputs=2), h.make_node("Add", ["p", "q"], ["y"])],
                       (16, 64), [], [["slice", "slice", "add"]]),
    "softmax_of_transpose": ([h.make_node("Transpose", ["x"], ["t"], perm=[1, 0]), h.make_node("Softmax", ["t"], ["y"], axis=-1)],
                             (64, 32), [], [["transpose", "reduce_max", "sub", "exp", "reduce_sum", "div"]]),
    # rotate_half of RoPE: cat(-x[..., 32:], x[..., :32]) -- the slices read through, the
    # concat written through, one kernel; the rotary product is the concat output's reader
    "rotate_half": ([h.make_node("Slice", ["x", "s0", "e0", "ax"], ["x1"]), h.make_node("Slice", ["x", "s1", "e1", "ax"], ["x2"]),
                     h.make_node("Neg", ["x2"], ["n2"]), h.make_node("Concat", ["n2", "x1"], ["r"], axis=-1),
                     h.make_node("Mul", ["r", "x"], ["y"])], (2, 8, 64),
                    [_ints("s0", [0]), _ints("e0", [32]), _ints("s1", [32]), _ints("e1", [64]), _ints("ax", [-1])],
                    [["slice", "slice", "neg", "concat"], ["mul"]]),
}


@pytest.mark.parametrize("name", sorted(INDEX_MAPS))
def test_slice_split_transpose_are_index_maps(name, tmp_path):
    nodes, shape, inits, steps = INDEX_MAPS[name]
    feeds = {"x": np.random.default_rng(3).standard_normal(shape).astype(np.float32)}
    kernels, launches, copies, plan = _counts(_model(nodes, shape, inits), tmp_path, feeds)
    assert copies == 0, str(plan)
    assert [sorted(n.op for n in k.fused.nodes if n.op != "constant") for k in plan.kernels] == \
        [sorted(s) for s in steps], str(plan)


def _f(name, v):
    return h.make_tensor(name, T.FLOAT, [], [v])


SPELLINGS = {
    "l2_sumsquare_sqrt_clip_div": [h.make_node("ReduceSumSquare", ["x", "axes"], ["s"], keepdims=1),
                                   h.make_node("Sqrt", ["s"], ["n"]), h.make_node("Clip", ["n", "eps"], ["c"]),
                                   h.make_node("Div", ["x", "c"], ["y"])],
    "l2_reducel2_max_div": [h.make_node("ReduceL2", ["x", "axes"], ["n"], keepdims=1),
                            h.make_node("Max", ["n", "eps"], ["c"]), h.make_node("Div", ["x", "c"], ["y"])],
    "rms_pow_mean_add_sqrt_div": [h.make_node("Pow", ["x", "two"], ["p"]),
                                  h.make_node("ReduceMean", ["p", "axes"], ["m"], keepdims=1),
                                  h.make_node("Add", ["m", "eps"], ["a"]), h.make_node("Sqrt", ["a"], ["s"]),
                                  h.make_node("Div", ["x", "s"], ["y"])],
}


@pytest.mark.parametrize("name", sorted(SPELLINGS))
def test_normalisation_spellings_one_kernel(name, tmp_path):
    m = _model(SPELLINGS[name], (64, 256), [_axes(-1), _f("eps", 1e-6), _f("two", 2.0)])
    kernels, launches, copies, plan = _counts(m, tmp_path)
    assert (kernels, launches, copies) == (1, 1, 0), str(plan)
