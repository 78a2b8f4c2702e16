"""Data-parallel training with apollo_py on Ray: an MLP classifier on 2 workers (global batch
256 = 2 x 128), Adam, checkpoints every 10 steps; the result is checked against one process
training on the whole batch.

    python examples/distributed_training.py                  # starts a local Ray (2 CPUs)
    RAY_ADDRESS=HEAD_IP:6379 python examples/distributed_training.py     # on a running cluster

Kill a worker while it runs (``kill -9`` the pid printed at the start) and the run goes on:
the workers restart from the last checkpoint and replay the batches since it.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np
import ray
from onnx import TensorProto, helper, numpy_helper

import apollo_py as ap


def mlp_onnx(d=64, h=128, c=10, seed=0):
    """x (B, d) -> relu(x W1 + b1) W2 + b2 = logits (B, c), the batch dimension symbolic."""
    rng = np.random.default_rng(seed)
    w = {"W1": rng.standard_normal((d, h)) / np.sqrt(d), "b1": np.zeros(h),
         "W2": rng.standard_normal((h, c)) / np.sqrt(h), "b2": np.zeros(c)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["m2"]),
             helper.make_node("Add", ["m2", "b2"], ["logits"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", d])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", c])],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in w.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def main():
    if not os.environ.get("RAY_ADDRESS"):
        ray.init(num_cpus=2, include_dashboard=False)
    model = mlp_onnx()
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((10, 64)).astype(np.float32) * 0.3
    batches = []
    for _ in range(40):
        y = rng.integers(0, 10, 256)
        batches.append((centers[y] + rng.standard_normal((256, 64)).astype(np.float32), y))
    opt = ap.optim.Adam(1e-2)
    with tempfile.TemporaryDirectory() as ckpt:
        dp = ap.distributed.DataParallel(ap.train_step(model, optimizer=opt), num_workers=2,
                                         checkpoint_every=10, checkpoint_dir=ckpt)
        print("worker pids:", ray.get([w.pid.remote() for w in dp._workers]))
        losses = dp.fit([{"labels": y, "x": x} for x, y in batches])
        sd = dp.state_dict()
        dp.shutdown()
        print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} in {sd['step']} steps, "
              f"{dp.recoveries} recoveries; checkpoint at {ckpt}/checkpoint.npz")
    one = ap.train_step(model, optimizer=opt)
    for x, y in batches:
        one(labels=y, x=x)
    diff = max(float(np.max(np.abs(sd["params"][k] - one.params[k]))) for k in one.params)
    print(f"max |2 workers - 1 process| over the weights: {diff:.2e}")
    ray.shutdown()


if __name__ == "__main__":
    main()
