"""ONNX converters for index-producing and rearranging ops (ArgMax/ArgMin, Hardmax, OneHot,
CumSum, DepthToSpace/SpaceToDepth, Round, Trilu, Einsum) and Resize/Upsample.

Registered into :data:`apollo_py.frontend.converters.CONVERTERS` on import (by ``onnx_ops``).
"""
from __future__ import annotations

import math

import numpy as np

from ..ops import compound as C
from ..ops import compound_index as CI
from .converters import converter

# --- index-producing and rearranging ops --------------------------------------------------------


@converter("ArgMax", "ArgMin")
def _arg_reduce(cx):
    return CI.arg_reduce(cx.b, cx.need(0), cx.attr("axis", 0), bool(cx.attr("keepdims", 1)),
                         bool(cx.attr("select_last_index", 0)), cx.node.op_type == "ArgMax")


@converter("Hardmax")
def _hardmax(cx):
    x = cx.need(0)
    if cx.opset < 13:
        return C.coerced_2d(cx.b, x, cx.attr("axis", 1), CI.hardmax)
    return CI.hardmax(cx.b, x, cx.attr("axis", -1))


@converter("OneHot")
def _one_hot(cx):
    depth = int(np.asarray(cx.const(1)).reshape(-1)[0])
    values = cx.need(2)
    if values.shape != (2,):
        raise cx.error(f"values must have shape (2,) (off, on), got {values.shape}")
    off = C.reshape(cx.b, C.slice_(cx.b, values, [0], [1]), ())
    on = C.reshape(cx.b, C.slice_(cx.b, values, [1], [2]), ())
    return CI.one_hot(cx.b, cx.need(0), depth, off, on, cx.attr("axis", -1))


@converter("CumSum")
def _cumsum(cx):
    axis = int(np.asarray(cx.const(1)).reshape(-1)[0])
    return CI.cumsum(cx.b, cx.need(0), axis, bool(cx.attr("exclusive", 0)), bool(cx.attr("reverse", 0)))


@converter("DepthToSpace")
def _depth_to_space(cx):
    return CI.depth_to_space(cx.b, cx.need(0), int(cx.attr("blocksize")), cx.attr("mode", "DCR"))


@converter("SpaceToDepth")
def _space_to_depth(cx):
    return CI.space_to_depth(cx.b, cx.need(0), int(cx.attr("blocksize")), cx.attr("mode", "DCR"))


@converter("Round")
def _round(cx):
    return CI.round_half_even(cx.b, cx.need(0))


@converter("Einsum")
def _einsum(cx):
    from ..ops.compound_einsum import einsum
    return einsum(cx.b, cx.attr("equation"), cx.inputs())


def _optional_array(cx, i):
    """Constant input ``i`` as a float64/int64 array, None when absent or empty."""
    if not cx.has(i):
        return None
    arr = np.asarray(cx.const(i))
    return None if arr.size == 0 else arr.reshape(-1)


@converter("Resize", "Upsample")
def _resize(cx):
    from ..ops.compound_resize import resize

    x = cx.need(0)
    r = x.type.rank
    kind = cx.attr("mode", "nearest")
    if cx.attr("antialias", 0):
        raise cx.unsupported("antialiased resize is not supported")
    if cx.node.op_type == "Upsample" or cx.opset < 11:
        scales = _optional_array(cx, 1) if cx.n_in > 1 else np.asarray(cx.attr("scales"))
        if scales is None or len(scales) != r:
            raise cx.error(f"needs {r} scales")
        kind = {"bilinear": "linear", "trilinear": "linear"}.get(kind, kind)
        sizes = [int(math.floor(s * d)) for s, d in zip(scales, x.shape)]
        return resize(cx.b, x, sizes, scales, kind, "asymmetric", "simple")
    roi, scales, sizes = (_optional_array(cx, k) for k in (1, 2, 3))
    axes = cx.attr("axes")
    axes = list(range(r)) if axes is None else [C.normalize_axis(a, r) for a in axes]
    if roi is not None and len(roi) != 2 * len(axes):
        raise cx.error(f"roi needs {2 * len(axes)} values, got {len(roi)}")
    if (scales is None) == (sizes is None):
        raise cx.error("exactly one of scales and sizes must be given")
    full_scales, full_sizes = [1.0] * r, list(x.shape)
    full_roi = None if roi is None else [0.0] * r + [1.0] * r
    for k, a in enumerate(axes):
        if roi is not None:
            full_roi[a], full_roi[r + a] = float(roi[k]), float(roi[len(axes) + k])
    if scales is not None:
        if len(scales) != len(axes):
            raise cx.error(f"{len(scales)} scales for {len(axes)} axes")
        for k, a in enumerate(axes):
            full_scales[a] = float(scales[k])
            full_sizes[a] = int(math.floor(full_scales[a] * x.shape[a]))
    else:
        if len(sizes) != len(axes):
            raise cx.error(f"{len(sizes)} sizes for {len(axes)} axes")
        ratios = [int(sizes[k]) / x.shape[a] for k, a in enumerate(axes)]
        policy = cx.attr("keep_aspect_ratio_policy", "stretch")
        if policy == "stretch":
            for k, a in enumerate(axes):
                full_scales[a], full_sizes[a] = ratios[k], int(sizes[k])
        elif policy in ("not_larger", "not_smaller"):
            s = min(ratios) if policy == "not_larger" else max(ratios)
            for a in axes:
                full_scales[a], full_sizes[a] = s, int(s * x.shape[a] + 0.5)
        else:
            raise cx.error(f"unknown keep_aspect_ratio_policy {policy!r}")
    return resize(cx.b, x, full_sizes, full_scales, kind,
                  cx.attr("coordinate_transformation_mode", "half_pixel"),
                  cx.attr("nearest_mode", "round_prefer_floor"), cx.attr("cubic_coeff_a", -0.75),
                  bool(cx.attr("exclude_outside", 0)), full_roi, cx.attr("extrapolation_value", 0.0))


@converter("Trilu")
def _trilu(cx):
    k = cx.ints(1, [0])[0] if cx.has(1) else 0
    return C.trilu(cx.b, cx.need(0), k, bool(cx.attr("upper", 1)))


@converter("ConvTranspose")
def _conv_transpose(cx):
    from ..ops.compound_conv import conv_transpose, conv_transpose_pads

    x, w = cx.need(0), cx.need(1)
    nsp = x.type.rank - 2
    if nsp < 1 or w.type.rank != x.type.rank:
        raise cx.error(f"input {x.shape} and weight {w.shape} must have equal rank >= 3")
    ks = list(w.shape[2:])
    if list(cx.attr("kernel_shape", ks)) != ks:
        raise cx.error(f"kernel_shape {cx.attr('kernel_shape')} differs from the weight's {ks}")
    strides = list(cx.attr("strides", [1] * nsp))
    dil = list(cx.attr("dilations", [1] * nsp))
    opad = list(cx.attr("output_padding", [0] * nsp))
    auto = cx.attr("auto_pad", "NOTSET")
    out_shape = cx.attr("output_shape")
    if out_shape is not None:
        out_shape = list(out_shape)[-nsp:]
    pads = cx.attr("pads") if auto in ("NOTSET", "VALID") else None
    if auto == "VALID":
        pads = [0] * (2 * nsp)
    pads = conv_transpose_pads(x.shape[2:], ks, strides, dil, opad, pads, out_shape, auto)
    return conv_transpose(cx.b, x, w, strides, pads, dil, opad, int(cx.attr("group", 1)), cx.x(2))


@converter("Mod")
def _mod(cx):
    return CI.mod(cx.b, cx.need(0), cx.need(1), bool(cx.attr("fmod", 0)))


@converter("GatherElements")
def _gather_elements(cx):
    return CI.gather_elements(cx.b, cx.need(0), cx.need(1), cx.attr("axis", 0))


@converter("GatherND")
def _gather_nd(cx):
    return CI.gather_nd(cx.b, cx.need(0), cx.need(1), int(cx.attr("batch_dims", 0)))
