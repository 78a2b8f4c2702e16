"""Put ``examples/`` on ``sys.path`` so the tests can reuse ``make_models``."""
import os
import sys

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                         "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)
