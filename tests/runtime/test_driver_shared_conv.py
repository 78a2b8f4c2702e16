"""Tile-claiming convs shared with the native driver's helper thread (GemmStep.shares_tiles,
runtime/drive.py ``SHARE_BIG``; docs/design/driver.md "Convs and big steps in the driver"): on a
2-thread pool a conv on the implicit GEMM, the channel-vector or the row-reading kernel is a
parallel driver step that the caller and the helper each call once, claiming tiles from a
per-arena counter.  Convs small enough for the calling thread are such steps in the first
program; the pool-sized ones only in the second (``Program.big``), run by calls that get the
helper.  Same numbers with the helper on / off / joining first (bit for bit: a tile's arithmetic
does not depend on the thread), on the busy-box path, and against onnxruntime."""
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import apollo_py
from apollo_py import Options
from apollo_py.codegen import driver as D
from apollo_py.runtime import drive
from apollo_py.runtime.gemm_step import GemmStep

from ..conv.models import ort_run
from .test_driver_helper import _rebuild, eager_helper

# input shape, (cout, kernel, activation) per layer, the kernels they pick and how many of the
# convs need a copy made first (a channel-vector conv's padded copy, a row-reading conv's side
# copy: GemmStep.copy_call), pinned below
MODELS = {
    # 56x56: a 1x1 24->64 conv on the implicit GEMM (9.6 MFLOP: the calling thread's), a padded
    # 3x3 and an in-place 1x1 on the row-reading kernel (231 / 103 MFLOP: the pool's)
    "rows": ((1, 24, 56, 56), ((64, 1, "Relu"), (64, 3, "Relu"), (128, 1, None)),
             ["CompiledGemm", "CompiledConvRows", "CompiledConvRows"], 0),
    # 28x28: in-place 1x1 row-reading convs whose 784 pixels end in a partial panel (side copies)
    "rows_tail": ((1, 128, 28, 28), ((512, 1, "Relu"), (128, 1, None)), ["CompiledConvRows"] * 2, 2),
    # 14x14: channel-vector 1x1 convs of 5.8 MFLOP (inline), 48.5 and 29.5 MFLOP (the pool's),
    # a 3x3 of 44 MFLOP with a padded copy (the pad kernel, then the tiles)
    "cvec": ((1, 80, 14, 14), ((184, 1, "HardSwish"), (672, 1, "Relu"), (112, 1, None), (112, 3, None)),
             ["CompiledConvCvec"] * 4, 1),
}


def _model(name, seed=3):
    shape, layers = MODELS[name][:2]
    rng = np.random.default_rng(seed)
    nodes, inits, cur, cin = [], [], "x", shape[1]
    for q, (cout, k, act) in enumerate(layers):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{q}"),
                  numpy_helper.from_array((rng.standard_normal(cout) * 0.1).astype(np.float32), f"b{q}")]
        nodes.append(helper.make_node("Conv", [cur, f"w{q}", f"b{q}"], [f"c{q}"], pads=[k // 2] * 4))
        cur, cin = f"c{q}", cout
        if act:
            nodes.append(helper.make_node(act, [cur], [f"a{q}"]))
            cur = f"a{q}"
    g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info(cur, TensorProto.FLOAT, None)], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return m, rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module", params=sorted(MODELS))
def compiled(request):
    m, x = _model(request.param)
    f = apollo_py.jit(m, options=Options(num_threads=2))
    f(x=x)
    return request.param, m, x, f, f.specialization({"x": x.shape})


def _tables(exe):
    """The driver tables of the arena the last call used (a free list: it went back last)."""
    return exe._arenas._free[-1].driver


def _gemms(prog):
    return [s for seg in prog.segments for s in seg.steps if isinstance(s, GemmStep)]


def _parallel_words(seg) -> int:
    """How many PARALLEL steps a segment's program has (walking its words)."""
    words, pc, n = list(seg.prog), 0, 0
    while pc < len(words):
        op = words[pc]
        if op in (D.KERNEL, D.PARALLEL):
            n += op == D.PARALLEL
            pc += 5 + words[pc + 4]
        elif op == D.COPY:
            pc += 4
        else:
            pc += D.GEMM_WORDS
    return n


def test_kernels_and_programs(compiled, monkeypatch):
    name, m, x, f, exe = compiled
    kinds = MODELS[name][2]
    convs = [item for kind, item in exe._schedule if kind == "step" and isinstance(item, GemmStep)]
    assert [type(s.compiled).__name__ for s in convs] == kinds
    assert sum(s.copy_call() is not None for s in convs) == MODELS[name][3]
    monkeypatch.setattr(drive, "HELPER", True)
    monkeypatch.setattr(drive, "SHARE_BIG", True)
    _rebuild(exe)
    f(x=x)
    prog = exe._program
    inline = [s for s in convs if s.compiled.inline]
    # the first program: the calling thread's convs are shared steps, the pool's stay Python entries
    assert [s for s in _gemms(prog)] == inline and len(prog.scratch) == len(inline)
    assert sum(_parallel_words(seg) for seg in prog.segments) >= len(inline)
    assert sum(1 for kind, item in prog.entries if isinstance(item, GemmStep)) == len(convs) - len(inline)
    # the second: every conv a shared step, the model one parallel segment
    big = prog.big
    assert big is not None and len(big.entries) == 1 and big.segments[0].parallel
    assert _gemms(big) == convs and _parallel_words(big.segments[0]) == len(convs)
    assert _tables(exe).big is not None


def test_same_numbers_helper_on_off_busy_and_onnxruntime(compiled, monkeypatch):
    name, m, x, f, exe = compiled
    monkeypatch.setattr(drive, "HELPER", False)
    _rebuild(exe)
    alone = f(x=x).copy()
    assert exe._program.big is None and not any(s.parallel for s in exe._program.segments)
    ref = ort_run(m, {"x": x})[0]
    np.testing.assert_allclose(alone, ref, rtol=1e-5, atol=1e-5 * float(np.abs(ref).max()))
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(exe)
    for _ in range(10):
        np.testing.assert_array_equal(f(x=x), alone)
    sync = _tables(exe).big.sync
    assert (sync[6], sync[8]) in ((1, 1), (2, 0)), list(sync)
    # the busy-box path of HELPER "auto": the first program, no helper
    monkeypatch.setattr(drive, "HELPER", "auto")
    monkeypatch.setattr(drive, "_QUIET", lambda: False)
    for _ in range(3):
        np.testing.assert_array_equal(f(x=x), alone)
    # off: the old rule (convs are one-thread steps or pool dispatches)
    monkeypatch.setattr(drive, "HELPER", True)
    monkeypatch.setattr(drive, "SHARE_BIG", False)
    from apollo_py.runtime import gemm_step
    monkeypatch.setattr(gemm_step, "SHARE_CONVS", False)
    _rebuild(exe)
    np.testing.assert_array_equal(f(x=x), alone)
    assert exe._program.big is None and not _gemms(exe._program) or \
        all(s.compiled.inline for s in _gemms(exe._program))


def test_helper_that_joins_first(compiled, monkeypatch):
    """A helper that has joined before the first step takes part in every conv (it claims chunk
    [0, 1) or [1, 2) of each, and a row-reading conv's padded copy): same result."""
    name, m, x, f, exe = compiled
    monkeypatch.setattr(drive, "HELPER", False)
    _rebuild(exe)
    want = f(x=x).copy()
    started = []
    monkeypatch.setattr(drive, "_start_helper", eager_helper(started))
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(exe)
    for _ in range(8):
        np.testing.assert_array_equal(f(x=x), want)
    for t in started:
        t.join(10)
        assert not t.is_alive()
    sync = _tables(exe).big.sync
    assert sync[6] == 1 and sync[8] == 1


def test_concurrent_calls_have_their_own_buffers(compiled, monkeypatch):
    """Two calls at once run the big program in two arenas: their counters and padded / side
    copies are the arenas' own."""
    import threading
    name, m, x, f, exe = compiled
    monkeypatch.setattr(drive, "HELPER", True)
    _rebuild(exe)
    xs = [x, x[:, ::-1].copy()]
    wants = [f(x=v).copy() for v in xs]
    errors = []

    def loop(q):
        try:
            for _ in range(15):
                np.testing.assert_array_equal(f(x=xs[q]), wants[q])
        except BaseException as exc:      # noqa: BLE001 - reported below
            errors.append(exc)
    ts = [threading.Thread(target=loop, args=(q,)) for q in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in ts)
    bigs = [a.driver.big for a in exe._arenas._free if a.driver is not None and a.driver.big is not None]
    if len(bigs) == 2:
        assert not set(map(id, bigs[0].scratch.values())) & set(map(id, bigs[1].scratch.values()))
