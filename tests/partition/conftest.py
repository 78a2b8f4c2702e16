"""Put this folder on ``sys.path`` so tests can import ``partition_graphs`` (the suite may run
with ``--import-mode=importlib``, which does not add test folders itself)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
