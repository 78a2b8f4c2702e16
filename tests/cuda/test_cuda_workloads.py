"""Every benchmark workload (quick sizes) through the CUDA back end without a GPU: each launch
compiles with NVRTC to PTX and cubin for sm_80 and sm_90 (issue #17 item 5a), and the workloads
whose forms the form tests do not cover (window reduction, transposed reduce form, host steps
between launches) are run by the emulation build and compared with their numpy twins (5b)."""
from __future__ import annotations

import os
import sys

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.codegen.cuda_emu import find_cxx

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from workloads import WORKLOADS  # noqa: E402


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_workload_compiles_for_sm80_and_sm90(name):
    from apollo_py.codegen.nvrtc import ARCHS, compile_cuda
    from apollo_py.runtime.cuda import Launch
    w = WORKLOADS[name](quick=True)
    f = ap.jit(w.model, target="cuda")
    plan = f.specialization({k: v.shape for k, v in w.inputs.items()}).plan
    launches = [s for s in plan.kernels if isinstance(s, Launch)]
    assert launches
    for s in launches:
        assert s.resources["sm_80"].registers > 0     # compiled when the executable was built
        for arch in ARCHS:
            if arch != "sm_80":
                b = compile_cuda(s.kernel.source, s.kernel.name, arch)
                assert f".target {arch}" in b.ptx and b.resources[s.kernel.name].registers > 0


@pytest.mark.skipif(find_cxx() is None, reason="the emulation build needs g++")
@pytest.mark.parametrize("name", ["bias_maxpool", "bias_reducesum", "four_branches", "conv_bn"])
def test_workload_emulated_matches_numpy(name):
    w = WORKLOADS[name](quick=True)
    got = ap.jit(w.model, target="cuda-emu")(**w.inputs)
    want = w.numpy_fn(**w.inputs)
    got, want = (list(x) if isinstance(x, (list, tuple)) else [x] for x in (got, want))
    for a, b in zip(got, want):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
