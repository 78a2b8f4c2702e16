"""A plan as one self-contained HTML page: an inline SVG of the steps, and their details.

:func:`render_html` draws every runtime step of a :class:`~apollo_py.plan.Plan` as a box (a
generated kernel, a generated GEMM, a BLAS call or a numpy step) with its ops, reduce form,
parallel dims, tiles, bytes, flops and, given a profile, its time; an arrow joins a step to a
step that reads what it writes.  Boxes of one micro-graph share a colour and are labelled with
its index.  The layout is networkx's: steps are placed by topological generation
(``topological_generations``) and, within one, in the order ``multipartite_layout`` gives.
Below the drawing: the micro-graphs, every refusal with its reason (numpy steps, plan notes)
and each step's generated source, folded (``<details>``), one click from its box.

No network, no scripts: the page is static HTML + SVG + CSS.
"""
from __future__ import annotations

import html
from typing import Any

BOX_W, LINE_H, PAD, GAP_X, GAP_Y = 340, 14, 8, 40, 50
_COLOURS = ("#dbeafe", "#dcfce7", "#fef9c3", "#fce7f3", "#ede9fe", "#ffedd5", "#e0f2fe", "#f1f5f9")
_MAX_SOURCE = 20_000     # characters of source per step (the page stays openable for big models)


def _esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _kind(step) -> str:
    if getattr(step, "blas", None) is not None:
        return "blas"
    if getattr(step, "gemm", None) is not None:
        return "gemm"
    return "kernel" if getattr(step, "fused", None) is not None else "numpy"


def _ops(step) -> list[str]:
    fused = getattr(step, "fused", None)
    nodes = fused.nodes if fused is not None else getattr(step, "nodes", ())
    return [n.op for n in nodes]


def _lines(k: int, step, seconds: float | None) -> list[str]:
    """The text lines of step ``k``'s box."""
    kind = _kind(step)
    fused = getattr(step, "fused", None)
    title = {"kernel": getattr(fused, "name", "kernel"), "gemm": getattr(getattr(step, "gemm", None), "name", "gemm"),
             "blas": "cblas ?gemm", "numpy": "numpy step"}[kind]
    out = [f"#{k} {kind}: {title}"]
    ops = " ".join(_ops(step))
    while ops:                          # wrap at ~48 characters (the box width)
        cut = ops[:48].rfind(" ") if len(ops) > 48 else len(ops)
        cut = cut if cut > 0 else min(len(ops), 48)
        out.append("  " + ops[:cut])
        ops = ops[cut:].lstrip()
    if fused is not None:
        rf = fused.reduce_form
        out.append(f"reduce: {f'{rf.kind} P={rf.P} R={rf.R}' if rf is not None else '-'}; "
                   f"parallel dims {fused.parallel_dims}; tiles {list(fused.tile_sizes) or '-'}")
    elif kind == "numpy":
        out.append(f"why: {getattr(step, 'reason', '')[:48]}")
    nb, fl = getattr(step, "bytes", 0), getattr(step, "flops", 0)
    mb = f"{nb / 1e6:.3g} MB" if nb or kind == "kernel" else "MB: -"     # the plan counts kernels' bytes
    out.append(f"{mb}, {fl / 1e6:.3g} MFLOP" + (f", {seconds * 1e3:.3g} ms" if seconds is not None else ""))
    return out


def _layout(steps) -> tuple[dict[int, tuple[float, float]], list[tuple[int, int]], dict[int, list[str]]]:
    import networkx as nx
    g = nx.DiGraph()
    g.add_nodes_from(range(len(steps)))
    writer = {}
    for k, s in enumerate(steps):
        for v in s.outputs:
            writer[v] = k
    edges = []
    for k, s in enumerate(steps):
        for v in s.inputs:
            w = writer.get(v)
            if w is not None and w != k and not g.has_edge(w, k):
                g.add_edge(w, k)
                edges.append((w, k))
    for layer, gen in enumerate(nx.topological_generations(g)):
        for n in gen:
            g.nodes[n]["layer"] = layer
    pos = nx.multipartite_layout(g, subset_key="layer", align="horizontal") if len(steps) > 1 else {0: (0, 0)}
    return pos, edges, {n: g.nodes[n].get("layer", 0) for n in g.nodes}


def render_html(plan, profile=None, title: str | None = None) -> str:
    """The page for ``plan`` (a Plan); ``profile`` (runtime/profile.py's Profile of the same
    executable, optional) adds each step's time.  Returns the HTML text."""
    steps = list(plan.kernels)
    seconds: dict[int, float] = {}
    if profile is not None:       # per dispatch: kernels run as one job share its time
        for sp in profile.steps:
            for k in sp.steps:
                seconds[k] = sp.seconds
    lines = {k: _lines(k, s, seconds.get(k)) for k, s in enumerate(steps)}
    heights = {k: PAD * 2 + LINE_H * len(ls) for k, ls in lines.items()}
    svg_parts: list[str] = []
    width = height = 0
    xy: dict[int, tuple[float, float]] = {}
    if steps:
        pos, edges, layer = _layout(steps)
        rows: dict[int, list[int]] = {}
        for k in range(len(steps)):
            rows.setdefault(layer[k], []).append(k)
        y = PAD
        for r in sorted(rows):
            members = sorted(rows[r], key=lambda k: (pos[k][0], k))
            for i, k in enumerate(members):
                xy[k] = (PAD + i * (BOX_W + GAP_X), y)
            y += max(heights[k] for k in members) + GAP_Y
        width = int(max(x for x, _ in xy.values()) + BOX_W + PAD)
        height = int(y)
        for a, b in edges:
            ax, ay = xy[a][0] + BOX_W / 2, xy[a][1] + heights[a]
            bx, by = xy[b][0] + BOX_W / 2, xy[b][1]
            svg_parts.append(f'<line class="edge" x1="{ax:.0f}" y1="{ay:.0f}" x2="{bx:.0f}" y2="{by:.0f}" '
                             'marker-end="url(#arrow)"/>')
        for k, s in enumerate(steps):
            x, y0 = xy[k]
            mgs = list(getattr(s, "micro_graphs", ()))
            colour = _COLOURS[(mgs[0] if mgs and isinstance(mgs[0], int) else k) % len(_COLOURS)]
            text = "".join(f'<text x="{x + PAD:.0f}" y="{y0 + PAD + LINE_H * (i + 1) - 3:.0f}"'
                           f'{" class=t" if i == 0 else ""}>{_esc(t)}</text>' for i, t in enumerate(lines[k]))
            svg_parts.append(
                f'<a href="#step{k}"><g class="step {_kind(s)}" id="box{k}" data-step="{k}" '
                f'data-ops="{_esc(" ".join(_ops(s)))}"><title>micro-graph(s) {_esc(mgs)}</title>'
                f'<rect x="{x:.0f}" y="{y0:.0f}" width="{BOX_W}" height="{heights[k]}" rx="6" fill="{colour}"/>'
                f'{text}</g></a>')
    svg = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}"><defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" '
           'markerWidth="6" markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#64748b"/>'
           f'</marker></defs>{"".join(svg_parts)}</svg>')
    return _page(plan, steps, svg, lines, title)


def _page(plan, steps, svg: str, lines, title: str | None) -> str:
    name = title or f"apollo_py plan: {plan.graph.name}"
    mg_rows = "".join(
        f"<tr><td>{k}</td><td>{_esc(m.kind)}</td><td>{_esc(','.join(m.rules) or '-')}</td>"
        f"<td>{_esc(' '.join(m.ops))}</td><td><code>{_esc(m.signature)}</code></td></tr>"
        for k, m in enumerate(plan.micro_graphs))
    refusals = [f"<li>step #{k} ({_esc(' '.join(_ops(s)))}): runs through numpy: {_esc(s.reason)}</li>"
                for k, s in enumerate(steps) if _kind(s) == "numpy" and getattr(s, "reason", "")]
    refusals += [f"<li>{_esc(n)}</li>" for n in plan.notes]
    details = []
    for k, s in enumerate(steps):
        try:
            if hasattr(s, "source"):
                src = s.source()
            else:       # a CUDA launch (runtime/cuda.py) carries its kernel's CUDA C source
                src = getattr(getattr(s, "kernel", None), "source", "") or "(no generated source)"
        except Exception as e:    # noqa: BLE001 -- a step without renderable source still gets its box
            src = f"(no source: {e})"
        if len(src) > _MAX_SOURCE:
            src = src[:_MAX_SOURCE] + f"\n... ({len(src) - _MAX_SOURCE} more characters)"
        details.append(f'<details id="step{k}"><summary>{_esc(lines[k][0])}: {_esc(" ".join(_ops(s)))}'
                       f'</summary><pre>{_esc(src)}</pre></details>')
    timings = ", ".join(f"{_esc(n)} {t:.2f} s" for n, t in plan.timings)
    css = ("body{font-family:sans-serif;margin:1em}svg{border:1px solid #cbd5e1}text{font:11px monospace}"
           "text.t{font-weight:bold}.edge{stroke:#64748b;stroke-width:1.2}g.step rect{stroke:#334155}"
           "g.numpy rect{stroke-dasharray:4 3}table{border-collapse:collapse}td,th{border:1px solid #cbd5e1;"
           "padding:2px 6px;font-size:12px}pre{background:#f8fafc;overflow:auto;max-height:30em}")
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{_esc(name)}</title>'
            f'<style>{css}</style></head><body><h1>{_esc(name)}</h1>'
            f'<p>{len(plan.graph.nodes)} primitives, {len(plan.micro_graphs)} micro-graphs, {len(steps)} steps. '
            f'{_esc(plan.coverage)}' + (f'<br>compile time: {timings}' if timings else '') + '</p>'
            f'<h2>Steps</h2><div class="drawing">{svg}</div>'
            f'<h2>Micro-graphs</h2><table><tr><th>#</th><th>kind</th><th>rules</th><th>ops</th>'
            f'<th>signature</th></tr>{mg_rows}</table>'
            f'<h2>Refusals</h2><ul>{"".join(refusals) or "<li>none</li>"}</ul>'
            f'<h2>Generated source</h2>{"".join(details)}</body></html>')
