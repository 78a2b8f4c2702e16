"""CPU executable (``target="cpu"``): compiled LLVM kernels and reference steps in order.

Steps run in a fixed order.  A kernel step runs its compiled function on the thread pool in
chunks of its outermost parallel loop; a reference step runs primitives through their numpy
references (opaque ops without a lowering, matmul/conv through numpy's BLAS) and the plan says
so.  Intermediates live in a pre-faulted arena laid out by the liveness-based memory plan;
graph outputs are fresh arrays handed to the caller.  Safe to call from several threads: each
call borrows its own arena.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..errors import CompileError
from ..ir.graph import Graph
from .memory import ArenaPool, plan_memory
from .reference import run_nodes


@dataclass
class KernelStep:
    """One compiled kernel: ``compiled`` (CompiledKernel), buffers bound by ``param_values``."""

    compiled: object
    fused: object           # layer 1's FusedKernel
    param_values: tuple
    inputs: tuple
    outputs: tuple


@dataclass
class ReferenceStep:
    """Primitives run through their numpy references; ``reason`` is shown in the plan."""

    nodes: tuple
    inputs: tuple
    outputs: tuple
    reason: str


_POOLS: dict[int, object] = {}
_POOL_LOCK = threading.Lock()


def thread_pool(num_threads: int | None):
    """A process-wide thread pool per thread count (workers are daemon threads)."""
    from .threadpool import ThreadPool
    n = int(num_threads or os.cpu_count() or 1)
    with _POOL_LOCK:
        pool = _POOLS.get(n)
        if pool is None:
            pool = _POOLS[n] = ThreadPool(n)
        return pool


class CpuExecutable:
    """Runs ``steps`` over a memory plan; ``plan`` describes what was compiled and why."""

    def __init__(self, graph: Graph, steps: Sequence, plan, num_threads: int | None = None):
        self.graph = graph
        self.steps = list(steps)
        self.constants = {n.outputs[0]: np.array(n.attrs["value"].array, order="C")
                          for n in graph.nodes if n.op == "constant"}
        external = set(graph.inputs) | set(graph.outputs) | set(self.constants)
        # only kernel outputs go into the arena; reference steps return their own arrays
        kernel_outs = {v for s in self.steps if isinstance(s, KernelStep) for v in s.outputs}
        external |= {v for s in self.steps for v in s.outputs if v not in kernel_outs}
        self.memory = plan_memory([(s.inputs, s.outputs) for s in self.steps],
                                  {v: graph.types[v].nbytes for s in self.steps for v in (*s.inputs, *s.outputs)},
                                  external)
        self._arenas = ArenaPool(self.memory, graph.types)
        self._pool = thread_pool(num_threads)
        self.plan = plan

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        env: dict[str, np.ndarray] = dict(self.constants)
        env.update(feeds)
        types = self.graph.types
        outs = set(self.graph.outputs)
        arena = self._arenas.acquire()
        try:
            for s in self.steps:
                if isinstance(s, KernelStep):
                    for v in s.outputs:
                        if v in arena.views:
                            env[v] = arena.views[v]
                        else:
                            t = types[v]
                            env[v] = np.empty(t.shape, t.np_dtype)
                    args = [env[v] for v in s.param_values]
                    self._pool.run(s.compiled, args)
                else:
                    local = {v: env[v] for v in s.inputs}
                    run_nodes(s.nodes, local, types)
                    for v in s.outputs:
                        a = local[v]
                        # a numpy view (reshape) of an arena buffer must not outlive its slot
                        if not a.flags.c_contiguous or np.may_share_memory(a, arena.block):
                            a = np.array(a, order="C")
                        env[v] = a
            result = []
            for v in self.graph.outputs:
                a = env[v]
                if v in arena.views or v in feeds or v in self.constants:
                    a = a.copy()
                result.append(a)
            return result
        finally:
            self._arenas.release(arena)


def compile_kernels(fused: Sequence, cache_dir: str | None = None, progress=None) -> list:
    """Compile layer-1 kernels with LLVM behind the piecewise cache (``cache_dir``; None = memory)."""
    from ..codegen.cached import compile_all
    return compile_all([f.loop for f in fused], cache_dir, progress)
