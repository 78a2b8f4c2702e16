"""CUDA C++ renderer of the loop IR (DESIGN §8), on the shared printer base.

Every generated kernel is one translation unit: :data:`PRELUDE` (types, float16 conversion,
NaN-propagating max/min, warp-shuffle and shared-memory block reductions), one or more
``__device__`` bodies and a ``__global__`` entry.  The same text compiles with NVRTC for the
GPU and, with ``-DAPOLLO_CUDA_EMU`` and ``cuda_emu.h``, with g++ on the CPU, where each block's
threads run as fibers (:mod:`apollo_py.codegen.cuda_emu`), so the numerics of the exact source
are tested without a GPU.

Kernel forms and how they map to the GPU:

* **generic** (:func:`render_generic`, any loop-IR kernel from layer 1): the kernel's outer
  parallel loop, collapsed with the rest of layer 1's coincident band and with perfectly nested
  constant-bound loops under it down to an independent innermost loop (the inner parallel
  dims), is one flat index spread over the grid and the block (grid-stride loop); the rest of
  the body runs per thread.  A kernel without a parallel
  loop (or with statements around it) runs on one thread;
* **reduce forms** and **stitched** row programs: :mod:`apollo_py.codegen.cuda_reduce`;
* **GEMM / implicit-GEMM conv** with the epilogue fused: :mod:`apollo_py.codegen.cuda_gemm`;
* **layer-3 groups**: :func:`render_group` -- one launch whose blocks are split between member
  bodies (APOLLO's parallel stitching).

Every body reads the block index and grid size from ``ap_bid`` / ``ap_nblk`` (its virtual block
range), never ``blockIdx`` / ``gridDim``, which is what lets a group hand each member a slice
of one grid.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from apollo_py.codegen import loopir as L
from apollo_py.codegen.c import CPrinter, _as_block
from apollo_py.errors import CompileError


@dataclass(frozen=True)
class Arch:
    """Limits and launch defaults of one GPU architecture."""

    name: str
    sms: int
    max_threads: int = 1024
    max_static_shared: int = 48 * 1024
    regs_per_sm: int = 65536
    warp: int = 32
    block: int = 256                 # threads of a generic (elementwise) block
    blocks_per_sm: int = 8           # grid-stride kernels launch at most sms * this blocks


#: per-architecture table (A100 = sm_80, H100 = sm_90); block sizes are the usual defaults for
#: memory-bound kernels, not tuned on a GPU (none was available when this was written)
ARCHS = {"sm_80": Arch("sm_80", 108), "sm_90": Arch("sm_90", 132)}


def arch_of(name: str) -> Arch:
    """The :class:`Arch` called ``name`` (CompileError for an unknown one)."""
    try:
        return ARCHS[name]
    except KeyError:
        raise CompileError(f"unknown CUDA architecture {name!r}; known: {', '.join(ARCHS)}") from None


@dataclass(frozen=True)
class CudaKernel:
    """One CUDA translation unit and how to launch its ``__global__`` function ``name``.

    ``params``: (name, dtype, elements) of each pointer argument, in order; ``param_values``:
    the graph values bound to them (set by the lowering); ``form``: what kind of kernel (for
    the plan); ``shared_bytes``: static shared memory the source declares.
    """

    name: str
    source: str
    params: tuple
    grid: tuple
    block: tuple
    form: str
    param_values: tuple = ()
    outputs: tuple = ()
    shared_bytes: int = 0
    bytes: int = 0
    flops: int = 0
    members: tuple = ()          # layer-3 group: member kernel names

    def check(self, arch: Arch) -> None:
        """Raise CompileError unless the launch fits ``arch``'s limits."""
        threads = self.block[0] * self.block[1] * self.block[2]
        if threads > arch.max_threads or threads < 1:
            raise CompileError(f"kernel {self.name!r}: block {self.block} has {threads} threads "
                               f"(limit {arch.max_threads} on {arch.name})")
        if self.shared_bytes > arch.max_static_shared:
            raise CompileError(f"kernel {self.name!r}: {self.shared_bytes} B of shared memory "
                               f"(limit {arch.max_static_shared} on {arch.name})")
        if any(g < 1 or g > 2 ** 31 - 1 for g in self.grid):
            raise CompileError(f"kernel {self.name!r}: grid {self.grid} out of range")

    def to_dict(self) -> dict:
        return {"name": self.name, "form": self.form, "grid": list(self.grid), "block": list(self.block),
                "params": [list(p) for p in self.params], "values": list(self.param_values),
                "shared_bytes": self.shared_bytes, "members": list(self.members)}


PRELUDE = r"""// apollo_py CUDA prelude (NVRTC, or g++ with -DAPOLLO_CUDA_EMU and cuda_emu.h)
#ifdef APOLLO_CUDA_EMU
#include "cuda_emu.h"
#else
typedef signed char int8_t; typedef short int16_t; typedef int int32_t; typedef long long int64_t;
typedef unsigned char uint8_t; typedef unsigned short uint16_t; typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
struct ap_half { unsigned short x; };
__device__ __forceinline__ float ap_h2f(ap_half h) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x)); return f; }
__device__ __forceinline__ ap_half ap_f2h(float f) {
    ap_half h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.x) : "f"(f)); return h; }
#define AP_NAN __int_as_float(0x7fc00000)
#define AP_INF __int_as_float(0x7f800000)
#endif
#ifndef INT64_C
#define INT64_C(x) x##LL
#endif
#ifndef NAN
#define NAN AP_NAN
#define INFINITY AP_INF
#endif
__device__ __forceinline__ float ap_round_f16(float x) { return ap_h2f(ap_f2h(x)); }
#define AP_MAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define AP_MIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define AP_IMAX(a, b) ((a) > (b) ? (a) : (b))
#define AP_IMIN(a, b) ((a) < (b) ? (a) : (b))
struct ap_op_sum { template <class T> __device__ T operator()(T a, T b) const { return a + b; } };
struct ap_op_prod { template <class T> __device__ T operator()(T a, T b) const { return a * b; } };
struct ap_op_max { template <class T> __device__ T operator()(T a, T b) const { return AP_MAX(a, b); } };
struct ap_op_min { template <class T> __device__ T operator()(T a, T b) const { return AP_MIN(a, b); } };
// butterfly over the 32 lanes: every lane ends with the warp's result, combined in the same
// order on every lane (deterministic)
template <class T, class F> __device__ __forceinline__ T ap_warp_reduce(T v, F f) {
    for (int o = 16; o > 0; o >>= 1) v = f(v, (T)__shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// x-reduce / all-reduce: the BS threads of a 1-d block; warp results go through shared memory
// and every warp folds them again, so every thread returns the block's result
template <int BS, class T, class F> __device__ T ap_block_reduce(T v, F f, T ident) {
    __shared__ T ap_red[BS / 32 > 0 ? BS / 32 : 1];
    v = ap_warp_reduce(v, f);
    if (BS > 32) {
        const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
        if (lane == 0) ap_red[w] = v;
        __syncthreads();
        v = lane < BS / 32 ? ap_red[lane] : ident;
        v = ap_warp_reduce(v, f);
        __syncthreads();            // ap_red is reused by the next reduction
    }
    return v;
}
// y-reduce: a (32 x BY) block, threadIdx.y splits the reduced rows; column partials are folded
// in threadIdx.y order through shared memory and every thread returns its column's result
template <int BY, class T, class F> __device__ T ap_column_reduce(T v, F f) {
    __shared__ T ap_col[BY][33];
    ap_col[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    T r = ap_col[0][threadIdx.x];
    for (int y = 1; y < BY; ++y) r = f(r, ap_col[y][threadIdx.x]);
    __syncthreads();
    return r;
}
"""

#: C / C++ keywords and CUDA built-ins a graph value name may spell (``and``, ``not``, ``new``,
#: ``threadIdx`` ...): :func:`cname` renames them, since loop-IR names are only identifiers
RESERVED = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char16_t char32_t char8_t
class co_await co_return co_yield compl concept const const_cast consteval constexpr constinit continue
decltype default delete do double dynamic_cast else enum explicit export extern false float for friend
goto if inline int long mutable namespace new noexcept not not_eq nullptr operator or or_eq private
protected public register reinterpret_cast requires restrict return short signed sizeof static
static_assert static_cast struct switch template this thread_local throw true try typedef typeid
typename union unsigned using virtual void volatile wchar_t while xor xor_eq
threadIdx blockIdx blockDim gridDim warpSize main NAN INFINITY
""".split())


def cname(name: str) -> str:
    """``name`` as a CUDA C++ identifier (reserved words and ``__`` names get a ``_`` suffix;
    the renderer's own names start with ``ap_``)."""
    return name + "_" if name in RESERVED or name.startswith("__") else name


_CUDA_TYPES = {"float32": "float", "float64": "double", "float16": "ap_half", "bool": "bool",
               **{d: d + "_t" for d in L.INT_DTYPES}}


class CudaPrinter(CPrinter):
    """Renders loop-IR statements and expressions as CUDA C++ (device code).

    Only the entries that differ from C99 are overridden: float16 is the prelude's ``ap_half``
    (storage only, converted with ``cvt`` instructions), ``round_f16`` goes through it, loops
    carry ``#pragma unroll`` instead of GCC pragmas, and ``__restrict__`` replaces ``restrict``.
    """

    target = "cuda"
    supports_gpu_loops = True
    unary_ops = dict(CPrinter.unary_ops)
    unary_ops[("round_f16", "float32")] = "ap_round_f16({a})"

    def type_name(self, dtype: str) -> str:
        return _CUDA_TYPES[dtype]

    def expr_Var(self, e: L.Var, index: bool) -> str:
        return cname(e.name)

    def expr_Load(self, e: L.Load, index: bool) -> str:
        ref = f"{cname(e.buf.name)}[{self.expr(e.index, True)}]"
        return f"ap_h2f({ref})" if e.buf.dtype == "float16" else ref

    def stmt_Local(self, s: L.Local) -> None:
        self.line(f"{self.type_name(s.dtype)} {cname(s.name)} = {self.expr(s.init)};")

    def stmt_Assign(self, s: L.Assign) -> None:
        self.line(f"{cname(s.name)} = {self.expr(s.value)};")

    def stmt_Store(self, s: L.Store) -> None:
        v = self.expr(s.value)
        if s.buf.dtype == "float16":
            v = f"ap_f2h({v})"
        self.line(f"{cname(s.buf.name)}[{self.expr(s.index, True)}] = {v};")

    def stmt_Alloc(self, s: L.Alloc) -> None:
        scope = "__shared__ " if s.scope == "shared" else ""
        self.line(f"{scope}{self.type_name(s.dtype)} {cname(s.name)}[{int(s.size)}];")

    def stmt_For(self, s: L.For) -> None:
        v, t = cname(s.var.name), self.type_name(s.var.dtype)
        self.line("{")
        self.depth += 1
        lo, hi = self.expr(s.lo, True), self.expr(s.hi, True)
        self.line(f"const {t} {v}_lo = {lo}, {v}_hi = {hi};")
        if s.kind == "unroll":
            self.line("#pragma unroll")
        self.line(f"for ({t} {v} = {v}_lo; {v} < {v}_hi; ++{v})")
        self.stmt(_as_block(s.body))
        self.depth -= 1
        self.line("}")

    def body_text(self, stmts) -> str:
        """CUDA text of loop-IR statements ``stmts`` at the current depth."""
        start = len(self.lines)
        for s in stmts:
            self.stmt(s)
        text = "\n".join(self.lines[start:])
        del self.lines[start:]
        return text

    def signature(self, params, restrict: bool = True) -> str:
        r = " __restrict__" if restrict else ""
        return ", ".join(f"{self.type_name(p.dtype)}*{r} {cname(p.name)}" for p in params)


def param_decls(params) -> tuple:
    """(name, dtype, elements) of loop-IR Params."""
    return tuple((p.name, p.dtype, int(p.size)) for p in params)


def entry(name: str, params, block: tuple, printer: CudaPrinter) -> str:
    """The ``__global__`` entry calling body ``<name>_body`` with the whole grid."""
    threads = block[0] * block[1] * block[2]
    args = ", ".join(cname(p.name) for p in params)
    return (f'extern "C" __global__ void __launch_bounds__({threads}) {name}({printer.signature(params)})\n'
            f"{{\n    {name}_body({args}{', ' if args else ''}(int64_t)blockIdx.x, (int64_t)gridDim.x);\n}}\n"
            + emu_entry(name, [(p.name, p.dtype) for p in params]))


def emu_entry(name: str, params) -> str:
    """The host entry ``<name>_emu(void **args, const long long *dims)`` of the emulation build
    (grid x, y, z then block x, y, z in ``dims``); absent from the NVRTC build."""
    casts = ", ".join(f"({_CUDA_TYPES[dt]}*)a[{i}]" for i, (_, dt) in enumerate(params))
    return (f'#ifdef APOLLO_CUDA_EMU\nextern "C" void {name}_emu(void **a, const long long *d)\n'
            f"{{\n    apemu::launch(d, [&] {{ {name}({casts}); }});\n}}\n#endif\n")


def device_body(name: str, params, text: str, printer: CudaPrinter) -> str:
    """A ``__device__`` body taking the params and its virtual block range."""
    sig = printer.signature(params)
    return (f"__device__ __forceinline__ void {name}_body({sig}{', ' if sig else ''}"
            f"const int64_t ap_bid, const int64_t ap_nblk)\n{{\n{text}\n}}\n")


# --------------------------------------------------------------------------- generic kernels


def _top(k: L.Kernel) -> list:
    body = k.body.stmts if isinstance(k.body, L.Block) else (k.body,)
    out = []
    for s in body:
        if isinstance(s, L.Block):
            out.extend(s.stmts)
        else:
            out.append(s)
    return out


def _collapse(loop: L.For, depth: int = 1) -> tuple[list, L.Stmt]:
    """The chain of loops from ``loop`` that one flat index can replace, and the body under it.

    The first ``depth`` loops of a perfect nest with constant bounds are taken (layer 1's
    coincident band: its iterations are independent).  Below them the chain goes on while a
    loop's body is exactly one For with constant bounds, and is kept if it ends at a ``vector``
    loop (layer 1 marks a loop vector when its iterations are independent: stores indexed by
    it, no scalar assignments) or an innermost loop :func:`_independent` accepts.
    """
    chain, s = [loop], loop.body
    while len(chain) < depth:
        inner = s.stmts[0] if isinstance(s, L.Block) and len(s.stmts) == 1 else s
        if not (isinstance(inner, L.For) and isinstance(inner.lo, L.Const) and isinstance(inner.hi, L.Const)):
            break
        chain.append(inner)
        s = inner.body
    base, base_body = list(chain), s
    while True:
        inner = s.stmts[0] if isinstance(s, L.Block) and len(s.stmts) == 1 else s
        if isinstance(inner, L.For) and isinstance(inner.lo, L.Const) and isinstance(inner.hi, L.Const) \
                and inner.kind in ("vector", "serial", "unroll"):
            chain.append(inner)
            if inner.kind == "vector" or _independent(inner):
                return chain, inner.body
            s = inner.body
            continue
        break
    return base, base_body


def _independent(loop: L.For) -> bool:
    """Whether the iterations of innermost ``loop`` are independent although layer 1 left it
    serial (it assigns scalar temporaries): every Local is written before it is read in the
    body, every store goes to a param at an index that mentions the loop variable, and no
    stored buffer is read."""
    body = loop.body.stmts if isinstance(loop.body, L.Block) else (loop.body,)
    written, stored = set(), set()
    for st in body:
        if not isinstance(st, (L.Assign, L.Store)):
            return False
        reads = {e.name for e in L.walk(st.value) if isinstance(e, L.Var)}
        if isinstance(st, L.Store):
            reads |= {e.name for e in L.walk(st.index) if isinstance(e, L.Var)}
            if not isinstance(st.buf, L.Param) or loop.var.name not in reads:
                return False
            stored.add(st.buf.name)
        if any(isinstance(e, L.Load) and e.buf.name in stored for e in L.walk(st)):
            return False
        assigned_later = {x.name for x in body if isinstance(x, L.Assign)} - written
        if reads & assigned_later:
            return False
        if isinstance(st, L.Assign):
            written.add(st.name)
    return True


def render_generic(k: L.Kernel, arch: Arch = ARCHS["sm_80"], parallel_depth: int = 1) -> CudaKernel:
    """Render a layer-1 loop-IR kernel as a grid-stride CUDA kernel (module docstring).

    ``parallel_depth``: how many outer loops of the nest are parallel (layer 1's coincident
    band depth, ``FusedKernel.parallel_dims``; 1 = only the kernel's parallel loop)."""
    p = CudaPrinter()
    p.check_kernel(k)
    top = _top(k)
    decls = [s for s in top if isinstance(s, (L.Local, L.Alloc))]
    rest = [s for s in top if not isinstance(s, (L.Local, L.Alloc))]
    par = p.find_parallel_loop(k)
    p.depth = 1
    if par is not None and len(rest) == 1 and rest[0] is par and isinstance(par.lo, L.Const) \
            and isinstance(par.hi, L.Const):
        chain, body = _collapse(par, max(1, parallel_depth))
        if not all(isinstance(f.lo, L.Const) and isinstance(f.hi, L.Const) for f in chain):
            chain, body = [par], par.body
        extents = [int(f.hi.value) - int(f.lo.value) for f in chain]
        total = 1
        for e in extents:
            total *= max(e, 0)
        p.lines.append("    const int64_t ap_tid = ap_bid * (int64_t)blockDim.x + threadIdx.x;")
        p.lines.append("    const int64_t ap_step = ap_nblk * (int64_t)blockDim.x;")
        for d in decls:
            p.stmt(d)
        p.line(f"for (int64_t ap_i = ap_tid; ap_i < INT64_C({total}); ap_i += ap_step) {{")
        p.depth += 1
        rem = "ap_i"
        for f, e in reversed(list(zip(chain, extents))):
            p.line(f"const int64_t {cname(f.var.name)} = INT64_C({int(f.lo.value)}) + {rem} % INT64_C({e});")
            rem = f"({rem} / INT64_C({e}))"
        p.stmt(_as_block(body))
        p.depth -= 1
        p.line("}")
        block = (arch.block, 1, 1)
        grid = (max(1, min(-(-total // arch.block), arch.sms * arch.blocks_per_sm)), 1, 1)
        # elementwise: one thread per output element; parallel band: one thread per point of the
        # coincident band, the loops under it (window / transposed reductions) run per thread
        form = "elementwise" if not _has_inner_loops(body) else f"parallel band ({len(chain)} dims)"
    else:
        # no flat parallel loop: one thread runs the kernel (correct for every loop nest)
        p.line("if (ap_bid != 0 || threadIdx.x != 0) return;")
        p.stmt(k.body)
        block, grid, form = (32, 1, 1), (1, 1, 1), "serial"
    text = "\n".join(p.lines)
    src = PRELUDE + "\n" + device_body(k.name, k.params, text, p) + entry(k.name, k.params, block, p)
    ck = CudaKernel(k.name, src, param_decls(k.params), grid, block, form)
    ck.check(arch)
    return ck


def _has_inner_loops(s) -> bool:
    return any(isinstance(x, L.For) for x in L.walk(s))


# --------------------------------------------------------------------------- layer-3 groups


def render_group(name: str, members, bodies, arch: Arch = ARCHS["sm_80"]) -> CudaKernel:
    """One launch running independent ``members`` (CudaKernels of one block shape) side by side.

    ``bodies[i]`` is member ``i``'s device source (``<member>_body`` definitions, see
    :func:`device_body`), as the member renderers return it in ``CudaKernel.source`` after the
    prelude.  Blocks ``[g_0 + ... + g_{i-1}, ... + g_i)`` of the grid run member ``i`` with its
    own grid size ``g_i``; parameters are the members' params, renamed ``m<i>_<name>``.
    """
    shapes = {m.block for m in members}
    if len(shapes) != 1:
        raise CompileError(f"layer-3 group {name!r}: members have different block shapes {sorted(shapes)}")
    block = members[0].block
    sig, lines, off = [], [], 0
    for i, m in enumerate(members):
        g = m.grid[0] * m.grid[1] * m.grid[2]
        if m.grid[1] != 1 or m.grid[2] != 1:
            raise CompileError(f"layer-3 group {name!r}: member {m.name!r} has a multi-dimensional grid")
        args = []
        for pn, dt, _ in m.params:
            sig.append(f"{_CUDA_TYPES[dt]}* __restrict__ m{i}_{pn}")
            args.append(f"m{i}_{pn}")
        cond = "if" if i == 0 else "else if"
        lines.append(f"    {cond} (blockIdx.x < {off + g}) m{i}_{m.name}_body({', '.join(args)}"
                     f"{', ' if args else ''}(int64_t)blockIdx.x - {off}, (int64_t){g});")
        off += g
    threads = block[0] * block[1] * block[2]
    # members may share a name (layer 1 memoises identical nests): each body gets its own prefix
    src = PRELUDE + "\n" + "\n".join(bodies[i].replace(f" {m.name}_body(", f" m{i}_{m.name}_body(")
                                      for i, m in enumerate(members)) + \
        f'extern "C" __global__ void __launch_bounds__({threads}) {name}({", ".join(sig)})\n{{\n' + \
        "\n".join(lines) + "\n}\n"
    src += emu_entry(name, [(f"m{i}_{pn}", dt) for i, m in enumerate(members) for pn, dt, _ in m.params])
    params = tuple((f"m{i}_{pn}", dt, n) for i, m in enumerate(members) for pn, dt, n in m.params)
    ck = CudaKernel(name, src, params, (off, 1, 1), block, "parallel-stitched",
                    shared_bytes=max(m.shared_bytes for m in members),
                    members=tuple(m.name for m in members))
    ck.check(arch)
    return ck


def body_of(k: CudaKernel) -> str:
    """The device part of a rendered kernel (its source without the prelude and the entry)."""
    src = k.source[len(PRELUDE):]
    cut = src.rfind('extern "C" __global__')
    return src[:cut]
