"""Scale-out on Ray: batch inference on Ray Data and synchronous data-parallel training.

* :func:`predictor` / :func:`predict`: a callable class for ``ray.data.Dataset.map_batches``
  that compiles the model once per actor (shared cache directory, or compiled pieces shipped
  through the object store);
* :class:`DataParallel`: a ``train_step`` or a loss function on ``num_workers`` Ray actors,
  gradients summed by ``ray.util.collective`` (gloo), the same update on every worker,
  checkpoints through ``state_dict``, worker restarts and batch retries.

Needs the ``distributed`` extra (``ray[data]`` and torch for the gloo collective); nothing here
imports Ray until it is used, and ``import apollo_py`` does not import this package.
"""
from ._ray import BatchFailedError, DistributedError
from .data_parallel import DataParallel, load_state_dict, save_state_dict
from .inference import predict, predictor

__all__ = ["BatchFailedError", "DataParallel", "DistributedError", "load_state_dict", "predict",
           "predictor", "save_state_dict"]
