"""apollo_py demo: build a small ONNX model, save it, jit it, run it, print outputs and the plan.

    python examples/demo.py [model]      # model: mlp (default), conv_block, attention,
                                         #        layernorm_gelu, softmax_chain
"""
from __future__ import annotations

import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import apollo_py  # noqa: E402
from make_models import MODELS, example_inputs  # noqa: E402


def main(name: str = "mlp") -> None:
    model = MODELS[name]()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"{name}.onnx")
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        compiled = apollo_py.jit(path, target="cpu")            # generated LLVM kernels
        oracle = apollo_py.jit(path, target="reference")        # the numpy oracle
    print(f"model {name!r}: inputs {[s.name + ':' + s.describe() for s in compiled.program.inputs]}, "
          f"outputs {compiled.output_names}")
    feeds = example_inputs(model, {"N": 4, "B": 2, "S": 6}, seed=0)
    outputs = compiled.run(**feeds)
    expected = oracle.run(**feeds)
    for out_name, y in zip(compiled.output_names, outputs):
        head = np.array2string(y.reshape(-1)[:6], precision=4, separator=", ")
        err = float(np.max(np.abs(y - expected[compiled.output_names.index(out_name)])))
        print(f"{out_name}: shape {y.shape} {y.dtype}, first values {head}, max |cpu - reference| {err:.2e}")
    print(compiled.plan)


if __name__ == "__main__":
    main(*(sys.argv[1:2]))
