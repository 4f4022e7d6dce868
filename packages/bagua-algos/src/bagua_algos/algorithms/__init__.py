"""The algorithms, one module each.

Each module defines a user-facing :class:`~bagua_algos.Algorithm` subclass (registered under its
name for ``Algorithm.init``) and the :class:`~bagua_algos.AlgorithmImpl` that runs it. They build on the
engine's pieces one level up (``_engine/``: buckets, the reducer and handles in ``comm``,
per-parameter checkpointed state in ``state``, overflow handling, argument checks) and on
``_shared.py`` here (the compressed allreduce and its error-feedback state, ``trainable()``).
No algorithm module imports another (an import-linter contract). A new algorithm is a new
module here plus one line in this file.
"""

from .async_model_average import AsyncModelAverage
from .bytegrad import ByteGrad
from .decentralized import Decentralized
from .diloco import DiLoCo
from .gradient_allreduce import GradientAllReduce
from .local_sgd import LocalSGD
from .low_precision_decentralized import LowPrecisionDecentralized
from .low_rank import LowRank
from .q_adam import QAdam, QAdamOptimizer
from .topk import TopK

__all__ = [
    "AsyncModelAverage", "ByteGrad", "Decentralized", "DiLoCo", "GradientAllReduce",
    "LocalSGD", "LowPrecisionDecentralized", "LowRank", "QAdam", "QAdamOptimizer", "TopK",
]
