"""Export a primitive graph (traced or imported) as a standard ONNX model.

:func:`to_onnx` maps every primitive to standard ONNX ops (opset 17) and first *re-folds*
compound patterns that have a standard op: the primitive chains that the ONNX importer and
``ap.nn`` produce for Softmax (reduce_max -> sub -> exp -> reduce_sum -> div) and LogSoftmax
(reduce_max -> sub -> exp -> reduce_sum -> log -> sub) become one Softmax / LogSoftmax node, and
the layer-norm chain (mean, centre, variance, eps, rsqrt, scale[, bias]) one LayerNormalization,
when their intermediates have no other use.  ``onnx_op`` fallback nodes (control flow included)
are written back as the ONNX node they came from.  The result passes ``onnx.checker`` and runs
in onnxruntime.

:func:`export` is the user entry: ``ap.export(fn, *example_args)`` for a Python function (traced
for those arguments), a jitted function, a :class:`~apollo_py.api.CompiledGraph` (its latest
specialisation) or a Graph (``export`` lives in :mod:`.jit`, which traces).
"""
from __future__ import annotations

from math import prod
from typing import Any

import numpy as np

from ..errors import InputError, UnsupportedOpError
from ..ir.graph import Graph, Node

OPSET = 17
IR_VERSION = 8  # opset-17 era; read by every onnxruntime >= 1.13

_SIMPLE = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div", "pow": "Pow", "max": "Max",
           "min": "Min", "eq": "Equal", "lt": "Less", "le": "LessOrEqual", "gt": "Greater",
           "ge": "GreaterOrEqual", "and": "And", "or": "Or", "xor": "Xor", "not": "Not",
           "neg": "Neg", "abs": "Abs", "exp": "Exp", "log": "Log", "sqrt": "Sqrt", "tanh": "Tanh",
           "erf": "Erf", "sigmoid": "Sigmoid", "relu": "Relu", "floor": "Floor", "ceil": "Ceil",
           "reciprocal": "Reciprocal", "where": "Where", "matmul": "MatMul",
           "stop_gradient": "Identity"}


def _onnx_dtype(name: str) -> int:
    from onnx import helper
    return helper.np_dtype_to_tensor_dtype(np.dtype(name))


class _Exporter:
    """Writes one Graph as ONNX nodes; ``prefix`` keeps subgraph names apart from the outer
    scope's (ONNX wants every name assigned once across nested graphs)."""

    def __init__(self, graph: Graph, prefix: str = "", top: bool = True):
        self.g, self.prefix, self.top = graph, prefix, top
        self.nodes: list = []
        self.inits: list = []
        self._k = 0
        self.names: dict[str, str] = {}

    def name(self, v: str) -> str:
        return self.names.get(v) or (self.prefix + v)

    def fresh(self, hint: str) -> str:
        self._k += 1
        return f"{self.prefix}{hint}__x{self._k}"

    def node(self, op: str, inputs, outputs, **attrs):
        from onnx import helper
        self.nodes.append(helper.make_node(op, list(inputs), list(outputs), **attrs))
        return outputs[0] if outputs else None

    def const(self, arr, hint: str = "c", out: str | None = None) -> str:
        from onnx import numpy_helper
        arr = np.ascontiguousarray(arr)
        name = out or self.fresh(hint)
        t = numpy_helper.from_array(arr, name)
        if self.top and out is None:
            self.inits.append(t)
        else:
            self.node("Constant", [], [name], value=t)
        return name

    def ints(self, values, hint="i") -> str:
        return self.const(np.asarray(list(values), np.int64), hint)

    # -- patterns ------------------------------------------------------------------------
    def _single_use(self, v: str, user: Node) -> bool:
        cons = self.g.consumers.get(v, [])
        return v not in self.g.outputs and len(cons) == 1 and cons[0] is user

    def fold_patterns(self) -> tuple[dict[str, Node], set[int]]:
        """(output value -> replacement marker, ids of nodes folded away)."""
        prod_ = self.g.producers
        repl: dict[str, Any] = {}
        folded: set[int] = set()

        def red(v, op):
            n = prod_.get(v)
            if n is None or n.op != op or not n.attrs["keepdims"] or len(n.attrs["axes"]) != 1:
                return None
            return n

        for n in self.g.nodes:
            if n.op == "div":                       # softmax: e / reduce_sum(e), e = exp(x - max x)
                e, s = n.inputs
                sn, en = red(s, "reduce_sum"), prod_.get(e)
                if sn is None or en is None or en.op != "exp" or sn.inputs[0] != e:
                    continue
                dn = prod_.get(en.inputs[0])
                if dn is None or dn.op != "sub":
                    continue
                mn = red(dn.inputs[1], "reduce_max")
                x = dn.inputs[0]
                if mn is None or mn.inputs[0] != x or mn.attrs["axes"] != sn.attrs["axes"]:
                    continue
                cons_e = self.g.consumers.get(e, [])
                if e in self.g.outputs or len(cons_e) != 2 or not all(c in (n, sn) for c in cons_e):
                    continue
                if not (self._single_use(s, n) and self._single_use(en.inputs[0], en)
                        and self._single_use(dn.inputs[1], dn)):
                    continue
                repl[n.outputs[0]] = ("Softmax", x, mn.attrs["axes"][0])
                folded.update(id(k) for k in (sn, en, dn, mn))
            elif n.op == "sub":                     # log_softmax: d - log(reduce_sum(exp(d)))
                d, lg = n.inputs
                ln = prod_.get(lg)
                dn = prod_.get(d)
                if ln is None or ln.op != "log" or dn is None or dn.op != "sub":
                    continue
                sn = red(ln.inputs[0], "reduce_sum")
                en = prod_.get(sn.inputs[0]) if sn is not None else None
                if en is None or en.op != "exp" or en.inputs[0] != d:
                    continue
                mn = red(dn.inputs[1], "reduce_max")
                x = dn.inputs[0]
                if mn is None or mn.inputs[0] != x or mn.attrs["axes"] != sn.attrs["axes"]:
                    continue
                cons_d = self.g.consumers.get(d, [])
                if d in self.g.outputs or len(cons_d) != 2 or not all(c in (n, en) for c in cons_d):
                    continue
                if not (self._single_use(lg, n) and self._single_use(ln.inputs[0], ln)
                        and self._single_use(sn.inputs[0], sn) and self._single_use(dn.inputs[1], dn)):
                    continue
                repl[n.outputs[0]] = ("LogSoftmax", x, mn.attrs["axes"][0])
                folded.update(id(k) for k in (ln, sn, en, dn, mn))
        for n in self.g.nodes:
            if n.op == "mul" and id(n) not in folded:
                hit = self._layer_norm(n)
                if hit is not None:
                    out, value, nodes = hit
                    repl[out] = value
                    folded.update(id(k) for k in nodes)
                    folded.discard(id(self.g.producers[out]))
        return repl, folded

    def _layer_norm(self, n: Node):
        """The LayerNormalization chain of ``ops.compound.layer_norm`` ending in ``mul(yn, scale)``
        (and an optional ``add(., bias)``): (output, replacement, nodes) or None."""
        g, prod_ = self.g, self.g.producers

        def p(v, op):
            m = prod_.get(v)
            return m if m is not None and m.op == op else None

        def const(v):
            c = g.constant_value(v)
            return None if c is None or np.size(c) != 1 else float(np.asarray(c).reshape(-1)[0])

        yn, scale = n.inputs
        ynn = p(yn, "mul")
        if ynn is None:
            return None
        d, inv = ynn.inputs
        dn, invn = p(d, "sub"), p(inv, "reciprocal")
        sdn = p(invn.inputs[0], "sqrt") if invn is not None else None
        ven = p(sdn.inputs[0], "add") if sdn is not None else None
        varn = p(ven.inputs[0], "div") if ven is not None else None
        s2n = p(varn.inputs[0], "reduce_sum") if varn is not None else None
        sqn = p(s2n.inputs[0], "mul") if s2n is not None else None
        if dn is None or sqn is None or sqn.inputs != (d, d):
            return None
        x, mean = dn.inputs
        meann = p(mean, "div")
        s1n = p(meann.inputs[0], "reduce_sum") if meann is not None else None
        if s1n is None or s1n.inputs[0] != x:
            return None
        xt = g.types[x]
        axes = tuple(s1n.attrs["axes"])
        if (axes != tuple(s2n.attrs["axes"]) or not axes or axes != tuple(range(axes[0], xt.rank))
                or not s1n.attrs["keepdims"] or not s2n.attrs["keepdims"]):
            return None
        count = prod(xt.shape[a] for a in axes)
        eps = const(ven.inputs[1])
        if const(meann.inputs[1]) != count or const(varn.inputs[1]) != count or eps is None:
            return None
        norm = xt.shape[axes[0]:]
        st = g.types[scale]
        if st.dtype != xt.dtype or st.rank > len(norm) or tuple(np.broadcast_shapes(st.shape, norm)) != norm:
            return None
        chain = [ynn, dn, invn, sdn, ven, varn, s2n, sqn, meann, s1n]
        uses = {yn: 1, inv: 1, invn.inputs[0]: 1, sdn.inputs[0]: 1, ven.inputs[0]: 1, varn.inputs[0]: 1,
                s2n.inputs[0]: 1, mean: 1, meann.inputs[0]: 1, d: 2}
        for v, k in uses.items():
            if v in g.outputs or len(g.consumers.get(v, [])) != k:
                return None
        out, inputs = n.outputs[0], [x, scale]
        cons = g.consumers.get(out, [])
        if out not in g.outputs and len(cons) == 1 and cons[0].op == "add" and cons[0].inputs[0] == out:
            bias = cons[0].inputs[1]
            bt = g.types[bias]
            if bt.dtype == xt.dtype and bt.rank <= len(norm) and tuple(np.broadcast_shapes(bt.shape, norm)) == norm:
                chain.append(n)
                out, inputs = cons[0].outputs[0], [x, scale, bias]
        return out, ("LayerNormalization", inputs, axes[0], eps), chain

    # -- nodes ---------------------------------------------------------------------------
    def emit_all(self):
        repl, folded = self.fold_patterns()
        for n in self.g.nodes:
            if id(n) in folded:
                continue
            r = repl.get(n.outputs[0]) if n.outputs else None
            if r is not None and r[0] == "LayerNormalization":
                self.node(r[0], [self.name(v) for v in r[1]], [self.name(n.outputs[0])], axis=int(r[2]),
                          epsilon=float(r[3]))
                continue
            if r is not None:
                self.node(r[0], [self.name(r[1])], [self.name(n.outputs[0])], axis=int(r[2]))
                continue
            self.emit(n)

    def emit(self, n: Node):
        a = n.attrs
        ins = [self.name(v) for v in n.inputs]
        out = self.name(n.outputs[0]) if n.outputs else None
        t = self.g.types[n.outputs[0]] if n.outputs else None
        op = n.op
        if op in _SIMPLE:
            self.node(_SIMPLE[op], ins, [out])
        elif op == "constant":
            self._constant(n, out)
        elif op == "ne":
            self.node("Not", [self.node("Equal", ins, [self.fresh("eq")])], [out])
        elif op == "rsqrt":
            self.node("Reciprocal", [self.node("Sqrt", ins, [self.fresh("sqrt")])], [out])
        elif op == "cast":
            self.node("Cast", ins, [out], to=_onnx_dtype(a["to"]))
        elif op == "broadcast_to":
            self.node("Expand", [ins[0], self.ints(a["shape"], "shape")], [out])
        elif op.startswith("reduce_"):
            axes = tuple(a["axes"])
            if not axes:
                self.node("Identity", ins, [out])
            elif op == "reduce_sum":
                self.node("ReduceSum", [ins[0], self.ints(axes, "axes")], [out], keepdims=int(a["keepdims"]))
            else:
                self.node({"reduce_max": "ReduceMax", "reduce_min": "ReduceMin",
                           "reduce_prod": "ReduceProd"}[op], ins, [out], axes=list(axes),
                          keepdims=int(a["keepdims"]))
        elif op == "iota":
            from ..ops.registry import get_op
            self.const(get_op("iota").reference([], a)[0], out=out)
        elif op == "reshape":
            self.node("Reshape", [ins[0], self.ints(a["shape"], "shape")], [out])
        elif op == "transpose":
            self.node("Transpose", ins, [out], perm=list(a["perm"]))
        elif op == "slice":
            big = np.iinfo(np.int64)
            ends = [e if e >= 0 else (big.min if st < 0 else big.max) for e, st in zip(a["ends"], a["steps"])]
            r = len(a["starts"])
            self.node("Slice", [ins[0], self.ints(a["starts"], "starts"), self.ints(ends, "ends"),
                                self.ints(range(r), "axes"), self.ints(a["steps"], "steps")], [out])
        elif op == "concat":
            self.node("Concat", ins, [out], axis=int(a["axis"]))
        elif op == "pad":
            if a["mode"] == "wrap":
                raise UnsupportedOpError("pad", n.label, "mode 'wrap' needs ONNX opset 19; export uses 17")
            pv = [ins[0], self.ints(a["pads"], "pads")]
            if a["mode"] == "constant":
                pv.append(self.const(np.asarray(a["value"], t.np_dtype), "pad_value"))
            self.node("Pad", pv, [out], mode=a["mode"])
        elif op == "gather":
            self.node("Gather", ins, [out], axis=int(a["axis"]))
        elif op == "conv":
            self.node("Conv", ins, [out], strides=list(a["strides"]), pads=list(a["pads"]),
                      dilations=list(a["dilations"]), group=int(a["group"]))
        elif op == "window_reduce":
            self._window(n, ins[0], out)
        elif op == "onnx_op":
            self._onnx_op(n, ins)
        elif op == "recurrent":
            self._recurrent(n, ins)
        elif op == "resize2d":
            self._resize2d(n, ins, out)
        else:
            raise UnsupportedOpError(op, n.label, "no ONNX export for this primitive")

    def _constant(self, n: Node, out: str):
        arr = n.attrs["value"].array
        if self.top and n.outputs[0] not in self.g.outputs:
            from onnx import numpy_helper
            self.inits.append(numpy_helper.from_array(np.ascontiguousarray(arr), out))
        else:
            self.const(arr, out=out)

    def _window(self, n: Node, x: str, out: str):
        a = n.attrs
        k = list(a["kernel"])
        nsp = len(k)
        xt, ot = self.g.types[n.inputs[0]], self.g.types[n.outputs[0]]
        lead = xt.shape[:xt.rank - nsp]
        need = len(lead) != 2
        if need:  # ONNX pools want (N, C, spatial...): fold the leading dims into C
            x = self.node("Reshape", [x, self.ints((1, prod(lead)) + xt.shape[-nsp:], "shape")],
                          [self.fresh("pool_in")])
        res = self.fresh("pool") if need else out
        if a["reducer"] == "max":
            self.node("MaxPool", [x], [res], kernel_shape=k, strides=list(a["strides"]),
                      pads=list(a["pads"]), dilations=list(a["dilations"]))
        else:
            if any(d != 1 for d in a["dilations"]):
                raise UnsupportedOpError("window_reduce", n.label, "a dilated window sum needs opset 19")
            avg = self.node("AveragePool", [x], [self.fresh("avg")], kernel_shape=k,
                            strides=list(a["strides"]), pads=list(a["pads"]), count_include_pad=1)
            res = self.node("Mul", [avg, self.const(np.asarray(prod(k), ot.np_dtype), "count")],
                            [res if need else out])
        if need:
            self.node("Reshape", [res, self.ints(ot.shape, "shape")], [out])

    def _resize2d(self, n: Node, ins: list[str], out: str):
        """The ``resize2d`` primitive (ops/resize2d.py) as per-axis Gathers of its tap tables, each
        tap scaled by its weights and summed (rows, then columns)."""
        x, ty, wy, tx, wx = ins
        taps = int(n.attrs["taps"])
        cur = x
        for axis, idx, wt in ((2, ty, wy), (3, tx, wx)):
            terms = []
            for t in range(taps):
                k = self.const(np.array([t], np.int64), "tap")
                it, its, g = self.fresh("tap_idx"), self.fresh("tap_idx"), self.fresh("rs_g")
                self.node("Gather", [idx, k], [it], axis=0)
                self.node("Squeeze", [it, self.const(np.array([0], np.int64), "axes")], [its])
                self.node("Gather", [cur, its], [g], axis=axis)
                if taps == 1:
                    terms.append(g)
                    continue
                w, ws, m = self.fresh("tap_w"), self.fresh("tap_w"), self.fresh("rs_m")
                self.node("Gather", [wt, k], [w], axis=0)
                # [1, OH] -> [OH, 1] for rows; [1, OW] as is for columns
                self.node("Reshape", [w, self.const(np.array([-1, 1] if axis == 2 else [1, -1], np.int64),
                                                    "shape")], [ws])
                self.node("Mul", [g, ws], [m])
                terms.append(m)
            nxt = out if axis == 3 else self.fresh("rs_rows")
            if len(terms) == 1:
                self.node("Identity", terms, [nxt])
            else:
                self.node("Add", terms, [nxt])
            cur = nxt

    def _recurrent(self, n: Node, ins: list[str]):
        """The ``recurrent`` primitive as the ONNX LSTM / GRU / RNN node it runs: its input is
        the projected ``xp`` (so W selects direction d's columns and the folded biases are 0;
        GRU's ``Rbh`` and LSTM's peepholes come from ``aux``)."""
        from ..ops.recurrent import ACTIVATIONS, GATES
        a = n.attrs
        cell, hsz, nd = a["cell"], int(a["hidden"]), len(a["directions"])
        gh = GATES[cell] * hsz
        dt = self.g.types[n.inputs[0]].np_dtype
        w = np.zeros((nd, gh, nd * gh), dt)
        for d in range(nd):
            w[d, :, d * gh:(d + 1) * gh] = np.eye(gh, dtype=dt)
        xp, r, h0, lens, aux = ins[:5]
        bias = ""
        if cell == "gru" and a["lbr"]:   # B's last H columns per direction are Rbh
            bias = self.fresh("B")
            self.node("Concat", [self.const(np.zeros((nd, 2 * gh - hsz), dt), "zeros"), aux], [bias], axis=1)
        if a.get("rt"):     # the primitive reads R^T in blocks of columns: ONNX takes R
            t1, t2, r_rows = self.fresh("R"), self.fresh("R"), self.fresh("R")
            self.node("Transpose", [r], [t1], perm=[0, 2, 1, 3])
            self.node("Reshape", [t1, self.const(np.array([nd, hsz, gh], np.int64), "shape")], [t2])
            self.node("Transpose", [t2], [r_rows], perm=[0, 2, 1])
            r = r_rows
        inputs = [xp, self.const(w, "W"), r, bias, lens, h0]
        if cell == "lstm":
            inputs += [ins[5], aux if a["peephole"] else ""]
        acts = [act for per_dir in a["acts"] for act in per_dir]
        alphas = [float(al) for name, al, _ in acts if ACTIVATIONS[name][0] is not None]
        betas = [float(be) for name, _, be in acts if ACTIVATIONS[name][1] is not None]
        attrs = dict(hidden_size=hsz, activations=[name for name, _, _ in acts],
                     direction="bidirectional" if nd == 2 else a["directions"][0])
        if alphas:
            attrs["activation_alpha"] = alphas
        if betas:
            attrs["activation_beta"] = betas
        if float(a["clip"]) >= 0:
            attrs["clip"] = float(a["clip"])
        if cell == "gru":
            attrs["linear_before_reset"] = int(a["lbr"])
        if cell == "lstm":
            attrs["input_forget"] = int(a["input_forget"])
        self.node(cell.upper(), inputs, [self.name(o) for o in n.outputs], **attrs)

    def _onnx_op(self, n: Node, ins: list[str]):
        import onnx
        a = n.attrs
        proto = onnx.NodeProto()
        proto.ParseFromString(bytes.fromhex(a["node"]))
        captures = tuple(a.get("captures", ()))
        n_present = len(ins) - len(captures)
        present = iter(ins[:n_present])
        new_in = [next(present) if name else "" for name in proto.input]
        for c, v in zip(captures, ins[n_present:]):
            if c != v:
                self.node("Identity", [v], [c])
        del proto.input[:]
        proto.input.extend(new_in)
        outs = [self.name(o) for o in n.outputs]
        new_out = list(proto.output)
        for k, o in enumerate(outs):
            if k < len(new_out):
                new_out[k] = o
        del proto.output[:]
        proto.output.extend(new_out)
        if a["domain"] not in ("", "ai.onnx"):
            raise UnsupportedOpError(a["op_type"], n.label, f"domain {a['domain']!r}")
        self.nodes.append(proto)

    def value_info(self, v: str, name: str | None = None):
        from onnx import helper
        t = self.g.types[v]
        return helper.make_tensor_value_info(name or self.name(v), _onnx_dtype(t.dtype), list(t.shape))


def _used_names(nodes) -> set:
    """Every name a node reads, inside subgraphs (If/Loop bodies read outer names) included."""
    import onnx
    used = set()
    for nd in nodes:
        used.update(nd.input)
        for a in nd.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                used |= _used_names(a.g.node)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for sub in a.graphs:
                    used |= _used_names(sub.node)
    return used


def _prune_constants(ex: _Exporter, keep: set) -> None:
    """Drop constants only folded-away nodes read (e.g. a softmax chain's)."""
    used = _used_names(ex.nodes) | {ex.name(v) for v in keep}
    ex.inits = [t for t in ex.inits if t.name in used]
    ex.nodes = [nd for nd in ex.nodes if nd.op_type != "Constant" or nd.output[0] in used]


def graph_proto(graph: Graph, prefix: str = "", top: bool = False, input_names=None, name=None):
    """``graph`` as an ONNX GraphProto.  ``input_names``: graph input -> name to use (for
    subgraphs whose inputs are outer values, e.g. captures); those are then not declared
    as graph inputs but read from the enclosing scope."""
    from onnx import helper
    ex = _Exporter(graph, prefix, top)
    outer = dict(input_names or {})
    ex.names.update(outer)
    ex.emit_all()
    _prune_constants(ex, set(graph.outputs) | set(outer.values()))
    inputs = [ex.value_info(v) for v in graph.inputs if v not in outer]
    outputs = [ex.value_info(v) for v in graph.outputs]
    return helper.make_graph(ex.nodes, name or graph.name, inputs, outputs, initializer=ex.inits)


def to_onnx(graph: Graph, name: str | None = None, output_names=None) -> Any:
    """``graph`` as a checked ``onnx.ModelProto`` (opset 17) of standard ops; ``output_names``
    renames the graph outputs (graph inputs keep their names)."""
    import onnx
    from onnx import helper
    if output_names is not None:
        taken = set(graph.types)
        ren = {o: n for o, n in zip(graph.outputs, output_names) if n not in taken or n == o}
        graph = _rename(graph, ren)
    g = graph_proto(graph, top=True, name=name or graph.name)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="apollo_py")
    model.ir_version = IR_VERSION
    onnx.checker.check_model(model)
    return model


def _rename(graph: Graph, ren: dict) -> Graph:
    if not ren:
        return graph
    r = lambda v: ren.get(v, v)  # noqa: E731
    nodes = tuple(n.replace(inputs=tuple(map(r, n.inputs)), outputs=tuple(map(r, n.outputs)))
                  for n in graph.nodes)
    types = {r(k): t for k, t in graph.types.items()}
    return graph.replace(inputs=tuple(map(r, graph.inputs)), outputs=tuple(map(r, graph.outputs)),
                         nodes=nodes, types=types)
