"""LSTM, GRU and RNN: input projection as one product, the time loop as one generated kernel
(frontend/onnx_ops_rnn.py, ops/recurrent.py, codegen/recurrent.py).

Checked against onnxruntime at rtol 1e-4, atol 1e-5 over the attributes exporters write
(directions, sequence_lens, initial states, peepholes, clip, input_forget,
linear_before_reset, activations with alpha/beta) and edge shapes (seq 1, batch 1, hidden 1,
odd sizes).  onnxruntime refuses ``layout = 1``, so batch-first models are checked against
onnxruntime on the same model written sequence-first, with the inputs and outputs transposed.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper

import apollo_py

ort = pytest.importorskip("onnxruntime")
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _model(op, hid, inp, direction, t_len, batch, *, layout=0, seq=False, h0=False, c0=False, bias=True,
           peep=False, attrs=None, seed=0, dtype=np.float32, scale=0.4):
    """One recurrent node with constant W, R (B, P) of N(0, scale^2) weights and graph inputs
    x (sequence_lens, initial_h, initial_c); returns the model and feeds.  Row 0 of
    sequence_lens is the full length, the others random in [0, T] (0 included)."""
    rng = np.random.default_rng(seed)
    nd = 2 if direction == "bidirectional" else 1
    g = GATES[op]
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))

    def const(name, shape):
        return helper.make_tensor(name, elem, shape, (rng.standard_normal(int(np.prod(shape))) * scale)
                                  .astype(dtype).tolist())
    inits = [const("W", [nd, g * hid, inp]), const("R", [nd, g * hid, hid])]
    xs = (t_len, batch, inp) if layout == 0 else (batch, t_len, inp)
    inputs = [helper.make_tensor_value_info("x", elem, list(xs))]
    feeds = {"x": rng.standard_normal(xs).astype(dtype)}
    names = ["x", "W", "R", ""]
    if bias:
        inits.append(const("B", [nd, 2 * g * hid]))
        names[3] = "B"
    names.append("")
    if seq:
        inputs.append(helper.make_tensor_value_info("lens", T.INT32, [batch]))
        feeds["lens"] = rng.integers(0, t_len + 1, batch).astype(np.int32)
        feeds["lens"][0] = t_len
        names[4] = "lens"
    st = [nd, batch, hid] if layout == 0 else [batch, nd, hid]
    for want, name in ((h0, "h0"), (c0 and op == "LSTM", "c0")):
        names.append("")
        if want:
            inputs.append(helper.make_tensor_value_info(name, elem, st))
            feeds[name] = rng.standard_normal(st).astype(dtype)
            names[-1] = name
    if peep:
        names = names + [""] * (7 - len(names)) + ["P"]
        inits.append(const("P", [nd, 3 * hid]))
    while names[-1] == "":
        names.pop()
    outs = ["y", "yh"] + (["yc"] if op == "LSTM" else [])
    kw = dict(hidden_size=hid, direction=direction, **(attrs or {}))
    if layout:
        kw["layout"] = layout
    node = helper.make_node(op, names, outs, name="rnn", **kw)
    graph = helper.make_graph([node], "g", inputs, [helper.make_tensor_value_info(o, elem, None) for o in outs],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), feeds


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)


def _compare(got, want, rtol=1e-4, atol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


CASES = [
    ("LSTM", 8, 5, "forward", 6, 3, {}),
    ("LSTM", 8, 5, "bidirectional", 6, 3, dict(seq=True, h0=True, c0=True)),
    ("LSTM", 7, 3, "reverse", 5, 2, dict(seq=True, h0=True, c0=True, peep=True)),
    ("LSTM", 1, 1, "forward", 1, 1, {}),
    ("LSTM", 6, 4, "bidirectional", 5, 2, dict(peep=True, attrs=dict(clip=0.5))),
    ("LSTM", 6, 4, "forward", 5, 2, dict(attrs=dict(input_forget=1))),
    ("LSTM", 33, 7, "forward", 3, 5, dict(bias=False, h0=True)),
    ("LSTM", 70, 9, "forward", 4, 5, dict(seq=True, h0=True, c0=True)),   # 32-lane dots with a tail,
    ("GRU", 70, 9, "reverse", 4, 5, dict(seq=True, h0=True)),              # rows past the batch
    ("GRU", 8, 5, "bidirectional", 6, 3, dict(seq=True, h0=True)),
    ("GRU", 8, 5, "bidirectional", 6, 3, dict(seq=True, h0=True, attrs=dict(linear_before_reset=1))),
    ("GRU", 5, 3, "reverse", 1, 1, dict(h0=True, attrs=dict(linear_before_reset=1))),
    ("GRU", 17, 3, "forward", 3, 5, dict(bias=False)),
    ("GRU", 6, 5, "forward", 6, 3, dict(attrs=dict(clip=0.3, activations=["HardSigmoid", "ScaledTanh"],
                                                   activation_alpha=[0.3, 0.9], activation_beta=[0.4, 1.1]))),
    ("RNN", 8, 5, "bidirectional", 6, 3, dict(seq=True, h0=True)),
    ("RNN", 1, 2, "reverse", 4, 2, dict(attrs=dict(activations=["Relu"]))),
    ("RNN", 8, 5, "bidirectional", 6, 3, dict(attrs=dict(activations=["LeakyRelu", "HardSigmoid"],
                                                         activation_alpha=[0.1, 0.3], activation_beta=[0.4]))),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[3]}-h{c[1]}-t{c[4]}b{c[5]}-"
                         + "-".join(k for k in sorted(c[6]) if k != "attrs")
                         + "".join(f"-{k}" for k in sorted(c[6].get("attrs", {}))))
def test_matches_onnxruntime(case):
    op, hid, inp, direction, t_len, batch, kw = case
    model, feeds = _model(op, hid, inp, direction, t_len, batch, **kw)
    f = apollo_py.jit(model)
    _compare(f.run(**feeds), _ort(model, feeds))
    text = str(f.plan)
    assert "fallback" not in text.split("coverage")[0] and "recurrent" in text
    assert sum(1 for s in f.plan.kernels if s.fused is not None and s.fused.signature == "recurrent") == 1


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_numpy_reference_matches_onnxruntime(op):
    """The ``recurrent`` primitive's numpy reference (the reference target) agrees too."""
    model, feeds = _model(op, 6, 4, "bidirectional", 5, 3, seq=True, h0=True, c0=True, peep=op == "LSTM",
                          attrs=dict(linear_before_reset=1) if op == "GRU" else None)
    _compare(apollo_py.jit(model, target="reference").run(**feeds), _ort(model, feeds))


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_batch_first_layout(op):
    """layout = 1 against onnxruntime on the same model sequence-first (ort refuses layout 1)."""
    model, feeds = _model(op, 5, 3, "bidirectional", 4, 3, layout=1, seq=True, h0=True, c0=True)
    seq_first, _ = _model(op, 5, 3, "bidirectional", 4, 3, layout=0, seq=True, h0=True, c0=True)
    sf_feeds = {k: (v.transpose(1, 0, 2) if k != "lens" else v) for k, v in feeds.items()}
    want = _ort(seq_first, sf_feeds)
    want = [want[0].transpose(2, 0, 1, 3)] + [w.transpose(1, 0, 2) for w in want[1:]]
    _compare(apollo_py.jit(model).run(**feeds), want)


@pytest.mark.parametrize("op", ["LSTM", "GRU"])
def test_float64(op):
    """float64 against onnx.reference (onnxruntime's recurrent ops are float32 only)."""
    from onnx.reference import ReferenceEvaluator
    model, feeds = _model(op, 6, 4, "forward", 5, 2, h0=True, dtype=np.float64)
    _compare(apollo_py.jit(model).run(**feeds), ReferenceEvaluator(model).run(None, feeds), rtol=1e-9, atol=1e-10)


def test_float16_runs_through_onnx_reference():
    """A dtype the kernel lacks (float16) is refused by the converter naming the node; the node
    then runs through onnx.reference and the plan says why."""
    from onnx.reference import ReferenceEvaluator
    model, feeds = _model("RNN", 4, 3, "forward", 3, 2, dtype=np.float16)
    f = apollo_py.jit(model)
    _compare(f.run(**feeds), ReferenceEvaluator(model).run(None, feeds), rtol=1e-3, atol=1e-3)
    assert "fallback RNN 'rnn'" in str(f.plan) and "dtype float16" in str(f.plan)


def test_activation_without_lowering_names_the_node():
    """Elu has no loop-IR lowering here and no onnx.reference implementation either."""
    model, feeds = _model("RNN", 4, 3, "forward", 3, 2, attrs=dict(activations=["Elu"]))
    with pytest.raises(apollo_py.ApolloError, match="'rnn'.*Elu"):
        apollo_py.jit(model).run(**feeds)


@pytest.mark.parametrize("op, attrs", [("LSTM", dict(clip=2.0)), ("GRU", dict(linear_before_reset=1)),
                                       ("GRU", dict(activations=["HardSigmoid", "Tanh", "HardSigmoid", "Softsign"],
                                                   activation_alpha=[0.3, 0.25])),
                                       ("RNN", {})])
@pytest.mark.parametrize("hidden", [5, 64])     # R^T plain / in blocks of 64 columns
def test_export_round_trip(op, attrs, hidden):
    """``ap.export`` writes the recurrent primitive back as the ONNX node it runs (over the
    projected input, R restored from the primitive's blocked R^T); onnxruntime on the export
    agrees with the original model."""
    model, feeds = _model(op, hidden, 3, "bidirectional", 4, 3, seq=True, h0=True, c0=True, peep=op == "LSTM",
                          attrs=attrs, scale=0.4 if hidden < 16 else 0.1)
    f = apollo_py.jit(model)
    want = _ort(model, feeds)
    f.run(**feeds)
    exported = apollo_py.export(f)
    _compare(_ort(exported, feeds), want)


@pytest.mark.parametrize("op,direction,hidden,kw", [
    ("LSTM", "bidirectional", 96, dict(seq=True, h0=True, c0=True, peep=True)),
    ("LSTM", "forward", 128, dict(seq=True, h0=True, c0=True)),     # R^T blocks of 64, 2 unit chunks
    ("GRU", "forward", 96, dict(seq=True, h0=True, attrs=dict(linear_before_reset=1))),
    ("RNN", "reverse", 64, dict(h0=True)),
])
def test_phased_on_two_threads_matches_onnxruntime(op, direction, hidden, kw):
    """A recurrence worth the pool (inline_bytes lowered) runs as phases on two threads
    (codegen/phased.py): its kernel reads R^T (folded at compile time, no transpose step), is
    scheduled alone and matches onnxruntime on N = 2 batches of inputs."""
    from apollo_py.machine import PRESETS
    from apollo_py.runtime.cpu import KernelStep
    model, feeds = _model(op, hidden, 16, direction, 12, 3, scale=0.1, **kw)   # gain ~1: no chaos
    machine = PRESETS["conservative"].replace(inline_bytes=64 << 10)
    f = apollo_py.jit(model, options=apollo_py.Options(num_threads=2, machine=machine))
    for seed in range(2):
        batch = dict(feeds, x=np.random.default_rng(seed + 7).standard_normal(feeds["x"].shape).astype(np.float32))
        _compare(f.run(**batch), _ort(model, batch))
    rec = [s for s in f.plan.kernels if s.fused is not None and s.fused.signature == "recurrent"]
    assert len(rec) == 1 and rec[0].fused.phases == 12 + 1
    assert [n.op for n in rec[0].fused.nodes] == ["recurrent"] and rec[0].fused.nodes[0].attrs["rt"] > 0
    assert not any("transpose" in [n.op for n in s.fused.nodes] for s in f.plan.kernels if s.fused is not None)
    from apollo_py.runtime.cpu import _parts
    exe = f.specialization({k: v.shape for k, v in feeds.items()})
    entries = [item for kind, item in exe._schedule if kind == "kernels" and any(
        isinstance(s, KernelStep) and s.fused.phases for s in item)]
    assert len(entries) == 1 and len(entries[0]) == 1 and _parts(entries[0][0], exe.machine) > 1
