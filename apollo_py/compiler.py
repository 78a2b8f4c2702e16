"""The pipeline (DESIGN §3): one short function listing the passes in order.

Graph --preprocess--> Graph --partition--> [MicroGraph] --layer2 + layer1--> [Kernel]
      --codegen (parallel)--> Executable
Each pass is a pure function from one immutable value to the next.
"""
from __future__ import annotations

from .errors import CompileError
from .ir.graph import Graph
from .options import TARGETS, Options
from .plan import Plan



def compile_graph(graph: Graph, options: Options):
    """Compile a static-shape primitive graph into an executable with ``.run(feeds)`` and ``.plan``.

    Under ``options.compile_timeout`` (apollo_py/deadline.py) the passes check the deadline
    between units of work and raise CompileTimeoutError past it."""
    from .deadline import compile_deadline
    with compile_deadline(options, graph.name):
        return _compile_graph(graph, options)


def _stage(progress, name: str, total: int = 0) -> None:
    """Start stage ``name``: the compile deadline is checked at every stage boundary."""
    from .deadline import check
    check(progress.stage_name or "front end (before preprocess)")
    progress.stage(name, total)


def _compile_graph(graph: Graph, options: Options):
    from .partition import partition, preprocess

    if options.target not in TARGETS:
        raise CompileError(f"target {options.target!r} is not available (available: {', '.join(TARGETS)})")
    from .progress import Progress
    progress = Progress(graph.name, options.progress)
    _stage(progress, "preprocess")
    if options.target in ("cuda", "cuda-emu"):     # no resize2d kernel there (partition/resize_unfuse.py)
        from .partition.resize_unfuse import unfuse_resize2d
        graph = unfuse_resize2d(graph)
    graph = preprocess(graph, options)
    _stage(progress, "partition")
    micro_graphs = partition(graph, options)
    if options.target == "reference":
        from .partition.execute import MicroGraphExecutable
        progress.done()
        return MicroGraphExecutable(graph, Plan(graph=graph, micro_graphs=micro_graphs,
                                                timings=tuple(progress.timings)))

    from .layers.lowering import lower_micro_graphs
    if options.target in ("cuda", "cuda-emu"):     # runtime/cuda.py: pycuda, or its CPU emulation
        from .runtime.cuda import build_cuda_executable, cuda_note, cuda_steps
        _stage(progress, "layer 1 fusion", len(micro_graphs))
        specs = lower_micro_graphs(graph, micro_graphs, options, progress)
        _stage(progress, "CUDA codegen (NVRTC)")
        steps = cuda_steps(graph, specs, options)
        progress.done()
        plan = Plan(graph=graph, micro_graphs=micro_graphs, kernels=tuple(steps), timings=tuple(progress.timings),
                    notes=(cuda_note(steps, options),))
        return build_cuda_executable(graph, steps, plan, options)
    from .layers.blas_fold import fold_blas
    from .runtime.blas import cblas

    _stage(progress, "layer 1 fusion", len(micro_graphs))
    specs = fold_blas(lower_micro_graphs(graph, micro_graphs, options, progress), graph,
                      blas_available=cblas() is not None)
    from .layers.gemm_reshape_epilogue import fold_reshaped_epilogues, fold_subpixel_stores
    from .layers.joint_gemm import join_projections
    specs = fold_reshaped_epilogues(fold_subpixel_stores(specs, graph), graph)
    specs, graph = join_projections(specs, graph, options)
    from .layers.attention import fold_attention
    specs = fold_attention(specs, graph, options)
    return build_cpu_executable(graph, micro_graphs, tuple(specs), options, progress)


def build_cpu_executable(graph: Graph, micro_graphs, specs, options: Options, progress, machine=None,
                         fork: bool = True):
    """The CPU executable of lowered step ``specs`` (layer 1-3 results after BLAS folding): object
    code from the piecewise cache (LLVM only for pieces it lacks), GEMM steps, the plan.

    Shared by :func:`compile_graph` and the model cache's warm path (``frontend/model_cache.py``),
    which stores ``graph``, ``micro_graphs`` and ``specs`` and skips every pass before this one.
    ``machine``: the figures the steps were planned with (default: ``options``' figures).
    ``fork``: let a forked child compile every other GEMM (False when they are expected to be
    piece-cache hits, as on the model cache's warm path: a child would only load them twice).
    """
    from .runtime.blas import BlasStep
    from .runtime.cpu import CpuExecutable, KernelStep, ReferenceStep, compile_kernels
    from .runtime.gemm_step import GemmStep

    fused = [s.fused for s in specs if s.fused is not None]
    _stage(progress, "LLVM codegen", len(fused))
    compiled = iter(compile_kernels(fused, options.cache_dir, progress, graph.types, options))
    gemms = [s for s in specs if s.gemm is not None]
    _stage(progress, "GEMM codegen", len(gemms))
    # every other GEMM compiled by a forked child into the disk cache meanwhile (two cores)
    from .codegen.cached import share_with_child
    from .tuning.db import decisions
    tuned = decisions(options) if gemms else {}     # gemm: pieces' blocking (docs/design/tuning.md)
    built = share_with_child(gemms, lambda s: GemmStep.build(s, options.num_threads, options.cache_dir, tuned),
                             options.cache_dir if fork else None)
    built = {id(gemms[i]): step for i, step in built.items()}
    steps = [KernelStep(next(compiled), s.fused, s.fused.param_values, s.inputs, s.outputs) if s.fused is not None
             else built.get(id(s)) or GemmStep.build(s, options.num_threads, options.cache_dir, tuned) if s.gemm is not None
             else BlasStep(s.blas, s.reason) if s.blas is not None
             else ReferenceStep(s.nodes, s.inputs, s.outputs, s.reason) for s in specs]
    from .deadline import check
    check("GEMM codegen", "after the last GEMM")
    progress.done()
    plan = Plan(graph=graph, micro_graphs=micro_graphs, kernels=tuple(specs), timings=tuple(progress.timings))
    if machine is None:
        from .codegen.fma_peak import peak_probe
        from .machine import resolve_machine
        machine = resolve_machine(options, peak_probe)
    return CpuExecutable(graph, steps, plan, options.num_threads, machine, options)
