"""Tiled shared-memory GEMM / implicit-GEMM conv for CUDA, with the epilogue fused.

Input: a :class:`apollo_py.codegen.gemm.GemmDesc` (the same description the CPU GEMM uses:
batch, ``m x n x k``, A/B batch indices, conv geometry, epilogue nodes and operands).  One block
of 256 threads computes a ``64 x 64`` tile of C: per step of ``BK = 16`` along k it stages a
``64 x 16`` panel of A and a ``16 x 64`` panel of B in shared memory (a conv's B panel is the
im2col gather, computed from the output pixel and the filter tap: implicit GEMM, nothing
materialised), then each thread accumulates a ``4 x 4`` register tile in float32.  The
epilogue chain (layer-1 scalar ops on the accumulator and broadcast operands read at the output
coordinates) runs on the registers and stores every output the step produces.  float16
operands are loaded as float32 (storage only), so fp16 runs accumulate in fp32.

Not here yet: tensor cores (``mma.sync`` / WMMA), double buffering, vectorised panel loads.
cuBLAS is the measured alternative for plain matmuls (runtime/cublas.py, chosen per shape on
the device).  The tile is the usual 64 x 64 x 16 SGEMM blocking, not tuned on a GPU.
"""
from __future__ import annotations

from math import prod

from apollo_py.codegen import loopir as L
from apollo_py.codegen.cuda import ARCHS, PRELUDE, Arch, CudaKernel, CudaPrinter, device_body, entry, param_decls
from apollo_py.errors import CompileError

BM, BN, BK, TM, TN = 64, 64, 16, 4, 4
THREADS = (BM // TM) * (BN // TN)


def render_gemm(d, a_dtype: str, b_dtype: str, arch: Arch = ARCHS["sm_80"]) -> CudaKernel:
    """The CUDA kernel of GemmDesc ``d``; A and B buffers hold ``a_dtype`` / ``b_dtype``
    (float32 or float16).  Params: ``a``, ``bsrc``, the epilogue operands ``in<q>``, the
    outputs ``out<q>`` -- bind them to (A value, B value, operand values, output values)."""
    from apollo_py.codegen.gemm import _operand_index, b_source_size
    from apollo_py.codegen.scalar_ops import scalar_op
    for dt in (a_dtype, b_dtype):
        if dt not in ("float32", "float16"):
            raise CompileError(f"CUDA GEMM {d.name!r}: {dt} operands (float32 / float16 only)")
    m, n, k = d.m, d.n, d.k
    a = L.Param("a", a_dtype, max(1, d.a_batches * m * k))
    bsrc = L.Param("bsrc", b_dtype, max(1, b_source_size(d)))
    ops = [L.Param(f"in{q}", o.dtype, max(1, prod(o.shape))) for q, o in enumerate(d.operands)]
    outs = [L.Param(f"out{q}", dt, max(1, prod(d.out_shape))) for q, dt in enumerate(d.out_dtypes)]
    params = [a, bsrc, *ops, *outs]
    b, i, kk, j = L.Var("b"), L.Var("i"), L.Var("k"), L.Var("j")
    tables = []
    if d.conv is not None:
        a_base = (b % d.conv.group) * (m * k)
    elif d.a_batches == 1:
        a_base = L.Const(0)
    else:
        tables.append(f"__device__ const int64_t {d.name}_aidx[] = {{{', '.join(map(str, d.a_index))}}};")
        a_base = L.Var("ab") * (m * k)
    a_val = L.Load(a, a_base + i * k + kk)
    zero = L.Const(0.0, "float32")
    if d.conv is None:
        if max(d.b_index) == 0:
            b_base = L.Const(0)
        else:
            tables.append(f"__device__ const int64_t {d.name}_bidx[] = {{{', '.join(map(str, d.b_index))}}};")
            b_base = L.Var("bb") * (k * n)
        b_ok = L.land(L.lt(kk, k), L.lt(j, n))
        b_val = L.Load(bsrc, b_base + L.minimum(kk, k - 1) * n + L.minimum(j, n - 1))
    else:
        g = d.conv
        cg = g.c // g.group
        img, grp = b // g.group, b % g.group
        ci, kh, kw = kk // (g.kh * g.kw), (kk // g.kw) % g.kh, kk % g.kw
        oh, ow = j // g.ow, j % g.ow
        ih = oh * g.strides[0] - g.pads[0] + kh * g.dilations[0]
        iw = ow * g.strides[1] - g.pads[1] + kw * g.dilations[1]
        b_ok = L.land(L.land(L.land(L.lt(kk, k), L.lt(j, n)), L.land(L.ge(ih, 0), L.lt(ih, g.h))),
                      L.land(L.ge(iw, 0), L.lt(iw, g.w)))
        ihc = L.minimum(L.maximum(ih, 0), g.h - 1)
        iwc = L.minimum(L.maximum(iw, 0), g.w - 1)
        ci = L.minimum(ci, cg - 1)
        b_val = L.Load(bsrc, ((img * g.c + grp * cg + ci) * g.h + ihc) * g.w + iwc)
    a_ok = L.land(L.lt(i, m), L.lt(kk, k))
    a_val = L.Load(a, a_base + L.minimum(i, m - 1) * k + L.minimum(kk, k - 1))
    pr = CudaPrinter()
    tm, tn = -(-m // BM), -(-n // BN)
    total = d.batch * tm * tn
    pr.depth = 2
    lines = pr.lines
    lines.append("    __shared__ float As[16][64];\n    __shared__ float Bs[16][65];")
    lines.append("    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;")
    lines.append(f"    for (int64_t t = ap_bid; t < INT64_C({total}); t += ap_nblk) {{")
    lines.append(f"        const int64_t b = t / {tm * tn}, i0 = (t % {tm * tn}) / {tn} * {BM}, "
                 f"j0 = (t % {tn}) * {BN};")
    if d.conv is None and d.a_batches > 1:
        lines.append(f"        const int64_t ab = {d.name}_aidx[b];")
    if d.conv is None and max(d.b_index) > 0:
        lines.append(f"        const int64_t bb = {d.name}_bidx[b];")
    lines.append("        float acc[4][4];\n"
                 "        #pragma unroll\n        for (int u = 0; u < 4; ++u)\n"
                 "            #pragma unroll\n            for (int v = 0; v < 4; ++v) acc[u][v] = 0.0f;")
    lines.append(f"        for (int64_t k0 = 0; k0 < INT64_C({k}); k0 += {BK}) {{")
    lines.append("            #pragma unroll\n            for (int q = 0; q < 4; ++q) {")
    lines.append("                const int e = threadIdx.x + q * 256;")
    lines.append("                { const int64_t i = i0 + e / 16, k = k0 + e % 16;")
    pr.depth = 5
    pr.stmt(L.Local("va", "float32", L.Select(a_ok, a_val, zero)))
    lines.append("                  As[e % 16][e / 16] = va; }")
    lines.append("                { const int64_t k = k0 + e / 64, j = j0 + e % 64;")
    pr.stmt(L.Local("vb", "float32", L.Select(b_ok, b_val, zero)))
    lines.append("                  Bs[e / 64][e % 64] = vb; }")
    lines.append("            }\n            __syncthreads();")
    lines.append("            #pragma unroll\n            for (int kk = 0; kk < 16; ++kk) {\n"
                 "                float ra[4], rb[4];\n"
                 "                #pragma unroll\n                for (int u = 0; u < 4; ++u) { ra[u] = As[kk][ty + 16 * u]; "
                 "rb[u] = Bs[kk][tx + 16 * u]; }\n"
                 "                #pragma unroll\n                for (int u = 0; u < 4; ++u)\n"
                 "                    #pragma unroll\n                    for (int v = 0; v < 4; ++v) "
                 "acc[u][v] += ra[u] * rb[v];\n            }\n            __syncthreads();\n        }")
    # epilogue on the register tile
    lines.append("        #pragma unroll\n        for (int u = 0; u < 4; ++u)\n"
                 "            #pragma unroll\n            for (int v = 0; v < 4; ++v) {")
    lines.append(f"                const int64_t i = i0 + ty + 16 * u, j = j0 + tx + 16 * v;")
    lines.append(f"                if (i >= INT64_C({m}) || j >= INT64_C({n})) continue;")
    pr.depth = 4
    row, col = b * m + i, j
    ncols = prod(d.out_shape[d.row_dims:])
    head_dtype = d.out_dtypes[d.outputs.index(d.head)] if d.head in d.outputs else "float32"
    head = L.Var("acc_u_v", "float32")
    lines.append("                const float acc_u_v = acc[u][v];")
    head_e: L.Expr = head if head_dtype != "float16" and a_dtype == "float32" else L.Un("round_f16", head)
    env: dict = {d.head: head_e}
    for q, o in enumerate(d.operands):
        env[o.value] = L.Load(ops[q], _operand_index(o, d.out_shape, d.row_dims, row, col))
    for name, c in d.inline_consts.items():
        env[name] = c
    for q, node in enumerate(d.nodes):
        odt = d.node_dtypes[q]
        e = scalar_op(node, [env[v] for v in node.inputs], [], L.compute_dtype(odt))
        if odt == "float16":
            e = L.Un("round_f16", e)
        pr.stmt(L.Local(f"e{q}", e.dtype, e))
        env[node.outputs[0]] = L.Var(f"e{q}", e.dtype)
    lin = row * ncols + col
    for q, v in enumerate(d.outputs):
        pr.stmt(L.Store(outs[q], lin, env[v]))
    lines.append("            }\n    }")
    text = "\n".join(pr.lines)
    grid = (max(1, min(total, arch.sms * 8)), 1, 1)
    src = PRELUDE + "\n" + "\n".join(tables) + "\n" + device_body(d.name, params, text, pr) + \
        entry(d.name, params, (THREADS, 1, 1), pr)
    form = "implicit-GEMM conv" if d.conv is not None else "GEMM"
    if d.nodes:
        form += " + epilogue " + "+".join(nd.op for nd in d.nodes)
    ck = CudaKernel(d.name, src, param_decls(params), grid, (THREADS, 1, 1), form,
                    shared_bytes=4 * (16 * 64 + 16 * 65), flops=2 * d.batch * m * n * k)
    ck.check(arch)
    return ck
