"""Ray import and start-up shared by the predictor and DataParallel (Ray is an optional extra)."""
from __future__ import annotations

import os

from ..errors import ApolloError


class DistributedError(ApolloError):
    """A distributed run failed (Ray missing, workers that cannot be (re)started, ...)."""


class BatchFailedError(DistributedError):
    """A batch failed twice (its first failure is retried once); ``index`` says which."""

    def __init__(self, index, message: str):
        super().__init__(message)
        self.index = index


def ray():
    """The ``ray`` module, or a DistributedError that says how to install it."""
    try:
        import ray as _ray
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise DistributedError("apollo_py.distributed needs Ray: pip install 'apollo-py[distributed]'"
                               f" ({e})") from None
    return _ray


def ensure_ray():
    """The ``ray`` module, connected: an existing ``ray.init`` is kept; else Ray starts (or joins
    the cluster named by ``RAY_ADDRESS``) with its defaults."""
    r = ray()
    if not r.is_initialized():
        r.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
               log_to_driver=False, configure_logging=False)
    return r
