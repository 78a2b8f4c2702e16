"""What the layer tests pin about a compiled model: compile it on the CPU target with fixed
machine figures (so layer 3's choices do not depend on the machine the tests run on), check its
outputs against onnxruntime, and count kernels, launches and numpy steps."""
from __future__ import annotations

import numpy as np
import onnx

import apollo_py as ap

RTOL, ATOL = 1e-4, 1e-5
MACHINE = ap.Machine(bandwidth=100e9, peak=500e9, launch=1e-9)


def compile_and_count(model: onnx.ModelProto, tmp_path, feeds: dict):
    """(kernels, launches, numpy steps other than reshape views, plan) after checking the
    outputs against onnxruntime (rtol ``RTOL``, atol ``ATOL``)."""
    import onnxruntime as ort
    data = model.SerializeToString()
    f = ap.jit(data, options=ap.Options(target="cpu", cache_dir=str(tmp_path), machine=MACHINE))
    got = f(**feeds)
    got = got if isinstance(got, (list, tuple)) else [got]
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=RTOL, atol=ATOL)
    plan = f.plan
    kernels = [k for k in plan.kernels if k.fused is not None]
    copies = [k for k in plan.kernels if k.fused is None and not all(n.op == "reshape" for n in k.nodes)]
    return len(kernels), len(plan.launches), len(copies), plan
