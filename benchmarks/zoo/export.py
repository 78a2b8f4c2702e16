"""Export the zoo's models to ONNX with torch.onnx, both exporters.

    python benchmarks/zoo/export.py [--size full|small] [--out DIR] [--only FAMILY ...]
                                    [--exporter dynamo|torchscript ...] [--force]

Each family (benchmarks/zoo/zoo_models.py) is exported by the dynamo exporter
(``torch.onnx.export(..., dynamo=True)``, through onnxscript, opset 18) and by the TorchScript
one (``dynamo=False``, opset 17) where it still works: the two spell the same module
differently (LayerNorm as one op or decomposed, SDPA as MatMul/Softmax or with Where masks,
Gemm or MatMul+Add, ...), and both reach users.  Files are ``<name>.<exporter>.onnx`` with the
weights inside, in ``--out`` (default ``$APOLLO_PY_ZOO_DIR`` or ``~/.cache/apollo_py_zoo`` for the
full zoo; ``tests/models/zoo`` holds the committed small ones).  ``manifest.json`` there records,
per file, its inputs (shape, dtype, integer range) and a second set of shapes for the dynamic
axes, torch's answer vs onnxruntime's, and why an export failed.  Existing files are kept unless
``--force``.  The full zoo also takes the trained models that pip packages ship (``TRAINED``:
rapidocr-onnxruntime's PP-OCR models).  Needs the ``zoo`` extra.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
import traceback
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

EXPORTERS = ("dynamo", "torchscript")


def default_dir(size: str) -> Path:
    if size == "small":
        return ROOT / "tests" / "models" / "zoo"
    return Path(os.environ.get("APOLLO_PY_ZOO_DIR", Path.home() / ".cache" / "apollo_py_zoo"))


def _input_record(zm) -> list:
    """Per input: name, shape, dtype, integer range (ids), and a second shape that changes every
    dynamic axis except the batch (a new sequence length), or the batch where it is the only one."""
    recs = []
    for name, t in zip(zm.input_names, zm.inputs):
        rec = {"name": name, "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")}
        if not t.dtype.is_floating_point:
            rec["high"] = int(t.max()) + 1
        alt = list(t.shape)
        axes = zm.dynamic_axes.get(name, {})
        for ax, dim in axes.items():
            if dim == "batch" and len(axes) > 1:
                continue
            alt[ax] = max(1, alt[ax] // 2) if dim != "batch" else alt[ax] + 1
        rec["alt_shape"] = alt
        recs.append(rec)
    return recs


def export_one(zm, path: Path, exporter: str) -> None:
    import torch
    kw = dict(input_names=zm.input_names, output_names=zm.output_names)
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        with torch.no_grad():
            if exporter == "dynamo":
                # Dim.AUTO: dynamic where the module allows it, specialised (not an error) where
                # it does not, e.g. a batch of 1 that the model code reads as a constant.
                shapes = tuple({ax: torch.export.Dim.AUTO for ax in zm.dynamic_axes.get(n, {})}
                               for n in zm.input_names)
                torch.onnx.export(zm.module, zm.inputs, str(path), dynamo=True, opset_version=18,
                                  external_data=False, dynamic_shapes=shapes, **kw)
            else:
                torch.onnx.export(zm.module, zm.inputs, str(path), dynamo=False, opset_version=17,
                                  dynamic_axes=zm.dynamic_axes, **kw)


def _strip_metadata(path: Path) -> None:
    """Drop the per-node stack traces and doc strings the dynamo exporter writes (half of a small
    model's bytes); nodes, names and weights are unchanged."""
    import onnx
    m = onnx.load(str(path))
    for n in m.graph.node:
        del n.metadata_props[:]
        n.doc_string = ""
    onnx.save(m, str(path))


def check_with_ort(zm, path: Path) -> float:
    """max|torch - onnxruntime| / max|torch| on the example inputs."""
    import numpy as np
    import onnxruntime as ort
    import torch
    with torch.no_grad():
        want = zm.module(*zm.inputs)
    want = (want if isinstance(want, (tuple, list)) else [want])[0].numpy()
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, {n: t.numpy() for n, t in zip(zm.input_names, zm.inputs)})[0]
    return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))


# Trained models that pip packages ship as ONNX files (installed with --no-deps: only the files
# are used).  rapidocr-onnxruntime: PaddleOCR's PP-OCR detector, recogniser and direction
# classifier, exported by paddle2onnx (inputs [-1, 3, ?, ?]-style, opsets 11-12).
TRAINED = {
    "rapidocr_det": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx", [1, 3, 320, 320]),
    "rapidocr_rec": ("rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx", [1, 3, 48, 320]),
    "rapidocr_cls": ("rapidocr_onnxruntime", "models/ch_ppocr_mobile_v2.0_cls_infer.onnx", [1, 3, 48, 192]),
}


def collect_trained(out: Path, manifest: dict) -> None:
    """Copy the TRAINED files of the installed packages into ``out`` with manifest records."""
    import importlib.util
    import shutil
    for name, (pkg, rel, shape) in TRAINED.items():
        spec = importlib.util.find_spec(pkg)
        if spec is None or spec.origin is None:
            print(f"{name:40s} skipped: {pkg} is not installed (pip install --no-deps {pkg})")
            continue
        src = Path(spec.origin).parent / rel
        key = f"{name}.trained.onnx"
        shutil.copyfile(src, out / key)
        alt = [shape[0] + 1] + shape[1:]
        manifest[key] = {"family": "trained", "builder": name, "size": "full", "exporter": "paddle2onnx",
                         "source": f"{pkg}/{rel}", "bytes": (out / key).stat().st_size,
                         "inputs": [{"name": "x", "shape": shape, "dtype": "float32", "alt_shape": alt}]}
        print(f"{key:40s} {manifest[key]['bytes'] / 1e3:9.1f} KB  from {pkg}")


def main(argv=None) -> int:
    from zoo_models import FAMILIES, build
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("small", "full"), default="full")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", nargs="*", choices=sorted(FAMILIES))
    ap.add_argument("--exporter", nargs="*", choices=EXPORTERS, default=list(EXPORTERS))
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--no-trained", action="store_true", help="skip the models pip packages ship")
    args = ap.parse_args(argv)
    out = args.out or default_dir(args.size)
    out.mkdir(parents=True, exist_ok=True)
    mpath = out / "manifest.json"
    manifest = json.loads(mpath.read_text()) if mpath.exists() else {}
    if args.size == "full" and not args.no_trained and not args.only:
        collect_trained(out, manifest)
        mpath.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for fam in args.only or list(FAMILIES):
        try:
            zm = build(fam, args.size)
        except Exception as e:
            print(f"{fam:40s} BUILD FAILED: {type(e).__name__}: {e}", flush=True)
            continue
        for exporter in args.exporter:
            t0 = time.perf_counter()
            path = out / f"{zm.name}.{exporter}.onnx"
            key = path.name
            if path.exists() and not args.force and key in manifest:
                print(f"{key:40s} cached")
                continue
            rec = {"family": zm.family, "builder": fam, "size": args.size, "exporter": exporter,
                   "inputs": _input_record(zm)}
            try:
                export_one(zm, path, exporter)
                if args.size == "small":
                    _strip_metadata(path)
                rec["torch_vs_ort"] = check_with_ort(zm, path)
                rec["bytes"] = path.stat().st_size
                print(f"{key:40s} {rec['bytes'] / 1e3:9.1f} KB  torch vs ort {rec['torch_vs_ort']:.2e}"
                      f"  {time.perf_counter() - t0:.1f}s", flush=True)
            except Exception as e:  # an exporter that cannot take this module: recorded, not fatal
                if path.exists():
                    path.unlink()
                tb = traceback.format_exception_only(type(e), e)[-1].strip()
                rec["export_error"] = tb[:400]
                print(f"{key:40s} EXPORT FAILED: {tb[:200]}", flush=True)
            manifest[key] = rec
            mpath.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
