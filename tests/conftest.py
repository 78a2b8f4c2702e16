"""Suite-wide fixtures.

The suite never reads or writes the user's cache (``~/.cache/apollo_py``: pieces, machine
figures, feedback log): a session fixture points the default cache directory at a temporary
one before any test runs.  Tests of the disk cache make their own directories (``tmp_path``).

Tests that assert a decision which depends on the machine pin the figures they assume
(``Options(machine=...)``).  Every other test must pass whatever figures the machine has; to
check that, ``pytest --apollo-machine slow`` (or ``fast``, any preset) stores that preset as
the session's measured figures, so every unpinned compile plans for it.
"""
import os
import shutil
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="apollo_py_test_cache_")
# set at import, before any test module builds an Options() (their defaults read it)
os.environ["APOLLO_PY_CACHE_DIR"] = _CACHE


def pytest_addoption(parser):
    parser.addoption("--apollo-machine", default=None, metavar="PRESET",
                     help="plan every unpinned compile for this machine preset (apollo_py.machine.PRESETS)")


def pytest_configure(config):
    name = config.getoption("--apollo-machine")
    if name:
        from apollo_py import machine as M
        notes = {"format": M.FORMAT, "hardware": M.hardware(), "pinned_by": f"pytest --apollo-machine {name}"}
        M.save_machine(_CACHE, M.preset(name).replace(notes=notes))


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir():
    """The temporary default cache directory of this test session (removed at the end)."""
    yield _CACHE
    shutil.rmtree(_CACHE, ignore_errors=True)
