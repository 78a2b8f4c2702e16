"""plan.to_html() / `apollo-py explain --html` (apollo_py/plan_html.py): every step is drawn,
the page is self-contained, and it (and `feedback report --html`) opens in a headless browser
without console errors when chromium and playwright are installed."""
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import apollo_py as ap


def _graph():
    b = ap.GraphBuilder("page")
    x = b.input("x", (64, 48))
    w = b.input("w", (48, 32))
    h = b.matmul(x, w)
    m = b.reduce_max(h, axes=(1,), keepdims=True)
    e = b.exp(h - m)
    y = e / b.reduce_sum(e, axes=(1,), keepdims=True)
    return b.build([b.tanh(y) * 2.0, b.reduce_sum(x, axes=(0,), keepdims=False)])


class _Boxes(HTMLParser):
    def __init__(self):
        super().__init__()
        self.boxes, self.details, self.external = {}, set(), []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "g" and "step" in (a.get("class") or "").split():
            self.boxes[int(a["data-step"])] = a["data-ops"]
        if tag == "details":
            self.details.add(a.get("id"))
        if tag in ("script", "link", "img", "iframe") or (a.get("src") or "").startswith("http"):
            self.external.append(tag)
        if tag == "a" and not (a.get("href") or "").startswith("#"):
            self.external.append(a.get("href"))


def _plan():
    return ap.jit(_graph(), options=ap.Options(machine="dev-2core")).plan


def test_every_step_is_drawn_with_its_ops_and_source():
    plan = _plan()
    page = plan.to_html()
    p = _Boxes()
    p.feed(page)
    assert len(plan.kernels) >= 3
    assert sorted(p.boxes) == list(range(len(plan.kernels)))
    for k, step in enumerate(plan.kernels):
        nodes = step.fused.nodes if step.fused is not None else step.nodes
        assert p.boxes[k] == " ".join(n.op for n in nodes)
    assert p.details == {f"step{k}" for k in range(len(plan.kernels))}
    assert p.external == []                        # no scripts, no network
    fused = [s.fused for s in plan.kernels if s.fused is not None]
    assert fused and all(f.name in page for f in fused)


def test_cuda_launches_are_drawn_with_their_cuda_source():
    from apollo_py.codegen.cuda_emu import find_cxx
    if find_cxx() is None:
        pytest.skip("the CUDA emulation build needs g++")
    plan = ap.jit(_graph(), options=ap.Options(target="cuda-emu")).plan
    p = _Boxes()
    page = plan.to_html()
    p.feed(page)
    assert sorted(p.boxes) == list(range(len(plan.kernels))) and "__global__" in page


def test_cli_explain_html_writes_the_page(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import make_models as mm
    import onnx
    proto = mm.make_attention()
    onnx.save(proto, str(tmp_path / "attn.onnx"))
    shapes = []                  # symbolic dims pinned to 8 with --shape
    for i in proto.graph.input:
        dims = i.type.tensor_type.shape.dim
        if any(d.dim_param for d in dims):
            shapes += ["--shape", f"{i.name}=" + ",".join(str(d.dim_value or 8) for d in dims)]
    out = tmp_path / "plan.html"
    r = subprocess.run([sys.executable, "-m", "apollo_py.cli", "--cache-dir", str(tmp_path), "explain",
                        str(tmp_path / "attn.onnx"), "--html", str(out), *shapes], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    p = _Boxes()
    p.feed(out.read_text())
    assert len(p.boxes) >= 2 and f"({len(p.boxes)} steps)" in r.stdout


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def test_page_opens_in_a_headless_browser_without_console_errors(tmp_path):
    browser = _browser()
    if browser is None:
        pytest.skip("no chromium installed")
    playwright = pytest.importorskip("playwright.sync_api")
    page_file = tmp_path / "plan.html"
    plan = _plan()
    page_file.write_text(plan.to_html())
    opts = ap.Options(cache_dir=str(tmp_path))
    from apollo_py.feedback import log_event, report
    log_event(opts, "schedule_budget_exceeded", "exp:ew($0) <&> tanh:ew(0)", time_ms=1.0)
    report_file = tmp_path / "report.html"
    report_file.write_text(report.render(opts, html=True))
    errors = []
    with playwright.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=browser, headless=True)
        try:
            page = b.new_page()
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(page_file.as_uri())
            drawn = page.locator("svg g.step").count()
            box = page.locator("svg").bounding_box()
            page.goto(report_file.as_uri())
            rows = page.locator("table tr").count()
            cell = page.locator("table tr >> nth=1 >> code").inner_text()
        finally:
            b.close()
    assert errors == []
    assert drawn == len(plan.kernels) and box["width"] > 0 and box["height"] > 0
    assert rows == 2 and cell == "exp:ew($0) <&> tanh:ew(0)"      # escaped, shown as written
