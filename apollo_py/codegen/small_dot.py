"""Batched products of tiny matrices as dot products: DLRM's feature interaction.

DLRM multiplies its ``[B, F, d]`` stack of feature vectors with its own transpose (``[64, 9, 64]
@ [64, 64, 9]`` in the zoo) and keeps the result transposed ``[F, F, B]`` for the pairs it
gathers.  The generated GEMM (codegen/gemm.py) runs that as 64 tiles of one 9-row panel each,
and per tile packs the transposed right operand (a strided copy), runs a 16-column micro-kernel
whose columns are 9/16 useful and stores through a scratch tile: 24.6 us on one core for
0.66 MFLOP (27 GFLOP/s), 12% of the whole model's time.

Here each output element is a dot product of two rows that are contiguous along K (a row of A
and a row of B's transposed source), and the lanes of a vector are ``VL`` consecutive batches:
a *group* ``(i, j, b0)`` accumulates, per batch ``b0 + l``, the products of its two rows ``VL``
floats at a time into accumulator ``l`` (``VL`` accumulators, K / VL fused multiply-adds each),
then reduces the ``VL`` accumulators to one vector whose lane ``l`` is batch ``b0 + l``'s sum --
a butterfly of log2(VL) rounds of two-source shuffles and adds, 15 adds for 16 sums instead of
16 full horizontal reductions -- and stores that vector where the batch index is the
innermost stored dimension (``out_perm`` puts it last, as DLRM's exporters do): one contiguous
store of VL results.  Nothing is packed and no scratch is written.

Shapes taken (:func:`dot_reason`): float32, no epilogue, one batch dim with A and B indexed one
to one, ``batch`` and ``K`` multiples of the vector width, ``M * N <= MAX_MN``, A's and B's
transposed rows contiguous (A contiguous or a view with unit K stride; B a view with unit K
stride, i.e. the transpose of a row-major ``[N, K]``), the result stored with the batch
innermost.  Anything else stays on the generated GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from apollo_py.codegen import loopir as L
from apollo_py.codegen.compiled import CompiledKernelBase
from apollo_py.errors import CompileError

#: largest ``M * N`` taken: the group count grows with it, and past a few hundred dot products a
#: row pair the GEMM's register tiles (each A element reused NR times) do fewer loads
MAX_MN = 256
#: largest K taken (K / VL accumulating fused multiply-adds per lane)
MAX_K = 1024


def _vl() -> int:
    from apollo_py.codegen.gemm import host_blocking
    return host_blocking().vl


@dataclass(frozen=True)
class DotPlan:
    """Element strides of a small-dot product: ``A[b, i, k]`` at ``b * a_bs + i * a_is + k``,
    ``B[b, k, j]`` at ``b * b_bs + j * b_js + k``, ``C[b, i, j]`` stored at ``b + i * o_is + j *
    o_js``; ``vl`` lanes (batches) a group; the source sizes in elements."""

    name: str
    batch: int
    m: int
    n: int
    k: int
    a_bs: int
    a_is: int
    b_bs: int
    b_js: int
    o_is: int
    o_js: int
    vl: int
    a_size: int
    b_size: int

    @property
    def groups(self) -> int:
        """The kernel's parallel extent: ``(batch / vl) * M * N`` groups of ``vl`` results."""
        return self.batch // self.vl * self.m * self.n


def _stored_strides(out_shape: tuple, perm) -> tuple:
    """Element strides of each logical dim of C in its stored (``transpose(C, perm)``) layout."""
    perm = tuple(perm) if perm is not None else tuple(range(len(out_shape)))
    strides, acc = [0] * len(out_shape), 1
    for pos in range(len(perm) - 1, -1, -1):
        strides[perm[pos]] = acc
        acc *= out_shape[perm[pos]]
    return tuple(strides)


def dot_plan(d, vl: int | None = None):
    """``(DotPlan, "")`` when GemmDesc ``d`` is a small-dot product (module docstring), else
    ``(None, why not)``."""
    vl = vl or _vl()
    if d.conv is not None or d.nodes or d.parts or len(d.outputs) != 1 or tuple(d.out_dtypes) != ("float32",):
        return None, "not a plain float32 matmul"
    if d.a_const or d.b_const:
        return None, "a constant operand (packed once by the GEMM)"
    if len(d.out_shape) != 3 or d.out_shape != (d.batch, d.m, d.n):
        return None, "not one batch dim"
    if d.batch % vl or d.k % vl or d.k > MAX_K or d.m * d.n > MAX_MN:
        return None, f"sizes (batch and K multiples of {vl}, K <= {MAX_K}, M * N <= {MAX_MN})"
    ident = tuple(range(d.batch))
    if tuple(d.a_index) != ident or tuple(d.b_index) != ident:
        return None, "A and B not one matrix per batch"
    if d.a_view is None:
        a_bs, a_is, a_size = d.m * d.k, d.k, d.batch * d.m * d.k
    elif len(d.a_view.shape) == 3 and d.a_view.strides[2] == 1:
        a_bs, a_is, a_size = d.a_view.strides[0], d.a_view.strides[1], d.a_view.size
    else:
        return None, "A's rows not contiguous"
    bv = d.b_view
    if bv is None or len(bv.shape) != 3 or bv.strides[1] != 1:
        return None, "B not the transpose of row-major rows"
    o = _stored_strides(d.out_shape, d.out_perm)
    if o[0] != 1:
        return None, "result not stored batch-innermost"
    return DotPlan(d.name, d.batch, d.m, d.n, d.k, a_bs, a_is, bv.strides[0], bv.strides[2], o[1], o[2], vl,
                   a_size, bv.size), ""


def _butterfly(names: list, vl: int, ty: str) -> tuple[list, str]:
    """IR lines reducing ``vl`` vectors ``names`` to one whose lane ``l`` is the sum of vector
    ``l``: per round, pairs of vectors whose lanes hold blocks of ``w`` partial sums (one block
    per original vector, in order) become one with blocks of ``w / 2``: the first and second
    halves of every block gathered by two shuffles and added."""
    lines, vs, w, r = [], list(names), vl, 0
    while len(vs) > 1:
        h = w // 2
        blocks = vl // w
        lo = [src * vl + q * w + t for src in (0, 1) for q in range(blocks) for t in range(h)]
        hi = [x + h for x in lo]
        out = []
        for p in range(len(vs) // 2):
            x, y, z = vs[2 * p], vs[2 * p + 1], f"%r{r}_{p}"
            for nm, mask in (("lo", lo), ("hi", hi)):
                m = ", ".join(f"i32 {v}" for v in mask)
                lines.append(f"  {z}{nm} = shufflevector {ty} {x}, {ty} {y}, <{vl} x i32> <{m}>")
            lines.append(f"  {z} = fadd {ty} {z}lo, {z}hi")
            out.append(z)
        vs, w, r = out, h, r + 1
    return lines, vs[0]


def dot_ir(p: DotPlan) -> str:
    """LLVM IR of ``@<name>(args, lo, hi)``: args A, B's source, C's stored buffer; groups
    ``[lo, hi)``, group ``g = (b0 / vl) * M * N + i * N + j``."""
    vl, ty = p.vl, f"<{p.vl} x float>"
    mn = p.m * p.n
    s = [f"define void @{p.name}(ptr %args, i64 %lo, i64 %hi) #0 {{", "entry:",
         "  %a = load ptr, ptr %args",
         "  %g1 = getelementptr ptr, ptr %args, i64 1", "  %b = load ptr, ptr %g1",
         "  %g2 = getelementptr ptr, ptr %args, i64 2", "  %o = load ptr, ptr %g2",
         "  br label %gcond",
         "gcond:", "  %g = phi i64 [%lo, %entry], [%gn, %red]",
         "  %gc = icmp slt i64 %g, %hi", "  br i1 %gc, label %gbody, label %done",
         "gbody:",
         f"  %bblk = udiv i64 %g, {mn}", f"  %ij = urem i64 %g, {mn}",
         f"  %i = udiv i64 %ij, {p.n}", f"  %j = urem i64 %ij, {p.n}",
         f"  %b0 = mul i64 %bblk, {vl}",
         f"  %ab = mul i64 %b0, {p.a_bs}", f"  %ai = mul i64 %i, {p.a_is}", "  %aoff = add i64 %ab, %ai",
         f"  %bb = mul i64 %b0, {p.b_bs}", f"  %bj = mul i64 %j, {p.b_js}", "  %boff = add i64 %bb, %bj",
         "  %pa = getelementptr float, ptr %a, i64 %aoff", "  %pb = getelementptr float, ptr %b, i64 %boff",
         "  br label %kloop",
         "kloop:", "  %kv = phi i64 [0, %gbody], [%kvn, %kloop]"]
    s += [f"  %acc{l} = phi {ty} [zeroinitializer, %gbody], [%n{l}, %kloop]" for l in range(vl)]
    s.append(f"  %koff = mul i64 %kv, {vl}")
    for l in range(vl):
        s += [f"  %la{l} = getelementptr float, ptr %pa, i64 {l * p.a_bs}",
              f"  %qa{l} = getelementptr float, ptr %la{l}, i64 %koff",
              f"  %va{l} = load {ty}, ptr %qa{l}, align 4",
              f"  %lb{l} = getelementptr float, ptr %pb, i64 {l * p.b_bs}",
              f"  %qb{l} = getelementptr float, ptr %lb{l}, i64 %koff",
              f"  %vb{l} = load {ty}, ptr %qb{l}, align 4",
              f"  %n{l} = call {ty} @llvm.fma.v{vl}f32({ty} %va{l}, {ty} %vb{l}, {ty} %acc{l})"]
    s += ["  %kvn = add i64 %kv, 1", f"  %kc = icmp slt i64 %kvn, {p.k // vl}",
          "  br i1 %kc, label %kloop, label %red", "red:"]
    lines, total = _butterfly([f"%n{l}" for l in range(vl)], vl, ty)
    s += lines
    s += [f"  %oi = mul i64 %i, {p.o_is}", f"  %oj = mul i64 %j, {p.o_js}", "  %oij = add i64 %oi, %oj",
          "  %ooff = add i64 %oij, %b0", "  %po = getelementptr float, ptr %o, i64 %ooff",
          f"  store {ty} {total}, ptr %po, align 4",
          "  %gn = add i64 %g, 1", "  br label %gcond",
          "done:", "  ret void", "}",
          f"declare {ty} @llvm.fma.v{vl}f32({ty}, {ty}, {ty})"]
    return "\n".join(s) + "\n"


class CompiledSmallDot:
    """Machine code of one small-dot product, with the interface GemmStep and the native
    driver use of a generated GEMM: ``desc``, ``main`` (the kernel, ABI ``(args, lo, hi)`` over
    the groups), ``inline`` (always: a few microseconds), ``run(pool, a, b, operands, outputs)``."""

    claims_tiles = False
    inline = True

    def __init__(self, desc, plan: DotPlan, engine, ir: str):
        self.desc, self.plan, self.engine, self.ir = desc, plan, engine, ir
        params = (L.Param("a", "float32", plan.a_size), L.Param("b", "float32", plan.b_size),
                  L.Param("out", "float32", plan.batch * plan.m * plan.n))
        k = L.Kernel(plan.name, params, L.Block(), "g", plan.groups)
        self.main = CompiledKernelBase(k, engine.get_function_address(plan.name))

    def run(self, pool, a: np.ndarray, bsrc: np.ndarray, operands, outputs) -> None:
        self.main([a, bsrc, *outputs])


def compile_small_dot(d, cache_dir: str | None = None) -> CompiledSmallDot:
    """Generate, optimise and JIT the small-dot kernel of GemmDesc ``d`` (through the piecewise
    cache, as the generated GEMM); CompileError if ``d`` is not one (:func:`dot_plan`)."""
    from .cached import compile_module
    from .gemm import canonical, link_ir
    from .llvm import host
    named, d = d, canonical(d)
    plan, why = dot_plan(d)
    if plan is None:
        raise CompileError(f"{named.name}: not a small-dot product ({why})")
    plan = DotPlan(**{**plan.__dict__, "name": d.name.replace("gemm_", "dot_", 1)})

    def build():
        h = host()
        return link_ir(plan.name, dot_ir(plan) + f"\nattributes #0 = {{ nounwind {h.cpu_attrs} }}\n", ())
    engine, ir = compile_module(repr(plan), build, cache_dir, plan.name)
    return CompiledSmallDot(named, plan, engine, ir)
