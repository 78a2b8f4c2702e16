"""Suite-wide fixtures.

The suite never reads or writes the user's cache (``~/.cache/apollo_py``: pieces, machine
figures, feedback log): a session fixture points the default cache directory at a temporary
one before any test runs.  Tests of the disk cache make their own directories (``tmp_path``).
"""
import os
import shutil
import tempfile

import pytest

_CACHE = tempfile.mkdtemp(prefix="apollo_py_test_cache_")
# set at import, before any test module builds an Options() (their defaults read it)
os.environ["APOLLO_PY_CACHE_DIR"] = _CACHE


@pytest.fixture(scope="session", autouse=True)
def isolated_cache_dir():
    """The temporary default cache directory of this test session (removed at the end)."""
    yield _CACHE
    shutil.rmtree(_CACHE, ignore_errors=True)
