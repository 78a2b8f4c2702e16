"""plan.kernels: per-step attributes of a target="cpu" plan (DESIGN §9)."""
import shutil

import numpy as np
import pytest

import apollo_py as ap
from apollo_py.errors import CompileError


def _bias_gelu_matmul():
    b = ap.GraphBuilder("mm_softmax")
    x = b.input("x", (32, 64))
    w = b.input("w", (64, 48))
    y = b.matmul(x, w)
    e = b.exp(y - b.reduce_max(y, axes=(1,), keepdims=True))
    return b.build([e / b.reduce_sum(e, axes=(1,), keepdims=True)])


def test_kernel_attributes_and_source():
    f = ap.jit(_bias_gelu_matmul(), target="cpu")
    kernels = [k for k in f.plan.kernels if k.fused is not None]
    assert kernels, str(f.plan)
    for k in kernels:
        assert k.parallel_dims >= 1
        assert isinstance(k.tile_sizes, tuple)
        assert k.flops > 0 and k.bytes > 0
        assert k.micro_graphs and all(isinstance(i, int) for i in k.micro_graphs)
        ir = k.source("llvm")
        assert "define" in ir and k.fused.loop.name in ir
        c = k.source("c")
        assert k.fused.loop.name in c and "{" in c
    with pytest.raises(CompileError):
        kernels[0].source("ptx-please")


def test_numpy_step_source_says_why():
    b = ap.GraphBuilder("t")
    x = b.input("x", (4, 6))
    g = b.build([b.transpose(x, perm=(1, 0))])
    f = ap.jit(g, target="cpu")
    x0 = np.arange(24, dtype=np.float32).reshape(4, 6)
    np.testing.assert_array_equal(f(x0), x0.T)
    for k in f.plan.kernels:
        if k.fused is None:
            assert k.parallel_dims == 0 and k.flops == 0
            assert k.reason in k.source("llvm")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")
def test_c_source_of_plan_kernels_matches_reference():
    """Each generated kernel of the plan, compiled from its C text, reproduces its outputs."""
    from apollo_py.codegen.c import compile_c
    from apollo_py.runtime.reference import run_nodes
    f = ap.jit(_bias_gelu_matmul(), target="cpu")
    g = f.plan.graph
    rng = np.random.default_rng(1)
    env = {"x": rng.standard_normal((32, 64)).astype(np.float32),
           "w": rng.standard_normal((64, 48)).astype(np.float32)}
    env.update({n.outputs[0]: np.asarray(n.attrs["value"].array) for n in g.nodes if n.op == "constant"})
    run_nodes(g.nodes, env, g.types)
    checked = 0
    for k in f.plan.kernels:
        if k.fused is None:
            continue
        outs = set(k.fused.outputs)
        args = [np.empty(g.types[v].shape, g.types[v].np_dtype) if v in outs
                else np.ascontiguousarray(env[v], dtype=g.types[v].np_dtype) for v in k.fused.param_values]
        compile_c(k.fused.loop)(args)
        for v, a in zip(k.fused.param_values, args):
            if v in outs:
                np.testing.assert_allclose(a, env[v], rtol=2e-6, atol=1e-6, err_msg=v)
                checked += 1
    assert checked >= 1
