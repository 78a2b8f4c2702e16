"""The package's layers (docs/design/layers.md) are kept: import-linter's contracts hold, a new
back edge breaks them, and no import cycle runs through module-level imports."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")
pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (dev extra)")


def _lint(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` over the ``apollo_py`` found in ``tree`` (with the repo's contracts)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    return subprocess.run([str(LINT), "--config", str(tree / "pyproject.toml"), "--no-cache"],
                          cwd=tree, env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def package_copy(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("layering")
    shutil.copytree(ROOT / "apollo_py", tree / "apollo_py",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def _inject(tree: Path, module: str, line: str) -> Path:
    out = tree.parent / (tree.name + "_" + module.replace("/", "_"))
    shutil.copytree(tree, out)
    with open(out / "apollo_py" / module, "a", encoding="utf-8") as f:
        f.write("\n" + line + "\n")
    return out


def test_contracts_hold_on_a_clean_copy(package_copy):
    r = _lint(package_copy)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout


@pytest.mark.parametrize("module, line, contract", [
    # the back edge the issue started from: the IR reaching up to the front end
    ("ir/types.py", "from apollo_py.frontend import onnx_op  # noqa", "apollo_py's layers"),
    # onnx below the front end
    ("ops/registry.py", "import onnx  # noqa", "only the front end"),
])
def test_a_forbidden_import_breaks_a_contract(package_copy, module, line, contract):
    r = _lint(_inject(package_copy, module, line))
    assert r.returncode != 0, r.stdout
    broken = r.stdout[r.stdout.index("Broken contracts"):]
    assert contract in broken and module.replace("/", ".").removesuffix(".py") in broken, r.stdout


def test_no_cycle_through_module_level_imports():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import import_cycles
    finally:
        sys.path.remove(str(ROOT / "tools"))
    assert import_cycles.cycles(import_cycles.import_graph(top_level_only=True)) == []
    # with function-level imports counted, the one cycle left is the ONNX front end lowering
    # control-flow bodies with itself (docs/design/layers.md); nothing outside frontend joins it
    every = import_cycles.cycles(import_cycles.import_graph())
    assert all(m.startswith("apollo_py.frontend.") for c in every for m in c), every
    assert len(every) <= 1
