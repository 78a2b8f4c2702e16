"""The model zoo (tests/models/zoo, dynamo exports) on the CUDA back end without a GPU: compile
each model for target="cuda-emu" (NVRTC sm_80 when the executable is built, sm_90 here), run it
through the emulation build and compare with onnxruntime.  One model per call:

    python benchmarks/cuda_zoo_check.py bert_small.dynamo.onnx [--run]
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models"))
import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
from test_zoo_small import MANIFEST, ZOO, make_inputs  # noqa: E402

import apollo_py as ap  # noqa: E402
from apollo_py.codegen.nvrtc import compile_cuda  # noqa: E402
from apollo_py.runtime.cuda import Launch  # noqa: E402

name = sys.argv[1]; rec = MANIFEST[name]
feeds = make_inputs(rec, False, 0)
t0 = time.time()
f = ap.jit(str(ZOO / name), target="cuda-emu")
exe = f.specialization({k: v.shape for k, v in feeds.items()})
plan = exe.plan
launches = [s for s in getattr(plan, "kernels", ()) if isinstance(s, Launch)]
for s in launches:
    compile_cuda(s.kernel.source, s.kernel.name, "sm_90")
forms = {}
for s in launches: forms[s.kernel.form] = forms.get(s.kernel.form, 0) + 1
t1 = time.time()
msg = f"{name}: {len(launches)} launches {forms} compile {t1-t0:.0f}s"
if "--run" in sys.argv:
    got = f(**feeds); got = got if isinstance(got, list) else [got]
    sess = ort.InferenceSession(str(ZOO / name), providers=["CPUExecutionProvider"])
    want = sess.run(None, feeds)
    err = max(float(np.abs(a.astype(np.float64) - b).max() / max(np.abs(b).max(), 1e-30)) for a, b in zip(got, want))
    msg += f" run {time.time()-t1:.0f}s rel err {err:.2e}"
print(msg, flush=True)
