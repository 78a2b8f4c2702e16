"""Trained model with control flow: Silero VAD (shipped as ONNX files inside the ``silero-vad``
wheel) through apollo_py.jit on both targets, against onnxruntime, on consecutive audio chunks
with the recurrent state carried between calls.

The model files come from an installed ``silero_vad`` package when there is one (default run),
else the opt-in ``network`` test downloads the wheel (``pip download silero-vad --no-deps``) into
a cache folder under the system temp dir and extracts the ``.onnx`` files from it.

``silero_vad.onnx`` (opset 16) branches on the run-time sample rate with a top-level If whose
branches hold the whole network (STFT conv, encoder convs, LSTM, decoder) and 24 nested Ifs on
shapes.  apollo_py splits at the top-level If (its outputs' shapes are not static for ONNX
shape inference), compiles the taken branch per shape, folds the nested Ifs (their conditions
are shape arithmetic) and lowers the LSTM to the recurrent kernel (codegen/recurrent.py).

Tolerance: onnxruntime's LSTM kernel uses approximate activations; on a standalone LSTM it is
1.7e-4 relative away from a float64 evaluation (onnx.reference in float32: 4.6e-5), so state
elements are compared at rtol 1e-4 with atol 1e-4; the speech probability at rtol 1e-4.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile

import numpy as np
import pytest

import apollo_py

ort = pytest.importorskip("onnxruntime")

MODELS = ["silero_vad.onnx", "silero_vad_16k_op15.onnx"]


def _installed_dir() -> str | None:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = os.path.join(list(spec.submodule_search_locations)[0], "data")
    return d if os.path.isdir(d) else None


def _downloaded_dir() -> str:
    cache = os.path.join(tempfile.gettempdir(), "apollo_py_test_wheels", "silero_vad")
    data = os.path.join(cache, "silero_vad", "data")
    if all(os.path.exists(os.path.join(data, m)) for m in MODELS):
        return data
    os.makedirs(cache, exist_ok=True)
    wheels = glob.glob(os.path.join(cache, "silero_vad-*.whl"))
    if not wheels:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "silero-vad", "--no-deps",
                               "--only-binary", ":all:", "-d", cache], capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            pytest.skip(f"cannot download the silero-vad wheel: {proc.stderr.strip()[-300:]}")
        wheels = glob.glob(os.path.join(cache, "silero_vad-*.whl"))
    with zipfile.ZipFile(sorted(wheels)[-1]) as z:
        for name in z.namelist():
            if name.startswith("silero_vad/data/") and name.endswith(".onnx"):
                z.extract(name, cache)
    return data


def _audio(n_chunks: int, chunk: int, sr: int) -> np.ndarray:
    """A tone that starts after a stretch of low noise: silence, then 'voiced' signal."""
    rng = np.random.default_rng(0)
    t = np.arange(n_chunks * chunk) / sr
    sig = 0.01 * rng.standard_normal(t.size)
    half = t.size // 2
    sig[half:] += 0.4 * np.sin(2 * np.pi * 180 * t[half:]) * (1 + 0.5 * np.sin(2 * np.pi * 3 * t[half:]))
    return sig.astype(np.float32)


def _run_stream(path: str, target: str, sr: int, n_chunks: int = 6):
    chunk = 512 if sr == 16000 else 256
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    f = apollo_py.jit(path, target=target)
    audio = _audio(n_chunks, chunk, sr)
    s_got = s_want = np.zeros((2, 1, 128), np.float32)
    srs = np.array(sr, np.int64)
    for k in range(n_chunks):
        x = audio[None, k * chunk:(k + 1) * chunk]
        p_got, s_got = f(input=x, state=s_got, sr=srs)
        p_want, s_want = sess.run(None, {"input": x, "state": s_want, "sr": srs})
        np.testing.assert_allclose(p_got, p_want, rtol=1e-4, atol=1e-7, err_msg=f"chunk {k}")
        np.testing.assert_allclose(s_got, s_want, rtol=1e-4, atol=1e-4, err_msg=f"chunk {k}")
    return f


def _check_models(data_dir: str, target: str):
    f = _run_stream(os.path.join(data_dir, "silero_vad.onnx"), target, 16000)
    text = str(f.plan)
    assert "fallback If" in text and "fallback LSTM" not in text and "recurrent" in text
    cov = f.plan.coverage
    assert cov.compiled > 20 and cov.fallback_count >= 1
    _run_stream(os.path.join(data_dir, "silero_vad.onnx"), target, 8000, n_chunks=3)
    _run_stream(os.path.join(data_dir, "silero_vad_16k_op15.onnx"), target, 16000, n_chunks=3)


@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_silero_vad_installed(target):
    data = _installed_dir()
    if data is None:
        pytest.skip("silero_vad is not installed (the network test downloads its wheel)")
    _check_models(data, target)


@pytest.mark.network
@pytest.mark.parametrize("target", ["reference", "cpu"])
def test_silero_vad_wheel(target):
    _check_models(_downloaded_dir(), target)
