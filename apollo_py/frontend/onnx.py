"""ONNX front end: load a model (path, bytes or ModelProto) into a :class:`Program`.

Loading parses and checks the model, memory-maps external initializer data (refusing any
location outside the model's directory; nothing is copied, so a model over 2 GB is not held
twice), inlines model-local functions and turns nodes and initializers into plain Python data.
Nodes without a converter run through onnx.reference (:mod:`.fallback`); models whose shapes
depend on data run in stages (:mod:`.staged`); If/Loop/Scan bodies are compiled by apollo_py
(:mod:`.control_flow`).  ``specialize(shapes)`` then lowers the nodes, for concrete input
shapes, into a primitive :class:`~apollo_py.ir.Graph` through the converters of :mod:`.onnx_ops`; values
that only depend on constants (Shape -> Gather -> Concat -> Reshape chains) are folded at that
time, so shape arithmetic never reaches the graph.  ``onnx`` itself is imported lazily, inside
:func:`load_onnx`, to keep ``import apollo_py`` fast.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Mapping

import networkx as nx
import numpy as np

from ..errors import ApolloError, InputError, ModelLoadError, ShapeError, UnsupportedOpError
from ..ir.builder import GraphBuilder, Value
from ..ir.graph import Graph, Node
from ..ir.types import DTYPES
from ..ir.verify import verify
from ..ops import compound as C
from ..ops.registry import get_op
from ..options import check_memory
from .program import InputSpec, Program

#: ONNX TensorProto element type -> apollo dtype name (the dtypes apollo_py supports)
ONNX_DTYPES = {1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64",
               9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64"}
_ONNX_TYPE_NAMES = {0: "undefined", 8: "string", 14: "complex64", 15: "complex128", 16: "bfloat16",
                    17: "float8e4m3fn", 18: "float8e4m3fnuz", 19: "float8e5m2", 20: "float8e5m2fnuz",
                    21: "uint4", 22: "int4", 23: "float4e2m1"}


def onnx_dtype(elem_type: int, what: str) -> str:
    """apollo dtype name for ONNX element type ``elem_type``; UnsupportedOpError naming ``what``."""
    try:
        return ONNX_DTYPES[int(elem_type)]
    except KeyError:
        name = _ONNX_TYPE_NAMES.get(int(elem_type), str(elem_type))
        raise ShapeError(f"{what} has element type {name}, which apollo_py does not support "
                         f"(supported: {', '.join(DTYPES)})") from None


@dataclass(frozen=True)
class OnnxNode:
    """An ONNX node as plain data: op type, domain, name (never empty), value names, attributes.

    Attribute values are Python scalars, strings, lists, or numpy arrays for tensor attributes.
    Missing optional inputs/outputs are empty strings, as in ONNX.
    """

    op_type: str
    domain: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, Any]
    proto: Any = field(default=None, compare=False, repr=False)  # the NodeProto (fallback, bodies)

    def describe(self) -> str:
        return f"node {self.name!r} ({self.op_type})"


# --- loading ------------------------------------------------------------------------------------


def _checked_marker(cache_dir: str | None, path: str | None) -> str | None:
    """Where the note that the model file ``path`` passed the ONNX checker lives: keyed by the
    file's identity (real path, inode, size, modification time) and the onnx version, so an
    edited or replaced file is checked again.  None without a cache dir or a path."""
    if not cache_dir or path is None:
        return None
    import hashlib

    import onnx
    try:
        st = os.stat(path)
    except OSError:
        return None
    ident = f"{os.path.realpath(path)}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{onnx.__version__}"
    return os.path.join(cache_dir, "checked", hashlib.sha256(ident.encode()).hexdigest() + ".json")


def load_onnx(model: Any, cache_dir: str | None = None, mapping=None) -> "OnnxProgram":
    """Load an ONNX model given as a path (str / os.PathLike), bytes, or ``onnx.ModelProto``.

    Returns an :class:`OnnxProgram`.  Raises ModelLoadError for unreadable, malformed or
    truncated models and for external data that would be read from outside the model's folder.
    With ``cache_dir``, a model file that passed the ONNX checker before, unchanged, is not
    checked again (0.5-0.8 s of a 500 MB export's load).  A file is read once, through a
    mapping (``mapping``: the caller's ``mmap`` of it), its weights left in place
    (:mod:`.onnx_file`; the plain read below where that does not apply).
    """
    fast = None
    if isinstance(model, (str, os.PathLike)):
        from .onnx_file import read_stripped
        fast = read_stripped(os.fspath(model), mapping)
    if fast is not None:
        proto, check_bytes, mapped = fast
        path = os.fspath(model)
    else:
        proto, base_dir = read_model_proto(model, "cannot load a model")
        path = os.fspath(model) if base_dir is not None else None
        if not proto.HasField("graph"):
            raise ModelLoadError("the ONNX model has no graph (malformed or truncated model)")
        proto, mapped = _map_external_data(proto, base_dir)
        check_bytes = None
    marker = _checked_marker(cache_dir, path)
    if marker is None or not os.path.exists(marker):    # else this very file passed before
        _check(proto, path, model, check_bytes)
        if marker is not None:
            try:
                import json

                from ..fsutil import atomic_write
                os.makedirs(os.path.dirname(marker), exist_ok=True)
                atomic_write(marker, json.dumps({"checked": os.path.realpath(path)}).encode())
            except OSError:     # a cache dir that cannot be written only costs the check
                pass
    return _program_from(proto, mapped)


def _check(proto, path, model, check_bytes: bytes | None = None) -> None:
    """The ONNX checker on the model (``check_bytes``: the weight-free form :mod:`.onnx_file`
    made of it); ModelLoadError unless what it finds is tolerated."""
    import onnx
    try:
        # the checker reads serialised bytes: give it the file (with mapped external data it
        # must see the path anyway) or the caller's bytes rather than serialising the proto
        # again (1.3 s of the 3.2 s a 500 MB GPT-2 export took to load)
        raw = model if isinstance(model, bytes) else check_bytes
        onnx.checker.check_model(raw if check_bytes is not None else path if path is not None
                                 else raw if raw is not None else proto)
    except Exception as e:  # checker raises ValidationError and, for odd protos, others
        text = str(e).strip()
        # unknown op types are reported per node (UnsupportedOpError) once the nodes are read;
        # graph outputs without a declared shape are common and harmless (shapes are inferred)
        tolerated = ("No Op registered for", "No opset import for domain",
                     "Field 'shape' of 'type' is required but missing")
        if not any(t in text for t in tolerated):
            first = text.splitlines()[0] if text else type(e).__name__
            # the checker names the node on a later line ("==> Context: Bad node spec for
            # node. Name: bn OpType: BatchNormalization"): keep it, the first line does not
            import re
            ctx = re.search(r"Name: (\S*) OpType: (\S+)", text)
            where = f"node {ctx.group(1)!r} ({ctx.group(2)}): " if ctx else ""
            raise ModelLoadError(f"invalid ONNX model: {where}{first}") from None


def _program_from(proto, mapped) -> "OnnxProgram":
    """The OnnxProgram of a checked model (its local functions inlined)."""
    if proto.functions:
        try:
            from onnx import inliner
            proto = inliner.inline_local_functions(proto)
        except Exception as e:
            raise ModelLoadError(f"cannot inline the model's local functions: {e}") from None
    return OnnxProgram(proto, mapped)


def read_model_proto(model: Any, refusal: str) -> tuple:
    """``(ModelProto, folder of the model file or None)`` for a path, bytes or ModelProto.

    Raises ModelLoadError for unreadable or malformed data, and for any other type (the
    message starts with ``refusal``).  External data is not touched here.
    """
    import onnx

    if isinstance(model, onnx.ModelProto):
        return model, None
    if isinstance(model, (bytes, bytearray, memoryview)):
        return _parse(bytes(model), "the model bytes"), None
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ModelLoadError(f"cannot read ONNX model {path!r}: {e.strerror or e}") from None
        return _parse(data, f"ONNX model file {path!r}"), os.path.dirname(os.path.abspath(path))
    raise ModelLoadError(f"{refusal} from a {type(model).__name__}: pass a path, bytes, "
                         "an onnx.ModelProto or an apollo_py Graph")


def _parse(data: bytes, what: str):
    import onnx
    from google.protobuf.message import DecodeError

    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(f"{what} is not a valid ONNX model (malformed or truncated): {e}") from None
    if not data or not proto.HasField("graph"):
        raise ModelLoadError(f"{what} is not a valid ONNX model (malformed or truncated: no graph)")
    return proto


def _external_tensors(proto, initializers: bool = True):
    """Every TensorProto of the main graph (initializers unless told not, Constant attributes)
    stored externally."""
    import onnx

    out = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL] \
        if initializers else []
    for n in proto.graph.node:
        for a in n.attribute:
            if a.HasField("t") and a.t.data_location == onnx.TensorProto.EXTERNAL:
                out.append(a.t)
    return out


def _external_location(t, root: str) -> tuple[str, int, int | None]:
    """(real path, offset, length or None) of external tensor ``t``; ModelLoadError when the
    location is absolute or resolves (symlinks included) outside the model's folder ``root``."""
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    if not loc or os.path.isabs(loc) or os.path.splitdrive(loc)[0]:
        raise ModelLoadError(f"tensor {t.name!r}: external data location {loc!r} must be a relative "
                             "path inside the model's directory")
    full = os.path.realpath(os.path.join(root, loc))
    if os.path.commonpath([root, full]) != root:
        raise ModelLoadError(f"tensor {t.name!r}: external data location {loc!r} resolves outside the "
                             f"model's directory {root!r}; refusing to read it")
    try:
        offset = int(info.get("offset", 0) or 0)
        length = int(info["length"]) if info.get("length") else None
    except ValueError as e:
        raise ModelLoadError(f"tensor {t.name!r}: bad external data offset/length: {e}") from None
    return full, offset, length


def _map_external_data(proto, base_dir: str | None):
    """(proto, {initializer name: read-only np.memmap}) for a model with external data.

    Externally stored initializers of plain numeric types are memory-mapped from their files,
    not read: loading a model whose weights exceed 2 GB (which must be external) costs no copy
    of the weights; the pages are read on use.  The proto is left as it is (small: it holds no
    weights).  Other external tensors (Constant attributes, exotic element types) are read in
    by :func:`_resolve_external_data`.  Locations are checked as there.
    """
    import onnx
    from onnx import helper

    external = _external_tensors(proto)
    if not external:
        return proto, {}
    if base_dir is None:
        raise ModelLoadError("the model refers to external data but was not loaded from a file; "
                             "load it by path so that the data files can be found")
    root = os.path.realpath(base_dir)
    mapped = {}
    rest = bool(_external_tensors(proto, initializers=False))
    for t in proto.graph.initializer:
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        full, offset, length = _external_location(t, root)
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        except (KeyError, ValueError, TypeError):    # an element type numpy has no dtype for
            dtype = None
        if dtype is None or dtype.kind not in "biuf":
            rest = True
            continue
        shape = tuple(int(d) for d in t.dims)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if length is not None and length != nbytes:
            raise ModelLoadError(f"tensor {t.name!r}: external data length {length} does not match its "
                                 f"shape {list(shape)} and type {dtype.name} ({nbytes} bytes)")
        try:
            size = os.path.getsize(full)
        except OSError as e:
            raise ModelLoadError(f"tensor {t.name!r}: cannot read external data: {e.strerror or e}") from None
        if offset + nbytes > size:
            raise ModelLoadError(f"tensor {t.name!r}: external data {os.path.basename(full)!r} is truncated "
                                 f"({max(size - offset, 0)} of {nbytes} bytes)")
        if nbytes == 0:
            mapped[t.name] = np.zeros(shape, dtype)
        else:
            mapped[t.name] = np.memmap(full, dtype=dtype.newbyteorder("<"), mode="r", offset=offset, shape=shape)
    if rest:
        proto = _resolve_external_data(proto, base_dir, skip=set(mapped))
    return proto, mapped


def _resolve_external_data(proto, base_dir: str | None, skip: set = frozenset()):
    """A copy of ``proto`` with external tensor data read in (tensors named in ``skip`` are left
    external); ModelLoadError on unsafe locations."""
    import onnx

    if not _external_tensors(proto):
        return proto
    if base_dir is None:
        raise ModelLoadError("the model refers to external data but was not loaded from a file; "
                             "load it by path so that the data files can be found")
    proto2 = onnx.ModelProto()
    proto2.CopyFrom(proto)
    root = os.path.realpath(base_dir)
    tensors = [t for t in proto2.graph.initializer if t.name not in skip
               and t.data_location == onnx.TensorProto.EXTERNAL] + _external_tensors(proto2, initializers=False)
    for t in tensors:
        full, offset, length = _external_location(t, root)
        loc = os.path.basename(full)
        try:
            with open(full, "rb") as f:
                f.seek(offset)
                data = f.read() if length is None else f.read(length)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"tensor {t.name!r}: cannot read external data {loc!r}: {e}") from None
        if length is not None and len(data) != length:
            raise ModelLoadError(f"tensor {t.name!r}: external data {loc!r} is truncated "
                                 f"({len(data)} of {length} bytes)")
        t.raw_data = data
        del t.external_data[:]
        t.data_location = onnx.TensorProto.DEFAULT
    return proto2


def _attr_value(attr):
    """Python value of an AttributeProto (tensors as numpy arrays, strings decoded)."""
    from onnx import helper

    v = helper.get_attribute_value(attr)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if hasattr(v, "data_type") and hasattr(v, "dims"):  # TensorProto
        return _tensor_array(v, f"attribute {attr.name!r}")
    if isinstance(v, list):
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else x for x in v]
    return v


def _tensor_array(t, what: str):
    """numpy array of TensorProto ``t`` (unsupported element types are kept as they are)."""
    from onnx import numpy_helper

    try:
        return numpy_helper.to_array(t)
    except Exception as e:
        raise ModelLoadError(f"{what}: cannot decode tensor {t.name!r}: {e}") from None


def _input_spec(vi) -> InputSpec:
    """InputSpec of a graph input ValueInfoProto; ModelLoadError for non-tensors or unsupported dtypes."""
    tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    if tt is None:
        raise ModelLoadError(f"graph input {vi.name!r} is not a tensor (sequences, maps and optionals "
                             "are not supported)")
    try:
        dtype = onnx_dtype(tt.elem_type, f"graph input {vi.name!r}")
    except ShapeError as e:
        raise ModelLoadError(str(e)) from None
    if not tt.HasField("shape"):
        raise ModelLoadError(f"graph input {vi.name!r} has no shape (not even a rank); apollo_py "
                             "needs the rank of every input")
    dims = []
    for d in tt.shape.dim:
        # Exporters (PaddlePaddle, some torch paths) write -1 or 0 for a dynamic dim: symbolic,
        # like a dim_param or a missing value.  paddle2onnx also writes the dim_param "?" for
        # every unknown dim (H and W of [-1, 3, ?, ?]): a placeholder, not one shared symbol.
        if d.HasField("dim_value") and d.dim_value > 0:
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param") and d.dim_param.strip() not in ("", "?"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return InputSpec(vi.name, tuple(dims), dtype)


def onnx_nodes(graph) -> tuple[OnnxNode, ...]:
    """The nodes of GraphProto ``graph`` as OnnxNodes (unnamed nodes get ``<op>_<index>``)."""
    nodes = []
    for k, n in enumerate(graph.node):
        attrs = {a.name: _attr_value(a) for a in n.attribute}
        nodes.append(OnnxNode(n.op_type, n.domain, n.name or f"{n.op_type}_{k}", tuple(n.input),
                              tuple(n.output), attrs, n))
    return tuple(nodes)


# --- the program ---------------------------------------------------------------------------------


class OnnxProgram(Program):
    """An ONNX model ready to be specialised: inputs (possibly symbolic), outputs, nodes.

    ``opset`` is the default-domain opset version.  ``specialize(shapes)`` returns the verified
    primitive Graph for concrete input shapes; graph inputs and outputs keep their ONNX names.
    Nodes without a converter run through onnx.reference (see :mod:`.fallback`); only a node
    with neither is refused, at load time.
    """

    def __init__(self, proto, mapped: Mapping[str, np.ndarray] | None = None):
        g = proto.graph
        mapped = mapped or {}
        opset = 1
        for imp in proto.opset_import:
            if imp.domain in ("", "ai.onnx"):
                opset = int(imp.version)
        initializers = {t.name: mapped[t.name] if t.name in mapped else _tensor_array(t, f"initializer {t.name!r}")
                        for t in g.initializer}
        inputs = tuple(_input_spec(vi) for vi in g.input if vi.name not in initializers)
        self._setup(g.name or "model", inputs, tuple(o.name for o in g.output), onnx_nodes(g),
                    initializers, opset)
        from .fallback import check_supported
        for n in self.nodes:
            check_supported(n, self.opset)

    @classmethod
    def from_parts(cls, name: str, inputs: tuple, outputs: tuple, nodes: tuple,
                   initializers: Mapping[str, np.ndarray], opset: int) -> "OnnxProgram":
        """A program over given nodes (a subgraph body, or the rest of a model after a split)."""
        self = cls.__new__(cls)
        self._setup(name, tuple(inputs), tuple(outputs), tuple(nodes), initializers, opset)
        return self

    def _setup(self, name, inputs, outputs, nodes, initializers, opset):
        self.name, self.inputs, self.outputs = name, inputs, outputs
        self.nodes, self.initializers, self.opset = nodes, dict(initializers), opset

    def _check_shapes(self, shapes: Mapping[str, tuple]) -> dict[str, tuple[int, ...]]:
        out, bound = {}, {}
        for spec in self.inputs:
            if spec.name not in shapes:
                raise InputError(f"{self.name}: no shape given for input {spec.name!r}")
            shape = tuple(int(d) for d in shapes[spec.name])
            if not spec.matches(shape):
                raise InputError(f"input {spec.name!r} has shape {shape}, expected {spec.describe()}")
            for d, s in zip(spec.dims, shape):
                if isinstance(d, str):
                    if bound.setdefault(d, (s, spec.name))[0] != s:
                        raise InputError(f"input {spec.name!r}: dim {d!r} is {s} here but "
                                         f"{bound[d][0]} in input {bound[d][1]!r}")
            out[spec.name] = shape
        return out

    def specialize(self, shapes: Mapping[str, tuple[int, ...]], options=None) -> Graph:
        """The primitive graph for these input shapes (name -> shape).

        UnsupportedOpError when a node's output shape depends on input data: such a model runs
        in stages, through :func:`apollo_py.frontend.staged.compile_program` (``jit`` does it).
        """
        lowered = self.lower(shapes, options)
        if lowered.split is not None:
            n = lowered.split
            raise UnsupportedOpError(n.op_type, n.name, f"{lowered.split_reason}; a single static graph "
                                     "cannot express it (apollo_py.jit runs such models in stages)")
        return lowered.graph

    def lower(self, shapes: Mapping[str, tuple[int, ...]], options=None) -> "Lowered":
        """Lower the nodes for these shapes, stopping at the first node whose output shape
        depends on input data (see :class:`Lowered`)."""
        from .fallback import DataDependent

        shapes = self._check_shapes(shapes)
        b = FoldingBuilder(self.name, options)
        env: dict[str, Value] = {}
        for spec in self.inputs:
            env[spec.name] = b.input(spec.name, shapes[spec.name], spec.dtype)
        lowering = Lowering(b, env, self.initializers, self.opset, options)
        input_names = [s.name for s in self.inputs]
        from ..deadline import check as check_deadline
        for k, node in enumerate(self.nodes):
            check_deadline("ONNX lowering", node.describe())
            try:
                lowering.run(node)
            except DataDependent as e:
                return self._split_at(k, e.reason, lowering, input_names)
        outs = [lowering.value(o, f"graph output {o!r}") for o in self.outputs]
        sources = {o: lowering.bound_by.get(o, "") for o in self.outputs}
        return Lowered(finalize(b, input_names, list(zip(self.outputs, outs)), sources))

    def _split_at(self, k: int, reason: str, lowering: "Lowering", input_names: list) -> "Lowered":
        """The head graph computing what nodes ``k:`` read, and the constants they read."""
        from .control_flow import node_captures

        later = set(self.outputs)
        for n in self.nodes[k:]:
            later.update(i for i in n.inputs if i)
            if n.proto is not None:
                later.update(node_captures(n.proto))
        head_outs, consts = [], {}
        for name in sorted(later):
            v = lowering.env.get(name)
            if v is None or name in input_names:
                continue  # graph inputs are fed directly, initializers read by the rest itself
            arr = lowering.b.const_value(v)
            if arr is not None:
                consts[name] = arr
            else:
                head_outs.append((name, v))
        graph = None
        if head_outs:
            sources = {o: lowering.bound_by.get(o, "") for o, _ in head_outs}
            graph = finalize(lowering.b, input_names, head_outs, sources)
        return Lowered(graph, self.nodes[k], reason, k, consts)


@dataclass(frozen=True)
class Lowered:
    """Result of :meth:`OnnxProgram.lower`.

    Without a split, ``graph`` computes the whole model.  With one, ``split`` is the first node
    whose output shape depends on data (``split_reason`` says why), at ``split_index``;
    ``graph`` (None when there is nothing to compute) computes the values the remaining nodes
    read, and ``constants`` holds those that were folded at compile time.
    """

    graph: Graph | None
    split: OnnxNode | None = None
    split_reason: str = ""
    split_index: int = -1
    constants: Mapping[str, np.ndarray] = field(default_factory=dict)


class FoldingBuilder(GraphBuilder):
    """A GraphBuilder that can evaluate values depending only on constants (shape arithmetic)."""

    def __init__(self, name: str = "graph", options=None):
        super().__init__(name)
        self.producer: dict[str, Node] = {}
        self._known: dict[str, np.ndarray | None] = {}
        self._options = options

    def op(self, op, *inputs, **kw):
        outs = super().op(op, *inputs, **kw)
        node = self._nodes[-1]
        for o in node.outputs:
            self.producer[o] = node
            # a declared tensor over Options.max_memory (an Expand or Reshape bomb) is refused
            # here, before folding or compiling could allocate or loop over it
            check_memory(self._types[o].nbytes, f"value {o!r} ({op} of shape "
                         f"{list(self._types[o].shape)})", self._options)
        return outs

    def nodes(self) -> list[Node]:
        """The nodes built so far, in order."""
        return list(self._nodes)

    def types(self) -> dict:
        """Value name -> TensorType for every value built so far."""
        return dict(self._types)

    def const_value(self, v: Value) -> np.ndarray | None:
        """The array of ``v`` if it depends on constants only (evaluated by the references), else None."""
        stack = [v.name]
        while stack:
            name = stack[-1]
            if name in self._known:
                stack.pop()
                continue
            node = self.producer.get(name)
            if node is None:
                self._known[name] = None
                stack.pop()
                continue
            pending = [i for i in node.inputs if i not in self._known]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            args = [self._known[i] for i in node.inputs]
            if any(a is None for a in args):
                for o in node.outputs:
                    self._known[o] = None
                continue
            with np.errstate(all="ignore"):
                res = get_op(node.op).reference(args, node.attrs)
            for o, r in zip(node.outputs, res):
                self._known[o] = np.asarray(r, dtype=self._types[o].np_dtype)
        return self._known[v.name]


class Lowering:
    """State of one specialisation: builder, ONNX name -> Value, initializers, opset, Options
    (recorded in fallback nodes whose subgraphs are compiled at run time; may be None)."""

    def __init__(self, b: FoldingBuilder, env: dict, initializers: Mapping[str, np.ndarray], opset: int,
                 options=None):
        self.b, self.env, self.initializers, self.opset = b, env, initializers, opset
        self.options = options
        self.bound_by: dict[str, str] = {}  # ONNX value name -> name of the node that produced it

    def value(self, name: str, what: str) -> Value:
        """The Value of ONNX value ``name`` (initializers become constants on first use)."""
        v = self.env.get(name)
        if v is None:
            arr = self.initializers.get(name)
            if arr is None:
                raise ShapeError(f"{what} reads value {name!r}, which no node or initializer defines")
            onnx_dtype_of_array(arr, f"initializer {name!r}")
            v = self.env[name] = self.b.constant(arr)
        return v

    def run(self, node: OnnxNode) -> None:
        """Lower one node, binding its outputs; errors are re-raised naming the node.

        A node without a converter, or whose converter refuses it (UnsupportedOpError, e.g. an
        operand that is not static), goes to :func:`.fallback.lower_fallback`; that raises
        :class:`.fallback.DataDependent` when the output shape depends on data.
        """
        from .fallback import lower_fallback
        from .onnx_ops import CONVERTERS, convert_node

        if node.domain not in ("", "ai.onnx"):
            raise UnsupportedOpError(node.op_type, node.name, f"domain {node.domain!r} is not supported")
        self.b.set_source(node.name)
        try:
            if node.op_type not in CONVERTERS:
                raise UnsupportedOpError(node.op_type, node.name, f"no apollo_py lowering for {node.op_type}")
            outs = convert_node(NodeContext(self, node))
        except UnsupportedOpError as e:
            self.b.set_source(node.name)
            outs = lower_fallback(NodeContext(self, node), e)
        except ApolloError as e:
            msg = str(e)
            prefix = node.describe()
            raise type(e)(msg if msg.startswith(prefix) else f"{prefix}: {msg}") from None
        except (TypeError, ValueError, IndexError, KeyError) as e:
            # malformed attributes (wrong type or length) surface here
            raise ShapeError(f"{node.describe()}: invalid attributes or operands: "
                             f"{type(e).__name__}: {e}") from None
        for name, v in zip(node.outputs, outs):
            if name and v is not None:
                self.env[name] = v
                self.bound_by[name] = node.name


def onnx_dtype_of_array(arr: np.ndarray, what: str) -> str:
    """apollo dtype of a numpy array from the model; ShapeError naming ``what`` if unsupported."""
    if arr.dtype.name not in DTYPES:
        raise ShapeError(f"{what} has dtype {arr.dtype.name}, which apollo_py does not support "
                         f"(supported: {', '.join(DTYPES)})")
    return arr.dtype.name


class NodeContext:
    """What a converter sees: its node, inputs as Values or constants, attributes, the opset."""

    def __init__(self, lowering: Lowering, node: OnnxNode):
        self.lowering = lowering
        self.b = lowering.b
        self.node = node
        self.opset = lowering.opset

    @property
    def n_in(self) -> int:
        return len(self.node.inputs)

    @property
    def n_out(self) -> int:
        return len(self.node.outputs)

    def has(self, i: int) -> bool:
        return i < len(self.node.inputs) and bool(self.node.inputs[i])

    def wants(self, i: int) -> bool:
        """Whether output ``i`` is requested (present and named)."""
        return i < len(self.node.outputs) and bool(self.node.outputs[i])

    def x(self, i: int) -> Value | None:
        """Input ``i`` as a Value, or None when it is absent (optional input)."""
        if not self.has(i):
            return None
        return self.lowering.value(self.node.inputs[i], self.node.describe())

    def need(self, i: int) -> Value:
        """Input ``i`` as a Value; ShapeError naming the node when it is absent."""
        v = self.x(i)
        if v is None:
            raise ShapeError(f"{self.node.describe()}: input {i} is required")
        return v

    def inputs(self) -> list[Value]:
        """Every present input, in order (for variadic ops)."""
        return [self.need(i) for i in range(self.n_in) if self.has(i)]

    def const(self, i: int, default=None):
        """Input ``i`` as a numpy array (it must be computable at compile time), or ``default``."""
        v = self.x(i)
        if v is None:
            return default
        arr = self.b.const_value(v)
        if arr is None:
            raise UnsupportedOpError(self.node.op_type, self.node.name,
                                     f"input {i} ({self.node.inputs[i]!r}) must be a constant or "
                                     "computable from shapes; data-dependent shapes are not supported")
        return arr

    def ints(self, i: int, default=None):
        """Input ``i`` as a list of Python ints (compile-time constant), or ``default``."""
        arr = self.const(i)
        return default if arr is None else [int(a) for a in np.asarray(arr).reshape(-1)]

    def attr(self, name: str, default=None):
        """Attribute ``name`` of the node, or ``default``."""
        return self.node.attrs.get(name, default)

    def unsupported(self, detail: str) -> UnsupportedOpError:
        """An UnsupportedOpError for this node (to raise)."""
        return UnsupportedOpError(self.node.op_type, self.node.name, detail)

    def error(self, msg: str) -> ShapeError:
        """A ShapeError naming this node (to raise)."""
        return ShapeError(f"{self.node.describe()}: {msg}")


# --- finishing the graph ------------------------------------------------------------------------


def finalize(b: FoldingBuilder, inputs: list[str], outputs: list[tuple[str, Value]],
             sources: Mapping[str, str] | None = None) -> Graph:
    """Build the graph: outputs renamed to their ONNX names, dead nodes (folded shape math) dropped.

    An output that is a graph input, or a value already given to an earlier output, gets a copy
    node so that every graph output is a distinct node output; the copy's provenance is the ONNX
    node that produced the output (``sources``: output name -> node name), e.g. an Identity.
    """
    claimed: set[str] = set()
    final: list[tuple[str, Value]] = []
    for oname, v in outputs:
        if v.name in inputs or v.name in claimed:
            b.set_source((sources or {}).get(oname, ""))
            v = C.copy(b, v)
        claimed.add(v.name)
        final.append((oname, v))
    nodes, types = b.nodes(), b.types()
    rename = {v.name: oname for oname, v in final if v.name != oname}
    targets = set(rename.values())
    for t in list(targets):
        if t in types and t not in rename and t not in inputs:
            fresh = t
            while fresh in types or fresh in targets:
                fresh = b.fresh("v")
            rename[t] = fresh
    # liveness: the values the outputs depend on (ancestors of a sink fed by every output, in
    # the graph value -> value through each node), and the nodes producing them
    producer = {o: n for n in nodes for o in n.outputs}
    sink = object()
    values = nx.DiGraph((i, o) for n in nodes for i in n.inputs for o in n.outputs)
    values.add_edges_from((v.name, sink) for _, v in final)
    seen: set[str] = nx.ancestors(values, sink)
    live = {id(producer[v]) for v in seen if v in producer}

    def rn(x):
        return rename.get(x, x)

    kept = [n.replace(inputs=tuple(rn(i) for i in n.inputs), outputs=tuple(rn(o) for o in n.outputs))
            for n in nodes if id(n) in live]
    seen.update(o for n in nodes if id(n) in live for o in n.outputs)  # unused outputs of live nodes
    new_types = {rn(k): t for k, t in types.items() if k in seen or k in inputs}
    g = Graph(tuple(inputs), tuple(oname for oname, _ in final), tuple(kept), new_types, b.name)
    return verify(g)
