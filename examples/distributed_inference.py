"""Batch inference with apollo_py on Ray Data: a small ResNet from the test zoo over 512 images,
on 2 actors, checked against a local loop.

    python examples/distributed_inference.py                 # starts a local Ray (2 CPUs)
    RAY_ADDRESS=HEAD_IP:6379 python examples/distributed_inference.py    # on a running cluster

Each actor compiles the model once; the pieces the driver compiled for the example batch travel
through Ray's object store into each actor's cache, so the actors' compiles are cache hits.
"""
from __future__ import annotations

import os
import time

import numpy as np
import ray

import apollo_py as ap

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "models", "zoo",
                     "resnet_small.dynamo.onnx")


def main():
    if not os.environ.get("RAY_ADDRESS"):
        ray.init(num_cpus=2, include_dashboard=False)
    rng = np.random.default_rng(0)
    images = rng.standard_normal((512, 3, 32, 32)).astype(np.float32)
    ds = ray.data.from_items([{"id": i, "x": images[i]} for i in range(len(images))])
    t = time.perf_counter()
    rows = ap.distributed.predict(ds, MODEL, num_actors=2, batch_size=64,
                                  example={"x": images[:64]}, index_column="id").take_all()
    took = time.perf_counter() - t
    logits = np.stack([r["y"] for r in rows])
    f = ap.jit(MODEL)
    want = np.concatenate([f(images[i:i + 64]) for i in range(0, len(images), 64)])
    assert [r["id"] for r in rows] == list(range(len(images))), "rows out of order"
    print(f"{len(rows)} images in {took:.1f} s (start-up and compiles included); "
          f"max |distributed - local| = {np.abs(logits - want).max():.2e}")
    print("predicted classes of the first 10:", logits[:10].argmax(axis=1).tolist())
    ray.shutdown()


if __name__ == "__main__":
    main()
