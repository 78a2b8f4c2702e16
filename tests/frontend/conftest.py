"""Put ``examples/`` on ``sys.path`` so the tests can reuse ``make_models``, and this folder so
that they can import ``frontend_testlib``; the ``stats`` fixture of the cache tests."""
import os
import sys

import pytest

_HERE = os.path.dirname(os.path.abspath(__file__))
_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(_HERE)), "examples")
for _p in (_EXAMPLES, _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)


@pytest.fixture
def stats():
    """What the model cache and the packed store did during the test so far: a function that
    returns the counters' increments (``model_cache.STATS`` and ``packed_store.STATS``: the
    names do not overlap)."""
    from apollo_py.frontend import model_cache, packed_store
    counters = (model_cache.STATS, packed_store.STATS)
    before = [dict(c) for c in counters]
    yield lambda: {k: c[k] - b[k] for c, b in zip(counters, before) for k in b}
