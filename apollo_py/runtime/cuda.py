"""CUDA target (``target="cuda"``) and its CPU emulation (``target="cuda-emu"``).

:func:`lower_cuda` turns layer 1/2 step specs into launches: a reduce-form or stitched kernel
(codegen/cuda_reduce.py) where the kernel fits a canonical form, else the generic grid-stride
rendering of its loop IR (codegen/cuda.py); a matmul / 2-d conv micro-graph becomes the tiled
CUDA GEMM with its epilogue (codegen/cuda_gemm.py); opaque ops stay numpy steps.  Consecutive
independent memory-bound launches of one block shape are parallel-stitched by layer 3's policy
(``layers.layer3.stitch_parallel`` with GPU figures) into one launch.

:class:`CudaExecutable` runs the launches over a device: every intermediate lives in one
device arena laid out by the liveness memory plan (runtime/memory.py), inputs are copied in
(or, for objects with ``__cuda_array_interface__``, used in place), outputs copied out as numpy
arrays, and the call synchronises once at the end.  Devices:

* :class:`PycudaDevice` -- pycuda (the ``cuda`` extra), imported only here and only when a
  ``target="cuda"`` graph is first run; cubins from NVRTC for the device's architecture;
  launches on one stream.  Without pycuda or a driver: one :class:`CudaUnavailableError`;
* :class:`EmuDevice` -- host memory and the g++ emulation build of the same sources
  (codegen/cuda_emu.py): what the tests use to check the generated CUDA numerically.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from ..errors import CompileError, CudaUnavailableError
from .memory import plan_memory
from .reference import run_nodes

__all__ = ["CudaUnavailableError", "CudaExecutable", "Launch", "HostStep", "lower_cuda", "cuda_steps"]


#: GPU figures for layer 3's cost model (A100-class: ~1.5 TB/s, 19.5 TFLOP/s fp32, ~4 us per
#: launch); from data sheets, not measured here (no GPU was available)
def gpu_machine():
    from ..machine import Machine
    return Machine(bandwidth=1.5e12, peak=19.5e12, launch=4e-6, source="A100 data sheet (CUDA target)")


@dataclass
class Launch:
    """One kernel launch: ``kernel`` (CudaKernel), graph values bound to its params."""

    kernel: object
    param_values: tuple
    inputs: tuple
    outputs: tuple
    spec: object = None
    resources: dict = field(default_factory=dict)    # arch -> KernelResources
    cublas: tuple | None = None       # (dtype, batch, m, n, k, stride_a, stride_b): cuBLAS can run it
    choice: str = ""                  # "cublas" / "generated" once measured on a GPU

    fused = property(lambda self: getattr(self.spec, "fused", None))
    gemm = property(lambda self: getattr(self.spec, "gemm", None))
    blas = None
    nodes = property(lambda self: getattr(self.spec, "nodes", ()))

    def describe(self) -> str:
        k = self.kernel
        res = "; ".join(f"{a}: {r}" for a, r in self.resources.items())
        ops = " ".join(n.op for n in (self.fused.nodes if self.fused is not None else self.nodes)) \
            if self.spec is not None else "+".join(k.members)
        chosen = f"; {self.choice}" if self.choice else ""
        return (f"cuda   {k.name} [{k.form}{chosen}] grid {k.grid} block {k.block}: {ops}"
                + (f"  ({res})" if res else ""))

    def to_dict(self) -> dict:
        d = self.kernel.to_dict()
        d["kind"] = "cuda"
        d["resources"] = {a: r.to_dict() for a, r in self.resources.items()}
        return d


@dataclass
class HostStep:
    """A numpy step of the CUDA target: its inputs come to the host and its outputs go back."""

    spec: object
    inputs: tuple
    outputs: tuple

    fused = gemm = blas = None
    nodes = property(lambda self: self.spec.nodes)

    def describe(self) -> str:
        return "host " + self.spec.describe()

    def to_dict(self) -> dict:
        return self.spec.to_dict()


def _kernel_for(spec, graph, arch):
    from ..codegen.cuda import render_generic
    from ..codegen.cuda_reduce import render_reduce
    if spec.fused is not None:
        f = spec.fused
        depth = f.parallel_dims if not f.tile_sizes else 1      # tiled nests: tile loops differ
        ck = render_reduce(f, graph.types, arch) or render_generic(f.loop, arch, depth)
        from dataclasses import replace
        return replace(ck, bytes=f.bytes, flops=f.flops), tuple(f.param_values)
    from ..codegen.cuda_gemm import render_gemm
    from ..codegen.gemm import EpiOperand  # noqa: F401 - GemmDesc operands
    d = spec.gemm
    head = spec.nodes[0]
    x, w = head.inputs
    a_val, b_val = (w, x) if d.conv is not None else (x, w)
    ck = render_gemm(d, graph.types[a_val].dtype, graph.types[b_val].dtype, arch)
    nbytes = sum(graph.types[v].nbytes for v in (a_val, b_val, *(o.value for o in d.operands), *d.outputs))
    from dataclasses import replace
    return replace(ck, bytes=nbytes), (a_val, b_val, *(o.value for o in d.operands), *d.outputs)


def lower_cuda(graph, specs: Sequence, arch_name: str = "sm_80", stitch: bool = True) -> list:
    """Launches and host steps for ``specs`` (layer 1/2 StepSpecs), in execution order."""
    from ..codegen.cuda import arch_of
    arch = arch_of(arch_name)
    steps: list = []
    for s in specs:
        if s.fused is None and s.gemm is None:
            steps.append(HostStep(s, tuple(s.inputs), tuple(s.outputs)))
            continue
        ck, values = _kernel_for(s, graph, arch)
        outs = tuple(s.outputs)
        launch = Launch(ck, values, tuple(v for v in values if v not in outs), outs, s)
        if s.gemm is not None:
            from .cublas import cublas_form
            form = cublas_form(s.gemm)
            dts = {graph.types[v].dtype for v in values}
            if form is not None and len(dts) == 1:
                batch, sa, sb = form
                launch.cublas = (dts.pop(), batch, s.gemm.m, s.gemm.n, s.gemm.k, sa, sb)
        steps.append(launch)
    return _stitch(steps, arch) if stitch else steps


class _L3:
    def __init__(self, launch, machine):
        self.launch = launch
        self.name = launch.kernel.name
        self.inputs, self.outputs = launch.inputs, launch.outputs
        self.bytes, self.flops = launch.kernel.bytes, launch.kernel.flops
        self.compute_bound = machine.is_compute_bound(self.bytes, self.flops) or launch.gemm is not None


def _stitch(steps: list, arch) -> list:
    """Layer 3 on the GPU: runs of independent launches -> groups -> one launch per group."""
    from ..codegen.cuda import body_of, render_group
    from ..layers.layer3 import stitch_parallel
    machine = gpu_machine()
    out: list = []
    run: list = []

    def flush():
        if len(run) < 2:
            out.extend(run)
            run.clear()
            return
        groups = stitch_parallel([_L3(x, machine) for x in run], machine)
        for g in groups:
            ls = [x.launch for x in g]
            if len(ls) == 1 or len({x.kernel.block for x in ls}) != 1 or \
                    any(x.kernel.grid[1:] != (1, 1) for x in ls):
                out.extend(ls)
                continue
            name = "group_" + "_".join(x.kernel.name[-6:] for x in ls)[:60]
            ck = render_group(name, [x.kernel for x in ls], [body_of(x.kernel) for x in ls], arch)
            from dataclasses import replace
            ck = replace(ck, bytes=sum(x.kernel.bytes for x in ls), flops=sum(x.kernel.flops for x in ls))
            values = tuple(v for x in ls for v in x.param_values)
            outs = tuple(v for x in ls for v in x.outputs)
            out.append(Launch(ck, values, tuple(v for x in ls for v in x.inputs), outs, None))
        run.clear()

    for s in steps:
        if isinstance(s, Launch) and s.gemm is None:
            if run:
                written = {v for x in run for v in x.outputs}
                touched = {v for x in run for v in x.param_values}
                if set(s.param_values) & written or set(s.outputs) & touched:
                    flush()
            run.append(s)
            continue
        flush()
        out.append(s)
    flush()
    return out


def compile_resources(steps: Sequence, archs=("sm_80",), cache_dir: str | None = None) -> None:
    """Compile every launch with NVRTC for ``archs`` and record its register / shared / local use."""
    from ..codegen.cached import piece_cache
    from ..codegen.nvrtc import compile_cuda
    cache = piece_cache(cache_dir)
    for s in steps:
        if isinstance(s, Launch):
            for a in archs:
                b = compile_cuda(s.kernel.source, s.kernel.name, a, cache)
                s.resources[a] = b.resources.get(s.kernel.name)


# ----------------------------------------------------------------------------- devices


class EmuDevice:
    """Host memory and the g++ emulation build: the CUDA target checked on a CPU."""

    name = "cpu emulation of CUDA (g++, fibers)"

    def __init__(self, cache_dir: str | None = None):
        self.cache_dir = cache_dir
        self._keep: dict[int, np.ndarray] = {}

    def alloc(self, nbytes: int) -> int:
        buf = np.zeros(max(1, nbytes) + 64, np.uint8)
        ptr = (buf.ctypes.data + 63) // 64 * 64
        self._keep[ptr] = buf
        return ptr

    def free(self, ptr: int) -> None:
        self._keep.pop(ptr, None)

    def _view(self, ptr: int, nbytes: int) -> np.ndarray:
        import ctypes
        return np.ctypeslib.as_array((ctypes.c_uint8 * max(1, nbytes)).from_address(ptr))[:nbytes]

    def htod(self, ptr: int, arr: np.ndarray) -> None:
        a = np.ascontiguousarray(arr)
        self._view(ptr, a.nbytes)[:] = a.reshape(-1).view(np.uint8)

    def dtoh(self, out: np.ndarray, ptr: int) -> None:
        out.reshape(-1).view(np.uint8)[:] = self._view(ptr, out.nbytes)

    def load(self, kernel):
        from ..codegen.cuda_emu import build_emu
        return build_emu(kernel, self.cache_dir)

    def launch(self, handle, kernel, ptrs) -> None:
        handle.launch_ptrs(ptrs)

    def synchronize(self) -> None:
        pass


class PycudaDevice:
    """pycuda on device 0 (primary context), one stream; cubins built by NVRTC for its arch."""

    def __init__(self, cache_dir: str | None = None):
        try:
            import pycuda.driver as cuda
        except ImportError as e:
            raise CudaUnavailableError(
                "target='cuda' needs pycuda and an NVIDIA driver: pip install 'apollo_py[cuda]' "
                f"on a machine with a GPU ({e})") from None
        try:
            cuda.init()
            if cuda.Device.count() < 1:
                raise CudaUnavailableError("target='cuda': the CUDA driver reports no GPU")
            dev = cuda.Device(0)
            self.ctx = dev.retain_primary_context()
            self.ctx.push()
        except cuda.Error as e:
            raise CudaUnavailableError(f"target='cuda': no usable CUDA driver or GPU ({e})") from None
        self.cuda = cuda
        maj, mnr = dev.compute_capability()
        self.arch = f"sm_{maj}{mnr}"
        self.name = f"{dev.name()} ({self.arch})"
        self.cache_dir = cache_dir
        self.stream = cuda.Stream()
        self._mem: dict[int, object] = {}

    def alloc(self, nbytes: int) -> int:
        m = self.cuda.mem_alloc(max(1, nbytes))
        self._mem[int(m)] = m
        return int(m)

    def free(self, ptr: int) -> None:
        m = self._mem.pop(ptr, None)
        if m is not None:
            m.free()

    def htod(self, ptr: int, arr: np.ndarray) -> None:
        self.cuda.memcpy_htod_async(ptr, np.ascontiguousarray(arr), self.stream)

    def dtoh(self, out: np.ndarray, ptr: int) -> None:
        self.cuda.memcpy_dtoh_async(out, ptr, self.stream)
        self.stream.synchronize()

    def load(self, kernel):
        from ..codegen.cached import piece_cache
        from ..codegen.nvrtc import compile_cuda
        b = compile_cuda(kernel.source, kernel.name, self.arch, piece_cache(self.cache_dir))
        mod = self.cuda.module_from_buffer(b.cubin)
        return (mod, mod.get_function(kernel.name))

    def launch(self, handle, kernel, ptrs) -> None:
        handle[1](*[np.uintp(p) for p in ptrs], block=tuple(kernel.block), grid=tuple(kernel.grid),
                  stream=self.stream)

    def synchronize(self) -> None:
        self.stream.synchronize()


# ----------------------------------------------------------------------------- executable


class CudaExecutable:
    """Runs CUDA launches and host steps over one device arena (module docstring)."""

    supports_out = False

    def __init__(self, graph, steps: Sequence, plan, device_factory):
        self.graph = graph
        self.steps = list(steps)
        self.plan = plan
        self._factory = device_factory
        self._device = None
        self._handles: list = []
        import threading
        self._lock = threading.RLock()
        self.constants = {n.outputs[0]: np.array(n.attrs["value"].array, order="C")
                          for n in graph.nodes if n.op == "constant"}
        external = set(graph.inputs) | set(self.constants)
        # the trailing pseudo-step keeps graph outputs alive (their slots are never reused)
        self.memory = plan_memory([(s.inputs, s.outputs) for s in self.steps] + [(tuple(graph.outputs), ())],
                                  {v: graph.types[v].nbytes for s in self.steps for v in (*s.inputs, *s.outputs)},
                                  external)

    @property
    def device(self):
        if self._device is None:
            dev = self._factory()
            self._arena = dev.alloc(self.memory.arena_bytes)
            self._const_ptrs = {}
            for v, a in self.constants.items():
                self._const_ptrs[v] = p = dev.alloc(a.nbytes)
                dev.htod(p, a)
            self._handles = [dev.load(s.kernel) if isinstance(s, Launch) else None for s in self.steps]
            self._device = dev
        return self._device

    def _gemm(self, dev, s, handle, ptrs) -> None:
        """A plain matmul launch: the generated GEMM or cuBLAS, whichever measured faster on
        this device at the first call (the choice shows in ``str(plan)``)."""
        from .cublas import Cublas, choose_gemm
        dtype, batch, m, n, k, sa, sb = s.cublas
        if getattr(self, "_cublas", None) is None:
            self._cublas = Cublas(dev.stream.handle)

        def gen():
            dev.launch(handle, s.kernel, ptrs)

        def blas():
            self._cublas.gemm(dtype, batch, m, n, k, ptrs[0], ptrs[1], ptrs[-1], sa, sb)
        if not s.choice:
            s.choice, tg, tc = choose_gemm(gen, blas, dev)
            s.choice += f" (generated {tg * 1e6:.0f} us, cuBLAS {tc * 1e6:.0f} us)"
        (blas if s.choice.startswith("cublas") else gen)()

    def run(self, feeds: Mapping[str, np.ndarray], out=None) -> list[np.ndarray]:
        """Graph outputs (numpy) for ``feeds``; calls are serialised (one arena per device)."""
        with self._lock:
            return self._run(feeds)

    def _run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        dev = self.device
        types = self.graph.types
        ptr: dict[str, int] = dict(self._const_ptrs)
        for v, s in self.memory.slots.items():
            ptr[v] = self._arena + s.offset
        temps = []
        for v, a in feeds.items():
            cai = getattr(a, "__cuda_array_interface__", None)
            if cai is not None and isinstance(dev, PycudaDevice):
                ptr[v] = int(cai["data"][0])     # a device array: used in place
                continue
            ptr[v] = p = dev.alloc(np.asarray(a).nbytes)
            temps.append(p)
            dev.htod(p, np.asarray(a))
        try:
            for s, h in zip(self.steps, self._handles):
                if isinstance(s, Launch):
                    ptrs = [ptr[v] for v in s.param_values]
                    if s.cublas is not None and isinstance(dev, PycudaDevice):
                        self._gemm(dev, s, h, ptrs)
                    else:
                        dev.launch(h, s.kernel, ptrs)
                    continue
                env = {}
                for v in s.inputs:
                    t = types[v]
                    env[v] = np.empty(t.shape, t.np_dtype)
                    dev.dtoh(env[v], ptr[v])
                run_nodes(s.spec.nodes, env, types)
                for v in s.outputs:
                    if v not in ptr:
                        raise CompileError(f"value {v!r} has no device buffer")
                    dev.htod(ptr[v], np.asarray(env[v], dtype=types[v].np_dtype))
            dev.synchronize()
            result = []
            for v in self.graph.outputs:
                t = types[v]
                a = np.empty(t.shape, t.np_dtype)
                if v in ptr:
                    dev.dtoh(a, ptr[v])
                else:
                    a[...] = feeds[v]
                result.append(a)
            return result
        finally:
            for p in temps:
                dev.free(p)


def cuda_steps(graph, specs, options) -> list:
    """Launches and host steps of ``target="cuda"`` / ``"cuda-emu"`` for layer 1/2's ``specs``.

    Every launch is compiled with NVRTC for sm_80 here, so that ``str(plan)`` shows register /
    shared / local memory use and a source NVRTC rejects fails at compile time, without a GPU;
    the device's own architecture is compiled when the graph first runs."""
    steps = lower_cuda(graph, specs)
    compile_resources(steps, ("sm_80",), options.cache_dir)
    return steps


def cuda_note(steps, options) -> str:
    """The plan's note on a CUDA compile."""
    n = sum(isinstance(s, Launch) for s in steps)
    return (f"{options.target}: {n} CUDA launches, {len(steps) - n} host (numpy) steps; "
            "resources from NVRTC for sm_80")


def build_cuda_executable(graph, steps, plan, options) -> CudaExecutable:
    """The executable of ``target="cuda"`` (pycuda) or ``"cuda-emu"`` (g++ emulation)."""
    cache = options.cache_dir
    factory = (lambda: EmuDevice(cache)) if options.target == "cuda-emu" else (lambda: PycudaDevice(cache))
    return CudaExecutable(graph, steps, plan, factory)
