"""The phased runner (codegen/phased.py) and the phased recurrent kernel (codegen/recurrent.py).

A phased kernel's phases must run in order while the chunks of one phase may run at once on
several threads.  The synthetic kernel below makes every chunk of phase ``ph + 1`` read every
chunk of phase ``ph``: any chunk run before the phase it reads is finished gives a wrong sum.
The recurrent kernel run phased must equal the same kernel run as one sequential call bit for
bit (each chunk does the same arithmetic whichever thread runs it), and both must match the
numpy reference of the ``recurrent`` primitive.
"""
from __future__ import annotations

import numpy as np
import pytest

from apollo_py.codegen import loopir as L
from apollo_py.codegen.llvm import compile_llvm
from apollo_py.codegen.phased import run_phased
from apollo_py.codegen.recurrent import phased, recurrent_phased_kernel
from apollo_py.ops.recurrent import GATES, _reference, rows, rt_block
from apollo_py.runtime.threadpool import ThreadPool


def _chain_kernel(phases: int, chunks: int, width: int):
    """buf[ph + 1, c, :] = sum over c' of buf[ph, c', :] / chunks + c + 1, per phase ph."""
    buf = L.Param("buf", "float64", (phases + 1) * chunks * width)
    p, c2, w = L.Var("p"), L.Var("c2"), L.Var("w")
    ph, c = L.Var("ph"), L.Var("c")
    acc = L.Var("acc", "float64")
    body = L.for_("p", 0, phases * chunks, [
        L.Local("ph", "int64", p // chunks), L.Local("c", "int64", p % chunks),
        L.for_("w", 0, width, [
            L.Local("acc", "float64", L.Const(0.0, "float64")),
            L.for_("c2", 0, chunks, L.Assign("acc", acc + buf[(ph * chunks + c2) * width + w])),
            L.Store(buf, ((ph + 1) * chunks + c) * width + w,
                    acc / L.Const(float(chunks), "float64") + L.Cast("float64", c + 1))])], "parallel")
    k = L.Kernel("phase_chain", (buf,), L.block(body), "p", phases * chunks)
    L.verify_kernel(k)
    return compile_llvm(k)


def _chain_numpy(phases: int, chunks: int, width: int, start: np.ndarray) -> np.ndarray:
    buf = np.zeros((phases + 1, chunks, width))
    buf[0] = start
    for ph in range(phases):
        buf[ph + 1] = buf[ph].sum(0) / chunks + np.arange(1, chunks + 1)[:, None]
    return buf


@pytest.mark.parametrize("threads,chunks", [(2, 2), (2, 5), (3, 2), (4, 3)])
def test_phases_run_in_order(threads, chunks):
    phases, width = 40, 2000      # chunks of ~10 us: threads overlap within a phase
    kernel = _chain_kernel(phases, chunks, width)
    rng = np.random.default_rng(threads * 10 + chunks)
    with ThreadPool(threads) as pool:
        for rep in range(15):
            start = rng.standard_normal((chunks, width))
            buf = np.zeros((phases + 1, chunks, width))
            buf[0] = start
            run_phased(pool, kernel, [buf.ravel()], phases)
            want = _chain_numpy(phases, chunks, width, start)
            np.testing.assert_allclose(buf, want, rtol=1e-9, atol=1e-12)


def test_one_thread_and_closed_pool_run_sequentially():
    phases, chunks, width = 7, 3, 5
    kernel = _chain_kernel(phases, chunks, width)
    start = np.arange(chunks * width, dtype=np.float64).reshape(chunks, width)
    want = _chain_numpy(phases, chunks, width, start)
    for pool in (None, ThreadPool(1)):
        buf = np.zeros((phases + 1, chunks, width))
        buf[0] = start
        run_phased(pool, kernel, [buf.ravel()], phases)
        np.testing.assert_allclose(buf, want, rtol=1e-9, atol=1e-12)
    pool = ThreadPool(2)
    pool.close()
    buf = np.zeros((phases + 1, chunks, width))
    buf[0] = start
    run_phased(pool, kernel, [buf.ravel()], phases)
    np.testing.assert_allclose(buf, want, rtol=1e-9, atol=1e-12)


def _attrs(cell, hidden, dirs, lbr=1, peephole=0, clip=-1.0, input_forget=0):
    acts = [[("Sigmoid", 0.0, 0.0), ("Tanh", 0.0, 0.0), ("Tanh", 0.0, 0.0)]] * len(dirs)
    if len(dirs) == 2:      # directions with different activations: the kernel's Select
        acts = [acts[0], [("HardSigmoid", 0.2, 0.5), ("Softsign", 0.0, 0.0), ("Tanh", 0.0, 0.0)]]
    return {"cell": cell, "hidden": hidden, "directions": tuple(dirs), "acts": acts, "clip": clip,
            "lbr": lbr, "input_forget": input_forget, "peephole": peephole, "rt": rt_block(cell, hidden)}


CASES = [
    ("lstm", 37, ("forward", "reverse"), 9, 5, dict(peephole=1)),
    ("lstm", 64, ("reverse",), 12, 6, dict(clip=2.0, input_forget=1)),
    ("gru", 33, ("forward",), 7, 3, {}),
    ("gru", 70, ("forward", "reverse"), 6, 9, {}),
    ("rnn", 20, ("reverse",), 8, 2, {}),
    ("lstm", 1, ("forward",), 4, 1, {}),
    ("rnn", 150, ("forward",), 3, 2, {}),      # 75 units a chunk: a 64-unit block, then one shifted back
    ("lstm", 128, ("forward",), 5, 5, {}),     # R^T in blocks of 64 columns, 2 chunks of 64 units
    ("gru", 192, ("forward", "reverse"), 4, 2, {}),    # blocks of 64, one chunk per direction
]


@pytest.mark.parametrize("cell,hidden,dirs,t_len,batch,extra", CASES)
def test_recurrent_phased_matches_reference_and_sequential(cell, hidden, dirs, t_len, batch, extra):
    a = _attrs(cell, hidden, dirs, **extra)
    assert phased(a)
    nd, g = len(dirs), GATES[cell]
    aux_len = 3 * hidden if a["peephole"] else hidden if cell == "gru" else 1
    k, chunks = recurrent_phased_kernel("rnn_phased_test", a, t_len, batch, aux_len, "float32", threads=2,
                                        rblock=a["rt"])
    assert k.parallel_extent == (t_len + 1) * chunks
    kernel = compile_llvm(k)
    rng = np.random.default_rng(hidden + t_len)
    xp = rng.standard_normal((t_len, batch, nd * g * hidden)).astype(np.float32)
    w = a["rt"]
    rt = (rng.standard_normal((nd, g * hidden // w, hidden, w)) * 0.3).astype(np.float32)
    assert rows(rt, w).shape == (nd, g * hidden, hidden)
    h0 = rng.standard_normal((nd, batch, hidden)).astype(np.float32)
    lens = rng.integers(0, t_len + 1, batch).astype(np.int32)
    lens[0] = t_len
    aux = rng.standard_normal((nd, aux_len)).astype(np.float32)
    ins = [xp, rt, h0, lens, aux] + ([rng.standard_normal((nd, batch, hidden)).astype(np.float32)]
                                     if cell == "lstm" else [])
    want = _reference(ins, a)

    def outs():
        return [np.full(w.shape, np.nan, np.float32) for w in want]
    seq = outs()
    kernel([*ins, *seq])
    for got, w in zip(seq, want):
        np.testing.assert_allclose(got, w, rtol=1e-4, atol=1e-5)
    with ThreadPool(2) as pool:
        for _ in range(10):
            par = outs()
            run_phased(pool, kernel, [*ins, *par], t_len + 1)
            for got, s in zip(par, seq):
                np.testing.assert_array_equal(got, s)
