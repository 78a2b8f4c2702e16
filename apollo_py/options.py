"""Compiler options: one frozen dataclass, passed explicitly to every pass (no env globals)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace


def _default_cache_dir() -> str:
    """``$APOLLO_PY_CACHE_DIR``, else ``$XDG_CACHE_HOME/apollo_py``, else ``~/.cache/apollo_py``.

    Read once per ``Options()``: the environment only chooses where the default cache lives
    (as XDG directories do); every pass still gets the directory through ``Options``.
    """
    explicit = os.environ.get("APOLLO_PY_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "apollo_py")


@dataclass(frozen=True)
class Options:
    """What the compiler may do and where it keeps its files.

    ``target``: "cpu" (LLVM kernels, the default), "reference" (numpy oracle, micro-graph by
    micro-graph), "cuda" (CUDA kernels through pycuda) or "cuda-emu" (the same CUDA source run
    on the CPU by an emulation build, for tests).
    ``rules_overlay``: path of a user TOML overlay for the partition rule table and layer 1's
    ``[[split]]`` patterns (written by ``apollo-py feedback apply``; partition/rules.py).
    ``schedule_budget``: isl operations cap per scheduling call (DESIGN §5).
    ``schedule_timeout``: seconds of wall time one isl scheduler call may take (it runs in a
    child process that is stopped when over; the micro-graph is then split, like over
    ``schedule_budget``); None = no wall-time limit.
    ``num_threads``: runtime worker threads (None = all cores).
    ``cache_dir``: piecewise cache and default feedback log location.
    ``feedback_path``: JSON-lines feedback log (None = ``<cache_dir>/feedback.jsonl``).
    ``progress``: progress lines on stderr for compiles over 2 s (None = only on a terminal).
    ``machine``: the machine figures that cost-model and dispatch decisions assume
    (apollo_py/machine.py): None (measured on this machine once and kept in
    ``<cache_dir>/machine.json``), a preset name (``"slow"``, ``"fast"``, ``"dev-2core"``,
    ``"conservative"``) or a ``Machine`` with explicit figures.  ``apollo-py machine`` shows them.
    ``gemm``: float32 matmul kernels: "auto" (BLAS, measured faster at every shape: see
    layers/gemm_lowering.py), "generated" (the generated GEMM, epilogue fused) or "blas".
    2-d float32 convs always run as the generated implicit GEMM.
    """

    target: str = "cpu"
    rules_overlay: str | None = None
    schedule_budget: int = 200_000
    schedule_timeout: float | None = 2.0
    num_threads: int | None = None
    cache_dir: str = field(default_factory=_default_cache_dir)
    feedback_path: str | None = None
    tile_sizes: tuple[int, ...] | None = None
    preprocess: bool = True
    model_name: str = ""
    progress: bool | None = None
    gemm: str = "auto"
    machine: object = None

    def __post_init__(self):
        from .machine import Machine, preset
        if isinstance(self.machine, str):
            preset(self.machine)        # OptionsError naming the presets
        elif self.machine is not None and not isinstance(self.machine, Machine):
            from .errors import OptionsError
            raise OptionsError(f"Options.machine must be None, a preset name or a Machine, "
                               f"not {type(self.machine).__name__}")

    def replace(self, **kw) -> "Options":
        return replace(self, **kw)
