"""The float32 compute peak of this CPU, measured with a generated FMA loop (machine.py).

numpy's BLAS is no measure of the machine: its kernel is whatever the BLAS build picked (an
OpenBLAS forced to its Haswell kernel runs AVX2 on an AVX-512 core, half of what the core
does).  :func:`fma_rate` JIT-compiles a loop of independent multiply-add chains on the widest
vectors the host's features allow (AVX-512: 16 lanes, 24 chains in 32 registers; AVX2 + FMA:
8 lanes, 12 chains in 16 registers; else 4 lanes, multiply then add) and runs it on
``threads`` threads at once (a ctypes call releases the GIL), so the figure is what the
generated kernels can reach with every core busy: 2 FMA pipes x FMA latency 4 need 8 chains
in flight; 24 / 12 leave slack for a longer latency.
"""
from __future__ import annotations

import ctypes
import threading
import time

_FN: dict = {}
_FN_LOCK = threading.Lock()


def _shape() -> tuple[int, int, bool]:
    """(lanes, chains, fma) for the host's widest float32 vectors."""
    from .llvm import host
    feats = host().features.split(",")
    if "+avx512f" in feats:
        return 16, 24, True
    if "+avx2" in feats and "+fma" in feats:
        return 8, 12, True
    return 4, 8, "+fma" in feats or "+neon" in feats


def _ir(lanes: int, chains: int, fma: bool, attrs: str) -> str:
    vt = f"<{lanes} x float>"
    one = ", ".join(["float 0x3FEFFFFFC0000000"] * lanes)      # 0.99999988: the chains stay finite
    inc = ", ".join(["float 0x3E7AD7F2A0000000"] * lanes)      # 1e-7
    s = [f"declare {vt} @llvm.fma.v{lanes}f32({vt}, {vt}, {vt})",
         f"define float @apollo_fma_peak(i64 %n) #0 {{", "entry:", "  br label %loop", "loop:",
         "  %i = phi i64 [0, %entry], [%i1, %loop]"]
    for c in range(chains):
        s.append(f"  %a{c} = phi {vt} [<{inc}>, %entry], [%b{c}, %loop]")
    for c in range(chains):
        if fma:
            s.append(f"  %b{c} = call {vt} @llvm.fma.v{lanes}f32({vt} %a{c}, {vt} <{one}>, {vt} <{inc}>)")
        else:
            s += [f"  %m{c} = fmul {vt} %a{c}, <{one}>", f"  %b{c} = fadd {vt} %m{c}, <{inc}>"]
    s += ["  %i1 = add i64 %i, 1", "  %c = icmp slt i64 %i1, %n", "  br i1 %c, label %loop, label %exit",
          "exit:"]
    acc = "%b0"
    for c in range(1, chains):      # a data dependence on every chain: none is optimised away
        s.append(f"  %s{c} = fadd {vt} {acc}, %b{c}")
        acc = f"%s{c}"
    s += [f"  %r = extractelement {vt} {acc}, i64 0", "  ret float %r", "}",
          f"attributes #0 = {{ nounwind {attrs} }}"]
    return "\n".join(s)


def _compiled():
    """(ctypes function, flops per iteration), compiled once per process.  Two threads that
    measure the machine at once share one engine: a second compile replacing the first while
    its loop still runs freed the code under it (a segfault seen under load)."""
    with _FN_LOCK:
        if "fn" not in _FN:
            from .llvm import _compile_lock, host
            h = host()
            lanes, chains, fma = _shape()
            with _compile_lock:
                mod = h.llvm.parse_assembly(_ir(lanes, chains, fma, h.cpu_attrs))
                mod.verify()
                engine = h.llvm.create_mcjit_compiler(mod, h.target_machine())
                engine.finalize_object()
            fn = ctypes.CFUNCTYPE(ctypes.c_float, ctypes.c_int64)(engine.get_function_address("apollo_fma_peak"))
            _FN.update(fn=fn, engine=engine, flops=2 * lanes * chains, lanes=lanes)
        return _FN["fn"], _FN["flops"]


def fma_rate(threads: int, seconds: float = 0.01) -> float:
    """float32 flop/s of the FMA loop on ``threads`` threads at once, each running about
    ``seconds`` of CPU time (one sample: the caller keeps the best of several).  Each thread's
    rate is its flops over its own CPU time: a neighbour that takes the core for a while
    stretches the wall time, not what the core does while it runs."""
    fn, flops = _compiled()
    fn(1000)
    t = time.thread_time()
    fn(200_000)
    per = max(time.thread_time() - t, 1e-6) / 200_000
    n = max(1000, int(seconds / per))
    start = threading.Barrier(threads)
    rates = [0.0] * threads

    def work(q):
        start.wait()
        t0 = time.thread_time()
        fn(n)
        rates[q] = n * flops / max(time.thread_time() - t0, 1e-9)
    pool = [threading.Thread(target=work, args=(q,)) for q in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    return sum(rates)


def peak_probe(threads: int) -> tuple[float, str]:
    """machine.py's peak probe: (:func:`fma_rate` on ``threads`` threads, what was measured)."""
    rate = fma_rate(threads)
    return rate, f"fma loop, {lanes()} float32 lanes, {threads} threads, per-thread CPU time"


def lanes() -> int:
    """float32 lanes of the vectors the peak loop uses."""
    _compiled()
    return _FN["lanes"]
