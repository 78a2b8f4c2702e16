"""benchmarks/workloads.py in both forms and benchmarks/contenders.py's adapters (issue #14 item 5,
issue #13 item 4): the exporter form (LayerNormalization, Softmax, LogSoftmax, Gelu) and the
decomposed form of each workload compute the same numbers, through apollo_py and through
onnxruntime; every workload's array-namespace ``compute`` matches its numpy twin; jax.jit,
torch.compile and OpenVINO agree with onnxruntime where they are installed (the ``bench`` extra;
skipped otherwise)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import apollo_py as ap

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import contenders  # noqa: E402
import workloads  # noqa: E402

RTOL, ATOL = 1e-4, 1e-5


def _ort(model, inputs):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)


def _one(x):
    return np.asarray(x[0] if isinstance(x, (list, tuple)) else x)


@pytest.mark.parametrize("name", sorted(workloads.TWO_FORMS))
def test_exporter_and_decomposed_forms_agree(name):
    ex = workloads.build(name, quick=True, form="exporter")
    de = workloads.build(name, quick=True, form="decomposed")
    ops = {f: [n.op_type for n in w.model.graph.node] for f, w in (("ex", ex), ("de", de))}
    standard = {"LayerNormalization", "Softmax", "LogSoftmax", "Gelu"}
    assert standard & set(ops["ex"]) and not standard & set(ops["de"]), ops
    assert ex.inputs.keys() == de.inputs.keys()
    for k in ex.inputs:  # the same data in both forms
        np.testing.assert_array_equal(ex.inputs[k], de.inputs[k])
    want = _one(_ort(ex.model, ex.inputs))
    scale = float(np.max(np.abs(want)))
    for w in (ex, de):
        got_ort = _one(_ort(w.model, w.inputs))
        got_ap = _one(ap.jit(w.model)(**w.inputs))
        for got in (got_ort, got_ap):
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL * scale, err_msg=f"{name} {w.form}")


def test_exporter_forms_spell_ops_as_torch_onnx_does():
    """Opsets 17-20 write LayerNormalization / Softmax / LogSoftmax over axis -1; Gelu(tanh) needs 20."""
    bg = workloads.build("bias_gelu", quick=True, form="exporter").model
    assert [n.op_type for n in bg.graph.node] == ["Add", "Gelu"]
    assert bg.opset_import[0].version == 20
    assert next(a.s for a in bg.graph.node[1].attribute if a.name == "approximate") == b"tanh"
    ln = workloads.build("layernorm", quick=True, form="exporter").model
    assert [(n.op_type, [(a.name, a.i) for a in n.attribute if a.name == "axis"]) for n in ln.graph.node] \
        == [("LayerNormalization", [("axis", -1)])]
    assert workloads.forms("matmul") == ("",) and workloads.forms("softmax") == workloads.FORMS
    with pytest.raises(ValueError):
        workloads.build("matmul", quick=True, form="decomposed")


@pytest.mark.parametrize("name,form", [(n, f) for n in sorted(workloads.WORKLOADS) for f in workloads.forms(n)])
def test_compute_matches_numpy_twin(name, form):
    w = workloads.build(name, quick=True, form=form)
    want = _one(w.numpy_fn(**w.inputs))
    got = _one(w.compute(contenders.NumpyOps, w.params, **w.inputs))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * float(np.max(np.abs(want))))


@pytest.mark.parametrize("form", workloads.FORMS)
@pytest.mark.parametrize("which", ["jax.jit", "torch.compile", "openvino"])
def test_contender_adapters_agree_with_onnxruntime(which, form):
    module = {"jax.jit": "jax", "torch.compile": "torch", "openvino": "openvino"}[which]
    pytest.importorskip(module)
    w = workloads.build("layernorm", quick=True, form=form)
    want = _ort(w.model, w.inputs)
    if which == "openvino":
        fn, _ = contenders.openvino(w.model, w.inputs, want, threads=2)
    else:
        fn, _ = contenders.ADAPTERS[which](w, want, threads=2)
    got = fn()
    got = got.numpy() if hasattr(got, "numpy") else got
    np.testing.assert_allclose(_one(got), want[0], rtol=RTOL, atol=ATOL * float(np.max(np.abs(want[0]))))


def test_adapter_rejects_a_wrong_result():
    """The adapters' check is live: an expected output that differs makes the contender n/a."""
    pytest.importorskip("jax")
    w = workloads.build("softmax", quick=True, form="exporter")
    wrong = [_one(_ort(w.model, w.inputs)) + np.float32(0.01)]
    with pytest.raises(contenders.NA, match="WRONG RESULT"):
        contenders.jax_jit(w, wrong, threads=2)


def test_run_table_picks_the_fastest_rival_and_summarises():
    """run.py's apollo/best column and summary line: apollo against the fastest of ort-all,
    jax.jit and torch.compile in the row (contenders that are n/a are left out)."""
    import run

    def times(**ms):
        return {k: ({"median_s": v / 1e3, "samples_s": [v / 1e3]} if v is not None else None)
                for k, v in ms.items()}
    base = {"floor_s": 1e-3, "compile_s": 0.1, "triad_gbps": 10.0, "sgemm_gflops": 100.0}
    results = [
        {**base, "name": "a[1]", "form": "exporter",
         "times": times(**{"ort-all": 2.0, "jax.jit": 1.0, "torch.compile": None, "apollo": 1.5})},
        {**base, "name": "b[1]", "form": "",
         "times": times(**{"ort-all": 4.0, "jax.jit": None, "torch.compile": 5.0, "apollo": 2.0})},
    ]
    head = run.HEADER
    rows = run.table_rows(results)
    col = {h: i for i, h in enumerate(head)}
    assert [r[col["best"]] for r in rows] == ["jax.jit", "ort-all"]
    assert [r[col["apollo/best"]] for r in rows] == ["1.50", "0.50"]
    assert rows[1][col["form"]] == "-" and rows[0][col["openvino"]] == "n/a"
    line = run.summary_line(results)
    assert "geomean 0.87 over 2 rows" in line and "slower than the best in 1: a[1] exporter (1.50)" in line
