"""Reading an ONNX model file once: a weight-free parse, the weights mapped from the file.

Loading a 500 MB export the plain way reads the file (a copy), parses it (protobuf copies every
``raw_data`` payload into the message), lets the ONNX checker parse the file a second time in
C++ (0.5-0.65 s for GPT-2, holding the GIL) and decodes every initializer (another copy).  This
module walks the protobuf wire format of the mapped file instead (``model_cache._varint``; a few
ms, no weight page read) and builds two small messages:

* the **program proto**: the model with the main graph's initializers' ``raw_data`` left out;
  their arrays are read-only views of the file mapping (a copy only where protobuf put the
  payload at an offset numpy cannot view aligned, as ``ModelFile.view`` does);
* the **check proto**: the same model with those initializers turned into graph inputs of
  their type and shape, for ``onnx.checker.check_model``, which then checks everything but the
  payloads.  What the checker checks of a payload -- one value field, a size that matches the
  type and shape, a name that is set and unique -- is checked here before an initializer is
  left out; an initializer that fails any of it, or that is unusual in any way (typed data
  fields, segments, external data, element types outside ``ONNX_DTYPES``, empty), stays in both
  protos as it is, so the checker sees it and raises what it raised before.

:func:`read_stripped` returns None whenever this does not apply (not a file, external data,
``ir_version`` <= 3, a wire-format error: a truncated or malformed file); the caller then loads
the file the plain way, which raises the same errors as always.
"""
from __future__ import annotations

import mmap
import os
from math import prod

import numpy as np

from .model_cache import _varint

#: TensorProto fields: dims, data_type, segment, typed data (4-7, 10, 11), name, raw_data,
#: external_data, data_location
_DIMS, _DTYPE, _SEGMENT, _NAME, _RAW, _EXTERNAL, _LOCATION = 1, 2, 3, 8, 9, 13, 14
_TYPED = {4, 5, 6, 7, 10, 11}


def _spans(buf, start: int, end: int):
    """``(field, wire type, field start, value, field end)`` of the message in ``buf[start:end]``;
    ``value`` is the varint for wire type 0 and the payload's ``(start, end)`` for wire type 2."""
    pos = start
    while pos < end:
        first = pos
        tag, pos = _varint(buf, pos)
        num, wt = tag >> 3, tag & 7
        if wt == 0:
            v, pos = _varint(buf, pos)
        elif wt == 2:
            n, pos = _varint(buf, pos)
            v = (pos, pos + n)
            pos += n
        elif wt == 1:
            v, pos = None, pos + 8
        elif wt == 5:
            v, pos = None, pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wt}")
        if pos > end:
            raise ValueError("truncated protobuf message")
        yield num, wt, first, v, pos
    if pos != end:
        raise ValueError("truncated protobuf message")


def _enc_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _field(num: int, payload: bytes) -> bytes:
    """A length-delimited field."""
    return _enc_varint(num << 3 | 2) + _enc_varint(len(payload)) + payload


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _tensor_info(buf, start: int, end: int):
    """``(name, elem type, dims, raw span, kept fields)`` of the TensorProto in ``buf[start:end]``
    when its payload can be left out (module docstring), else None; ``kept`` are the spans of
    every other field."""
    from .onnx import ONNX_DTYPES
    name, dtype, dims, raw, kept = None, 0, [], None, []
    for num, wt, first, v, last in _spans(buf, start, end):
        if num == _RAW and wt == 2:
            if raw is not None:
                return None
            raw = v
            continue
        kept.append((first, last))
        if num == _NAME and wt == 2:
            name = bytes(buf[v[0]:v[1]]).decode("utf-8")
        elif num == _DTYPE and wt == 0:
            dtype = v
        elif num == _DIMS and wt == 0:
            dims.append(_signed(v))
        elif num == _DIMS and wt == 2:          # packed
            pos = v[0]
            while pos < v[1]:
                d, pos = _varint(buf, pos)
                dims.append(_signed(d))
        elif num in _TYPED or num in (_SEGMENT, _EXTERNAL, _LOCATION) or num in (_DIMS, _DTYPE, _NAME):
            return None
    if not name or raw is None or dtype not in ONNX_DTYPES or any(d < 0 for d in dims):
        return None
    nbytes = prod(dims) * np.dtype(ONNX_DTYPES[dtype]).itemsize
    if nbytes == 0 or raw[1] - raw[0] != nbytes:
        return None
    return name, dtype, tuple(dims), raw, kept


def _name(buf, span) -> str:
    """The name (field 1 of a ValueInfoProto, 8 of a TensorProto) of the message at ``span``."""
    for num, wt, _, v, _ in _spans(buf, *span):
        if num == _NAME and wt == 2:
            return bytes(buf[v[0]:v[1]]).decode("utf-8", "replace")
    return ""


def _value_info(name: str, elem_type: int, dims: tuple) -> bytes:
    """A ValueInfoProto of a tensor: name, TypeProto.tensor_type(elem_type, shape(dim_value...))."""
    shape = b"".join(_field(1, b"\x08" + _enc_varint(d)) for d in dims)        # Dimension.dim_value
    tensor = b"\x08" + _enc_varint(elem_type) + _field(2, shape)
    return _field(1, name.encode("utf-8")) + _field(2, _field(1, tensor))


def strip_model(buf):
    """``(program bytes, check bytes, {name: (offset, elem type, dims)})`` for the serialised
    ModelProto ``buf`` (module docstring); None when nothing can be left out or the model is not
    one this applies to (``ir_version`` <= 3: initializers must be inputs there).  ValueError /
    IndexError on malformed bytes."""
    top = list(_spans(buf, 0, len(buf)))
    ir = [v for num, wt, _, v, _ in top if num == 1 and wt == 0]
    graphs = [v for num, wt, _, v, _ in top if num == 7 and wt == 2]
    if not ir or ir[-1] <= 3 or len(graphs) != 1:
        return None
    gfields = list(_spans(buf, *graphs[0]))
    inputs, names, infos = set(), {}, {}
    for num, wt, first, v, last in gfields:
        if num == 11 and wt == 2:               # GraphProto.input: ValueInfoProto.name
            for n2, w2, _, v2, _ in _spans(buf, *v):
                if n2 == 1 and w2 == 2:
                    inputs.add(bytes(buf[v2[0]:v2[1]]).decode("utf-8", "replace"))
        elif num == 5 and wt == 2:              # GraphProto.initializer
            info = _tensor_info(buf, *v)
            if info is not None:
                infos[first] = info
            # a name given twice stays with the checker ("initializer name is not unique")
            nm = info[0] if info is not None else _name(buf, v)
            names[nm] = names.get(nm, 0) + 1
    infos = {k: i for k, i in infos.items() if names[i[0]] == 1}
    if not infos:
        return None
    prog, check, weights = [], [], {}
    for num, wt, first, v, last in gfields:
        info = infos.get(first)
        if info is None:
            chunk = bytes(buf[first:last])
            prog.append(chunk)
            check.append(chunk)
            continue
        name, dtype, dims, raw, kept = info
        prog.append(_field(5, b"".join(bytes(buf[a:b]) for a, b in kept)))
        if name not in inputs:
            check.append(_field(11, _value_info(name, dtype, dims)))
        weights[name] = (raw[0], dtype, dims)
    out = []
    for part in (prog, check):
        g = b"".join(part)
        out.append(b"".join(_field(7, g) if num == 7 and wt == 2 else bytes(buf[first:last])
                            for num, wt, first, v, last in top))
    return out[0], out[1], weights


def _has_external(graph) -> bool:
    """Whether any tensor of ``graph`` or its subgraphs (initializers, tensor attributes) is
    stored externally: the checker must then see the file's path."""
    if any(t.data_location == 1 for t in graph.initializer):
        return True
    for n in graph.node:
        for a in n.attribute:
            if a.HasField("t") and a.t.data_location == 1 or any(t.data_location == 1 for t in a.tensors):
                return True
            if a.HasField("g") and _has_external(a.g) or any(_has_external(g) for g in a.graphs):
                return True
    return False


def read_stripped(path: str, mapping=None):
    """``(program proto, check bytes, {initializer name: read-only array})`` of the model file at
    ``path`` (``mapping``: its ``mmap`` when the caller has one), or None when the file is to be
    loaded the plain way (module docstring)."""
    import onnx

    from .onnx import ONNX_DTYPES
    try:
        if mapping is None:
            with open(path, "rb") as f:
                if not os.fstat(f.fileno()).st_size:
                    return None
                mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        got = strip_model(memoryview(mapping))
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
    if got is None:
        return None
    prog_bytes, check_bytes, where = got
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(prog_bytes)
    except Exception:       # the plain path reports it
        return None
    if not proto.HasField("graph") or _has_external(proto.graph):
        return None
    if where and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
        # read the weights ahead in the background (a file not in the page cache: 0.5 GB from
        # disk overlaps with the compile passes instead of stalling the first kernel that packs)
        try:
            mapping.madvise(mmap.MADV_WILLNEED)
        except (OSError, ValueError):
            pass
    weights = {}
    for name, (off, dtype, dims) in where.items():
        dt = np.dtype(ONNX_DTYPES[dtype]).newbyteorder("<")
        if off % dt.alignment:      # numpy's slow paths and the kernels want aligned arrays:
            # a copy, over a bytes object (immutable: the graph's constants need not copy it)
            a = np.frombuffer(mapping[off:off + prod(dims) * dt.itemsize], dt).reshape(dims)
        else:
            a = np.ndarray(dims, dt, buffer=mapping, offset=off)
            a.flags.writeable = False
        weights[name] = a
    return proto, check_bytes, weights
