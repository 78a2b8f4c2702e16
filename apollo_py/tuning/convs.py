"""Decisions of direct convs (codegen/conv_direct.py; ``conv:`` pieces, docs/design/tuning.md).

A direct conv has no :class:`~apollo_py.codegen.gemm.Blocking`; what its builder fixes by rule
and the tuner may choose instead:

* ``{"form": "flat" | "row"}``: the padded kernel's tap sum as one vector loop over the
  flattened padded plane, or per output row -- the rule is ``FLAT_MAX_OW`` (flat below 32
  output columns); "flat" applies only where the flat form is possible at all
  (:func:`~apollo_py.codegen.conv_direct.flat_form`'s other conditions);
* ``{"threads": 1 | 2}``: on the calling thread or the pool (the rule: ``INLINE_BYTES``).

The piece key hashes the descriptor with its value names made canonical (the same conv in
every block is one piece) and without the decision's own field.
"""
from __future__ import annotations

import hashlib
from dataclasses import replace

#: candidate rounds over direct convs, in this order
CONV_ROUNDS = ("conv form", "conv threads")


def direct_key(d) -> str:
    """``conv:`` + digest of direct conv ``d`` (sizes, epilogue, squeeze / excitation) with
    canonical value names."""
    names: dict = {}

    def nm(v):
        return names.setdefault(v, f"v{len(names)}") if v else v

    def node(n):
        return n.replace(inputs=tuple(nm(v) for v in n.inputs), outputs=tuple(nm(v) for v in n.outputs),
                         name="", source=())
    c = replace(d, name="", form="", head=nm(d.head), nodes=tuple(node(n) for n in d.nodes),
                operands=tuple(replace(o, value=nm(o.value)) for o in d.operands),
                outputs=tuple(nm(v) for v in d.outputs),
                inline_consts={nm(k): v for k, v in sorted(d.inline_consts.items())})
    if d.squeeze is not None:
        sq = d.squeeze
        c = replace(c, squeeze=replace(sq, value=nm(sq.value), reduce=nm(sq.reduce),
                                       nodes=tuple(node(n) for n in sq.nodes), outputs=tuple(nm(v) for v in sq.outputs),
                                       inline_consts={nm(k): v for k, v in sorted(sq.inline_consts.items())}))
    if d.excite is not None:
        ex = d.excite
        c = replace(c, excite=replace(ex, value=nm(ex.value), operand=nm(ex.operand), output=nm(ex.output)))
    return "conv:" + hashlib.sha256(repr(c).encode()).hexdigest()[:32]


def apply_direct(d, decision):
    """``(descriptor, inline or None)`` of direct conv ``d`` under ``decision`` (None: the
    rule's thread choice); unknown fields and values are ignored."""
    if not decision:
        return d, None
    if decision.get("form") in ("flat", "row"):
        d = replace(d, form=decision["form"])
    t = decision.get("threads")
    return d, (t == 1) if t in (1, 2) else None


def direct_candidates(d, decision: dict, inline: bool, threads: int) -> dict[str, dict]:
    """Round label -> decision for direct conv ``d`` (compiled ``inline`` now): only those
    that change its code or its thread choice."""
    from ..codegen.conv_direct import flat_form, is_matvec
    out = {}
    decision = dict(decision or {})
    cur, _ = apply_direct(d, decision)
    if not is_matvec(d.conv):
        flat = flat_form(cur)
        if flat:
            out["conv form"] = {**decision, "form": "row"}
        elif flat_form(replace(cur, form="flat")):
            out["conv form"] = {**decision, "form": "flat"}
    if threads > 1:
        out["conv threads"] = {**decision, "threads": 2 if inline else 1}
    return out
