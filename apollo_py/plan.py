"""The fusion plan: what the compiler made of a graph, for users and for tests.

``Plan.graph`` is the primitive graph after preprocessing; the partition stage fills
``micro_graphs`` and later stages ``kernels``.  ``str(plan)`` is a readable table,
``plan.to_json()`` a JSON document.  :func:`apollo_py.explain` returns the plan of a model
without running it.

``plan.coverage`` (:class:`Coverage`) counts what apollo_py lowered itself against what runs
through ``onnx.reference`` (fallback).  The unit is the ONNX source node: an ONNX node counts
as *compiled* when it produced at least one primitive other than a constant or ``onnx_op``,
as *fallback* when it became an ``onnx_op`` primitive or was run at a staged split; ONNX nodes
folded away entirely at compile time (Constant, shape arithmetic) are in neither.  Primitives
without a source node (builder graphs) count one op each.  Every fallback op is listed, with
its reason, in ``str(plan)``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from .ir.graph import Graph


@dataclass(frozen=True)
class Coverage:
    """ONNX ops compiled vs ops in fallback (see the module docstring for the unit).

    ``fallback`` lists ``(node name, op type, reason)`` per fallback op; ``primitives_*`` count
    the same in primitive nodes (constants excluded)."""

    compiled: int = 0
    fallback_count: int = 0
    primitives_compiled: int = 0
    primitives_fallback: int = 0
    fallback: tuple = ()

    @property
    def total(self) -> int:
        return self.compiled + self.fallback_count

    @property
    def fraction(self) -> float:
        """Share of counted ops that are compiled (1.0 for an empty plan)."""
        return self.compiled / self.total if self.total else 1.0

    def __add__(self, other: "Coverage") -> "Coverage":
        return Coverage(self.compiled + other.compiled, self.fallback_count + other.fallback_count,
                        self.primitives_compiled + other.primitives_compiled,
                        self.primitives_fallback + other.primitives_fallback, self.fallback + other.fallback)

    def to_dict(self) -> dict[str, Any]:
        return {"ops_compiled": self.compiled, "ops_fallback": self.fallback_count,
                "primitives_compiled": self.primitives_compiled, "primitives_fallback": self.primitives_fallback,
                "fallback": [{"node": n, "op_type": t, "reason": r} for n, t, r in self.fallback]}

    def __str__(self) -> str:
        return (f"coverage: {self.compiled} ops compiled, {self.fallback_count} in fallback "
                f"({100 * self.fraction:.1f}% compiled; primitives {self.primitives_compiled} compiled, "
                f"{self.primitives_fallback} fallback)")


#: op name -> ``f(node) -> [(attribute, Plan)]``: the plans of the subgraphs a node of that op
#: compiled (control flow).  The front end that defines such an op registers it
#: (frontend/control_flow.py registers ``onnx_op``): the plan, a value the compiler produces,
#: does not import the front end.
BODY_PLANS: dict = {}


def node_bodies(node) -> list:
    """(attribute, plan) of the compiled subgraphs of a control-flow node that ran."""
    bodies = BODY_PLANS.get(node.op)
    return bodies(node) if bodies is not None else []


def bodies_coverage(bodies) -> Coverage:
    cov = Coverage()
    for _, plan in bodies:
        cov = cov + plan.coverage
    return cov


def body_lines(bodies, indent: str = "  ") -> list[str]:
    """The plans of compiled subgraphs, indented under a ``body <attr>:`` header each."""
    lines = []
    for name, plan in bodies:
        lines.append(f"{indent}body {name} (compiled by apollo_py, latest specialisation):")
        lines.extend(f"{indent}  | {x}" for x in str(plan).splitlines())
    return lines


def graph_coverage(graph: Graph) -> Coverage:
    """Coverage of a primitive graph and of the compiled bodies of its control-flow nodes."""
    compiled: dict[str, None] = {}
    fallback: dict[str, tuple] = {}
    n_comp = n_fb = 0
    body = Coverage()
    for k, n in enumerate(graph.nodes):
        if n.op == "constant":
            continue
        keys = list(n.source) or [f"#{k} {n.op}"]
        if n.op == "onnx_op":
            n_fb += 1
            body = body + bodies_coverage(node_bodies(n))
            for key in keys:
                fallback.setdefault(key, (key, n.attrs["op_type"], n.attrs.get("reason", "")))
        else:
            n_comp += 1
            for key in keys:
                compiled.setdefault(key)
    comp = [k for k in compiled if k not in fallback]
    return Coverage(len(comp), len(fallback), n_comp, n_fb, tuple(fallback.values())) + body


def fallback_text(node) -> str:
    """``fallback <OpType> 'name': reason`` for an ``onnx_op`` primitive."""
    src = ", ".join(node.source) or node.label
    return f"fallback {node.attrs['op_type']} {src!r}: {node.attrs.get('reason') or 'run by onnx.reference'}"


@dataclass(frozen=True)
class Plan:
    """Compile result summary: primitive graph, micro-graphs and kernels (as they exist)."""

    graph: Graph
    micro_graphs: tuple = ()
    kernels: tuple = ()
    notes: tuple[str, ...] = field(default=())
    timings: tuple = ()     # (compile stage, seconds) in order: where the compile's time went
    #: the executable's dispatches of kernel steps, as tuples of indices into ``kernels`` (one
    #: tuple per launch; a layer-3 group of independent kernels run as one parallel region has
    #: several members); empty when the target does not say
    launches: tuple = ()

    @property
    def coverage(self) -> Coverage:
        """ONNX ops compiled vs in fallback (:class:`Coverage`)."""
        return graph_coverage(self.graph)

    @property
    def primitives(self) -> list[dict[str, Any]]:
        """One entry per primitive node: op, outputs, and the source nodes it came from."""
        return [{"op": n.op, "outputs": list(n.outputs), "source": list(n.source)} for n in self.graph.nodes]

    def to_json(self) -> str:
        doc = {"graph": self.graph.name, "primitives": self.primitives,
               "micro_graphs": [m.to_dict() for m in self.micro_graphs],
               "kernels": [k.to_dict() for k in self.kernels], "notes": list(self.notes),
               "coverage": self.coverage.to_dict(), "launches": [list(g) for g in self.launches],
               "timings": {name: round(t, 4) for name, t in self.timings}}
        return json.dumps(doc, indent=1)

    def to_html(self, profile=None) -> str:
        """One self-contained HTML page (inline SVG, no scripts) drawing every step with its
        ops, reduce form, parallel dims, tiles, bytes, flops (and time, given a
        ``CompiledGraph.profile`` result), the refusals and each step's source (plan_html.py)."""
        from .plan_html import render_html
        return render_html(self, profile)

    def micro_graph_table(self) -> str:
        """One row per micro-graph: index, kind, rules applied, ops, ``<- source nodes``."""
        rows = [("#", "kind", "rules", "ops <- sources")]
        for k, m in enumerate(self.micro_graphs):
            src = f"  <- {', '.join(m.source_nodes)}" if m.source_nodes else ""
            fb = [fallback_text(n) for n in m.nodes if n.op == "onnx_op"]
            if fb:
                src += "  [" + "; ".join(fb) + "]"
            rows.append((str(k), m.kind, ",".join(m.rules) or "-", " ".join(m.ops) + src))
        w = [max(len(r[c]) for r in rows) for c in range(3)]
        return "\n".join(f"  {r[0]:>{w[0]}}  {r[1]:<{w[1]}}  {r[2]:<{w[2]}}  {r[3]}" for r in rows)

    def __str__(self) -> str:
        lines = [f"plan for {self.graph.name!r}: {len(self.graph.nodes)} primitives"]
        if self.micro_graphs:
            lines.append(f"{len(self.micro_graphs)} micro-graphs:")
            lines.append(self.micro_graph_table())
        else:
            for n in self.graph.nodes:
                src = f"  <- {', '.join(n.source)}" if n.source else ""
                if n.op == "onnx_op":
                    src += f"  [{fallback_text(n)}]"
                lines.append(f"  {n.op:<14} {', '.join(n.outputs)}{src}")
        if self.kernels:
            n_gen = sum(1 for k in self.kernels if getattr(k, "fused", None) is not None
                        or getattr(k, "gemm", None) is not None)
            n_blas = sum(1 for k in self.kernels if getattr(k, "blas", None) is not None)
            blas = f"{n_blas} BLAS calls, " if n_blas else ""
            groups = {g[0]: g for g in (sorted(g) for g in self.launches) if len(g) > 1}
            grouped = {k for g in groups.values() for k in g}
            launch = (f", {len(self.launches)} kernel launch{'es' if len(self.launches) != 1 else ''}"
                      if self.launches else "")
            lines.append(f"{len(self.kernels)} steps ({n_gen} generated kernels, {blas}"
                         f"{len(self.kernels) - n_gen - n_blas} numpy steps{launch}):")

            def step_text(k):
                fb = [fallback_text(n) for n in getattr(self.kernels[k], "nodes", ()) if n.op == "onnx_op"]
                return '; '.join(fb) if fb else self.kernels[k].describe()
            for k in range(len(self.kernels)):
                if k in groups:     # one layer-3 launch: its members under one entry
                    lines.append(f"  {k:>2}  launch of {len(groups[k])} independent kernels "
                                 f"(layer 3, one parallel region): steps {', '.join(map(str, groups[k]))}")
                    lines.extend(f"      {j:>2}  {step_text(j)}" for j in groups[k])
                elif k not in grouped:
                    lines.append(f"  {k:>2}  {step_text(k)}")
        for n in self.graph.nodes:
            bodies = node_bodies(n)
            if bodies:
                lines.append(f"{fallback_text(n)}; its subgraphs:")
                lines.extend(body_lines(bodies))
        lines.append(str(self.coverage))
        if self.timings:
            lines.append("compile time: " + ", ".join(f"{name} {t:.2f} s" for name, t in self.timings))
        lines.extend(f"note: {s}" for s in self.notes)
        return "\n".join(lines)


@dataclass(frozen=True)
class StagedPlan:
    """Plan of a model split at a node whose output shape depends on data (frontend.staged).

    ``head``: plan of the compiled part before the node (None if empty); ``node``: (name, op
    type, reason) of the node run through onnx.reference; ``tail``: plan of the most recent
    run-time specialisation of the rest (None before the first call); ``n_tails``: how many."""

    head: Any
    node: tuple
    tail: Any = None
    n_tails: int = 0
    bodies: tuple = ()

    @property
    def coverage(self) -> Coverage:
        name, op_type, reason = self.node
        cov = Coverage(0, 1, 0, 1, ((name, op_type, reason),)) + bodies_coverage(self.bodies)
        if self.head is not None:
            cov = self.head.coverage + cov
        if self.tail is not None:
            cov = cov + self.tail.coverage
        return cov

    def to_json(self) -> str:
        doc = {"head": json.loads(self.head.to_json()) if self.head is not None else None,
               "split": {"node": self.node[0], "op_type": self.node[1], "reason": self.node[2]},
               "tail": json.loads(self.tail.to_json()) if self.tail is not None else None,
               "tail_specialisations": self.n_tails,
               "bodies": {k: json.loads(p.to_json()) for k, p in self.bodies}, "coverage": self.coverage.to_dict()}
        return json.dumps(doc, indent=1)

    def __str__(self) -> str:
        name, op_type, reason = self.node
        lines = ["staged plan (a node's output shape depends on input data):"]
        lines.append("stage 1, compiled for the input shapes:")
        lines.extend("  | " + x for x in (str(self.head) if self.head is not None else "(nothing)").splitlines())
        lines.append(f"stage 2: fallback {op_type} {name!r}: {reason} (run by onnx.reference on the "
                     "concrete values)")
        lines.extend(body_lines(self.bodies))
        if self.tail is None:
            lines.append("stage 3: the rest, compiled per shape at run time (not run yet)")
        else:
            lines.append(f"stage 3: the rest, compiled per shape at run time ({self.n_tails} "
                         "specialisation(s); latest):")
            lines.extend("  | " + x for x in str(self.tail).splitlines())
        lines.append(str(self.coverage))
        return "\n".join(lines)
