"""How late the thread pool's worker joins a lent call, and what a second thread gives a conv step.

    python benchmarks/pool_wake.py [--rounds 200] [--gaps 0 0.1 1 10]

Why: the quiet-box per-step profiles (2 threads, 11:09 UTC 2026-11-25) have RegNetY's grouped
3x3 convs (row-reading kernel, run on the pool) at 0.143 ms (336 channels 14x14), 0.151 ms
(120ch 28x28), 0.222 ms (48ch 56x56) and 0.355 ms (48ch 112x112 stride 2), while the same
kernels take 0.13-0.14, 0.18, 0.27 and 0.35 ms on ONE thread (measured on the shared box,
where one thread is the robust figure).  If two threads split the work from a start ``delta``
late, ``T2 = (T1 + delta) / 2``: ``delta`` = 2 T2 - T1 comes out at 0.12-0.35 ms -- the pool's
worker contributes little to steps of that length.  On the loaded box the worker joined 4-20 us
after the caller (both of its vCPUs busy, so never idle).  This script measures the two things
on the machine it runs on:

1. the worker's start delay: a native probe function lent to the worker (``ThreadPool.lend``)
   stores its cycle counter; the caller's own call stores its own and waits for the worker's;
   between calls the process sleeps ``gap`` ms (an idle machine halts the idle vCPU; a model
   runs Python between its pool steps);
2. RegNetY's 336-channel 14x14 grouped conv (row-reading kernel) on one thread and on the
   pool of two, back to back and with the same gaps between calls.

Run it on an idle machine: on a loaded one both numbers say only how busy the other core is.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from dataclasses import replace

import numpy as np

_PROBE = r"""
declare i64 @llvm.readcyclecounter()
define void @probe(ptr %args, i64 %lo, i64 %hi) {
entry:
  %p = load ptr, ptr %args
  %p1 = getelementptr i64, ptr %p, i64 1
  %t = call i64 @llvm.readcyclecounter()
  %w = icmp eq i64 %lo, 1
  br i1 %w, label %worker, label %caller
worker:
  store atomic i64 %t, ptr %p1 release, align 8
  ret void
caller:
  store i64 %t, ptr %p
  br label %spin
spin:
  %v = load atomic i64, ptr %p1 acquire, align 8
  %now = call i64 @llvm.readcyclecounter()
  %el = sub i64 %now, %t
  %late = icmp ugt i64 %el, 400000000
  %got = icmp ne i64 %v, 0
  %stop = or i1 %late, %got
  br i1 %stop, label %out, label %spin
out:
  ret void
}
"""


def _probe():
    from apollo_py.codegen.compiled import KERNEL_CFUNCTYPE
    from apollo_py.codegen.llvm import host
    llvm = host().llvm
    mod = llvm.parse_assembly(_PROBE)
    eng = llvm.create_mcjit_compiler(mod, host().target_machine())
    eng.finalize_object()
    return eng, KERNEL_CFUNCTYPE(eng.get_function_address("probe"))


def wake_delays(pool, rounds: int, gap_ms: float) -> np.ndarray:
    """Worker start minus caller start of a lent call, microseconds, ``rounds`` times."""
    eng, f = _probe()
    buf = np.zeros(2, np.int64)
    ptrs = (ctypes.c_void_p * 1)(buf.ctypes.data)
    one = np.zeros(2, np.int64)
    p1 = (ctypes.c_void_p * 1)(one.ctypes.data)
    f(p1, 1, 2)
    c0, t0 = int(one[1]), time.perf_counter()
    time.sleep(0.2)
    f(p1, 1, 2)
    ghz = (int(one[1]) - c0) / (time.perf_counter() - t0) / 1e9
    out = []
    for _ in range(rounds):
        buf[:] = 0
        pool.lend(f, ptrs, 1, 2, buf)
        f(ptrs, 0, 1)
        out.append((buf[1] - buf[0]) / ghz / 1e3 if buf[1] else np.nan)
        if gap_ms:
            time.sleep(gap_ms / 1e3)
    del eng
    return np.array(out)


def conv_times(pool, rounds: int, gap_ms: float) -> tuple:
    """Median one-thread and pool times (ms) of RegNetY's grouped 336-channel 14x14 conv."""
    from apollo_py.codegen.conv_rows import compile_conv_rows
    from apollo_py.codegen.gemm import conv_desc
    d = conv_desc("gemm_c", (1, 336, 14, 14), (336, 24, 3, 3), (1, 336, 14, 14),
                  dict(group=14, strides=(1, 1), pads=(1, 1, 1, 1), dilations=(1, 1)), "y")
    cr = compile_conv_rows(replace(d, a_const=True, outputs=("y",), out_dtypes=("float32",)), 2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 336, 14, 14)).astype(np.float32)
    w = rng.standard_normal((336, 24, 3, 3)).astype(np.float32)
    y = np.empty((1, 336, 14, 14), np.float32)
    res = {None: [], pool: []}
    for r in range(rounds):
        for p in ((None, pool) if r % 2 else (pool, None)):
            t0 = time.perf_counter()
            cr.run(p, w, x, [], [y])
            res[p].append(time.perf_counter() - t0)
            if gap_ms:
                time.sleep(gap_ms / 1e3)
    return float(np.median(res[None]) * 1e3), float(np.median(res[pool]) * 1e3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--gaps", type=float, nargs="*", default=[0.0, 0.1, 1.0, 10.0])
    args = ap.parse_args(argv)
    from apollo_py.runtime.threadpool import ThreadPool
    pool = ThreadPool(2)
    print("load %.2f %.2f %.2f" % os.getloadavg())
    for gap in args.gaps:
        d = wake_delays(pool, args.rounds, gap)
        one, two = conv_times(pool, max(20, args.rounds // 4), gap)
        print(f"gap {gap:5.1f} ms: worker start delay us median {np.nanmedian(d):7.1f} p90 {np.nanpercentile(d, 90):7.1f}"
              f" (missed {int(np.isnan(d).sum())});  grouped conv 336x14x14: 1 thread {one:.3f} ms, pool {two:.3f} ms"
              f" (delta = 2 T2 - T1 = {2 * two - one:.3f} ms)", flush=True)
    print("load %.2f %.2f %.2f" % os.getloadavg())
    pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
