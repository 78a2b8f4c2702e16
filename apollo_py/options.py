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


#: valid ``Options.target`` values ("cuda": the CUDA back end; "cuda-emu": its CPU emulation)
TARGETS = ("cpu", "reference", "cuda", "cuda-emu")
#: valid ``Options.gemm`` values
GEMM_CHOICES = ("auto", "generated", "blas")
#: valid ``Options.tune`` values (apollo_py/tuning/: stored per-piece decisions)
TUNE_CHOICES = ("off", "replay", "tune")
#: valid ``Options.attention`` values (layers/attention.py)
ATTENTION_CHOICES = ("auto", "fused", "unfused")


def _default_max_memory() -> int | None:
    """80% of physical memory (None where the OS does not say): what one model may plan for."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8)
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(nbytes: int, what: str, options) -> None:
    """ResourceError when ``nbytes`` (for ``what``, which names the node or value) exceeds
    ``options.max_memory``; called before the memory is allocated."""
    limit = getattr(options, "max_memory", None)
    if limit is not None and nbytes > limit:
        from .errors import ResourceError
        raise ResourceError(f"{what} needs {nbytes / 2**30:.3g} GiB, over Options.max_memory = "
                            f"{limit / 2**30:.3g} GiB")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    ``gemm``: float32 matmul kernels: "auto" (the generated GEMM for a constant or batched
    right operand, BLAS for the rest and for thin products: see layers/gemm_lowering.py),
    "generated" (the generated GEMM, epilogue fused) or "blas".
    2-d float32 convs always run as the generated implicit GEMM.
    ``attention``: "auto" / "fused" (``Q K^T -> softmax -> P V`` triples run as one fused
    attention kernel, layers/attention.py) or "unfused" (two GEMMs and a stitched softmax).
    ``joint_gemm``: generated GEMMs with constant weights that read one activation (attention's
    Q, K, V projections; a gated MLP's gate and up) run as one GEMM over the concatenated
    weights (layers/joint_gemm.py); False keeps one GEMM per product.
    ``max_memory``: bytes one compiled model may need: every tensor the model declares, its
    constants, and the memory plan (arena and outputs) are checked at compile time, before
    anything is allocated (ResourceError naming the node or value); default 80% of physical
    memory, None = no limit.
    ``compile_timeout``: seconds of wall time one whole compile (front-end lowering, partition,
    layers 2/1/3, LLVM codegen) may take; past it, ``CompileTimeoutError`` naming the stage and
    the micro-graph or kernel (checked between units of work, apollo_py/deadline.py; the isl
    scheduler's child process gets at most the time left).  None = no limit (the default).
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
    attention: str = "auto"
    joint_gemm: bool = True
    machine: object = None
    max_memory: int | None = field(default_factory=_default_max_memory)
    compile_timeout: float | None = None
    tune: str = "replay"
    tune_db: str | None = None
    tune_budget: float = 60.0

    def __post_init__(self):
        """Reject invalid fields here, with an OptionsError naming the field, so that a typo
        (``gemm="blas "``) is not silently read as the default further down."""
        from .errors import OptionsError

        def bad(name, want):
            raise OptionsError(f"Options.{name} must be {want}, not {getattr(self, name)!r}")

        if self.target not in TARGETS:
            bad("target", f"one of {list(TARGETS)}")
        if self.tune not in TUNE_CHOICES:
            bad("tune", f"one of {list(TUNE_CHOICES)}")
        if not (_is_real(self.tune_budget) and self.tune_budget > 0):
            bad("tune_budget", "a number of seconds > 0")
        if self.gemm not in GEMM_CHOICES:
            bad("gemm", f"one of {list(GEMM_CHOICES)}")
        if self.attention not in ATTENTION_CHOICES:
            bad("attention", f"one of {list(ATTENTION_CHOICES)}")
        if not isinstance(self.joint_gemm, bool):
            bad("joint_gemm", "True or False")
        if not _is_int(self.schedule_budget) or self.schedule_budget < 1:
            bad("schedule_budget", "an int >= 1")
        if self.schedule_timeout is not None and not (_is_real(self.schedule_timeout) and self.schedule_timeout > 0):
            bad("schedule_timeout", "None or a number of seconds > 0")
        if self.compile_timeout is not None and not (_is_real(self.compile_timeout) and self.compile_timeout > 0):
            bad("compile_timeout", "None or a number of seconds > 0")
        if self.num_threads is not None and not (_is_int(self.num_threads) and self.num_threads >= 1):
            bad("num_threads", "None or an int >= 1")
        if self.max_memory is not None and not (_is_int(self.max_memory) and self.max_memory >= 1):
            bad("max_memory", "None or a number of bytes >= 1")
        if self.tile_sizes is not None and not (isinstance(self.tile_sizes, (tuple, list)) and all(
                _is_int(t) and t >= 1 for t in self.tile_sizes)):
            bad("tile_sizes", "None or a tuple of ints >= 1")
        if not isinstance(self.cache_dir, (str, os.PathLike)):
            bad("cache_dir", "a path")
        for name in ("rules_overlay", "feedback_path", "tune_db"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), (str, os.PathLike)):
                bad(name, "None or a path")
        if self.progress is not None and not isinstance(self.progress, bool):
            bad("progress", "None, True or False")
        if not isinstance(self.preprocess, bool):
            bad("preprocess", "True or False")
        if not isinstance(self.model_name, str):
            bad("model_name", "a str")
        from .machine import Machine, preset
        if isinstance(self.machine, str):
            preset(self.machine)        # OptionsError naming the presets
        elif self.machine is not None and not isinstance(self.machine, Machine):
            from .errors import OptionsError
            raise OptionsError(f"Options.machine must be None, a preset name or a Machine, "
                               f"not {type(self.machine).__name__}")

    def replace(self, **kw) -> "Options":
        return replace(self, **kw)
