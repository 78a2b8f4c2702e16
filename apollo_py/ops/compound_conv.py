"""Transposed convolution as a decomposition: zero-interleave the input by the stride (reshape ->
pad -> reshape -> slice), pad by the dilated kernel extent minus the pads, then an ordinary
``conv`` with the weight transposed per group and flipped spatially.

Same conventions as :mod:`apollo_py.ops.compound`.
"""
from __future__ import annotations

from math import prod

from ..errors import ShapeError
from .compound import expand, reshape, slice_


def conv_transpose_pads(in_spatial, kernel, strides, dilations, output_padding, pads=None,
                        output_shape=None, auto_pad: str = "NOTSET") -> tuple[int, ...]:
    """Pads (begins..., ends...) of an ONNX ConvTranspose, resolving output_shape / auto_pad."""
    n = len(kernel)
    if output_shape is None and auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        output_shape = [in_spatial[s] * strides[s] for s in range(n)]
    if output_shape is None:
        return tuple(pads) if pads is not None else (0,) * (2 * n)
    out = [0] * (2 * n)
    for s in range(n):
        total = (strides[s] * (in_spatial[s] - 1) + output_padding[s]
                 + (kernel[s] - 1) * dilations[s] + 1 - output_shape[s])
        half = total // 2
        if auto_pad == "SAME_UPPER":
            out[s], out[n + s] = half, total - half
        else:
            out[s], out[n + s] = total - half, half
    return tuple(out)


def conv_transpose(b, x, w, strides, pads, dilations, output_padding, group: int = 1, bias=None):
    """ONNX ConvTranspose: x (N, C_in, sp...), w (C_in, C_out/group, k...), optional bias (C_out,)."""
    r = x.type.rank
    nsp = r - 2
    if nsp < 1 or w.type.rank != r:
        raise ShapeError(f"conv_transpose needs input and weight of equal rank >= 3, got {x.shape}, {w.shape}")
    n, c_in = x.shape[:2]
    if w.shape[0] != c_in or c_in % group:
        raise ShapeError(f"weight {w.shape} does not match {c_in} input channels in {group} groups")
    ks = w.shape[2:]
    sp = x.shape[2:]
    if (group == 1 and tuple(ks) == tuple(strides) and not any(pads) and not any(output_padding)
            and all(d == 1 for d in dilations)):
        return _unpool_conv_transpose(b, x, w, bias)
    # 1. interleave stride-1 zeros between input elements
    y = x
    if any(s > 1 for s in strides):
        inter = [n, c_in] + [v for d in sp for v in (d, 1)]
        y = reshape(b, y, inter)
        ends = [0, 0] + [v for s in strides for v in (0, s - 1)]
        y = b.pad(y, pads=(0,) * len(inter) + tuple(ends), mode="constant", value=0.0)
        y = reshape(b, y, [n, c_in] + [d * s for d, s in zip(sp, strides)])
        y = slice_(b, y, [0] * nsp, [(d - 1) * s + 1 for d, s in zip(sp, strides)], list(range(2, r)))
    # 2. pad by the dilated kernel extent minus the transposed conv's own pads
    ext = [dilations[s] * (ks[s] - 1) for s in range(nsp)]
    begin = [ext[s] - pads[s] for s in range(nsp)]
    end = [ext[s] - pads[nsp + s] + output_padding[s] for s in range(nsp)]
    if any(begin) or any(end):
        y = b.pad(y, pads=(0, 0, *begin, 0, 0, *end), mode="constant", value=0.0)
    # 3. weight (C_in, C_out/g, k...) -> (C_out, C_in/g, k...), flipped spatially
    cog = w.shape[1]
    wt = reshape(b, w, (group, c_in // group, cog) + tuple(ks))
    wt = b.transpose(wt, perm=(0, 2, 1) + tuple(range(3, 3 + nsp)))
    wt = reshape(b, wt, (group * cog, c_in // group) + tuple(ks))
    if prod(ks) > 1:
        wt = b.slice(wt, starts=(0, 0) + tuple(k - 1 for k in ks), ends=(group * cog, c_in // group) + (-1,) * nsp,
                     steps=(1, 1) + (-1,) * nsp)
    y = b.conv(y, wt, strides=(1,) * nsp, pads=(0,) * (2 * nsp), dilations=tuple(dilations), group=group)
    if bias is not None:
        y = b.add(y, reshape(b, bias, (1, bias.shape[0]) + (1,) * nsp))
    return y


def _unpool_conv_transpose(b, x, w, bias=None):
    """A ConvTranspose whose kernel equals its stride (no pads, dilations or output padding; the
    U-Net up-sampling 2x2 / stride 2) writes every output pixel from exactly one input pixel:
    one 1x1 conv to ``C_out * prod(k)`` channels, then a reshape / transpose / reshape that puts
    each kernel offset at its place in the output.  The general decomposition below convolves
    the zero-interleaved input instead: ``prod(k)`` times the multiply-adds, all but one in
    ``prod(k)`` of them with zeros (U-Net's up-conv: 25 of 171 ms at load 16).  On the CPU the
    conv's GEMM then stores its result straight into the shuffled layout, the reshape /
    transpose / reshape folded into its epilogue (layers/gemm_reshape_epilogue.py,
    ``fold_subpixel_stores``; codegen/gemm_subpixel.py)."""
    n, c_in = x.shape[:2]
    sp, ks = tuple(x.shape[2:]), tuple(w.shape[2:])
    nsp, cout = len(sp), w.shape[1]
    # (C_in, C_out, k...) -> (C_out, k..., C_in) -> (C_out * prod(k), C_in, 1...)
    wt = b.transpose(w, perm=(*range(1, 2 + nsp), 0))
    wt = reshape(b, wt, (cout * prod(ks), c_in) + (1,) * nsp)
    z = b.conv(x, wt, strides=(1,) * nsp, pads=(0,) * (2 * nsp), dilations=(1,) * nsp, group=1)
    if bias is not None:    # added before the shuffle, so the conv's epilogue takes it
        bk = expand(b, reshape(b, bias, (cout, 1)), (cout, prod(ks)))
        z = b.add(z, reshape(b, bk, (1, cout * prod(ks)) + (1,) * nsp))
    z = reshape(b, z, (n, cout, *ks, *sp))
    # (n, C_out, k0, k1.., s0, s1..) -> (n, C_out, s0, k0, s1, k1, ..)
    z = b.transpose(z, perm=(0, 1, *(d for s in range(nsp) for d in (2 + nsp + s, 2 + s))))
    return reshape(b, z, (n, cout, *(d * k for d, k in zip(sp, ks))))
