"""Thread limits for the benchmark processes; imports nothing heavy, so that it can run before
numpy, jax or torch are loaded (their thread pools are sized when they load).

XLA's CPU client sizes its Eigen pool from the process's CPU affinity and has no thread-count
flag (``intra_op_parallelism_threads`` is TensorFlow's, ``--xla_cpu_multi_thread_eigen=false``
means one thread), so the affinity is what limits jax.jit to N threads; onnxruntime, OpenVINO,
torch and apollo_py get N through their own settings as well.
"""
from __future__ import annotations

import os


def limit_threads(n: int) -> str:
    """Pin this process to ``n`` of its allowed CPUs (when it has more) and set OMP_NUM_THREADS /
    OPENBLAS_NUM_THREADS unless already set; with ``n == 1`` also switch XLA's Eigen pool off.
    Call before numpy / jax / torch are loaded.  Returns a line saying what was done."""
    done = []
    try:
        allowed = sorted(os.sched_getaffinity(0))
        if len(allowed) > n:
            os.sched_setaffinity(0, allowed[:n])
            done.append(f"pinned to CPUs {allowed[:n]} of {len(allowed)}")
        else:
            done.append(f"{len(allowed)} CPUs allowed, no pinning needed")
    except (AttributeError, OSError) as exc:  # not Linux
        done.append(f"CPU affinity not set ({type(exc).__name__})")
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        if var not in os.environ:
            os.environ[var] = str(n)
            done.append(f"{var}={n}")
    if n == 1:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()
        done.append("XLA_FLAGS=--xla_cpu_multi_thread_eigen=false")
    return "; ".join(done)
