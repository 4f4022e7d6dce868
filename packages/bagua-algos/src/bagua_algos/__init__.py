"""bagua_algos: with_bagua() and the Bagua algorithms.

    import bagua_comm as bc
    from bagua_algos import with_bagua, GradientAllReduce

    bc.init_process_group()
    model = with_bagua(model, [optimizer], GradientAllReduce())
    model = with_bagua(model, [optimizer], "auto")   # chosen from the measured network

torch DDP users keep DDP and add our compressed allreduce as its communication hook::

    ddp_model.register_comm_hook(CompressionHookState(), compressed_allreduce_hook)
"""

from ._version import __version__
from .algorithm import Algorithm, AlgorithmImpl
from .algorithms import (
    AsyncModelAverage,
    ByteGrad,
    Decentralized,
    DiLoCo,
    GradientAllReduce,
    LocalSGD,
    LowPrecisionDecentralized,
    LowRank,
    QAdam,
    QAdamOptimizer,
    TopK,
)
from .ddp_hooks import CompressionHookState, compressed_allreduce_hook
from .module import BaguaModule, with_bagua
from .tuning.recommend import recommend

__all__ = [
    "Algorithm", "AlgorithmImpl", "AsyncModelAverage", "BaguaModule", "ByteGrad",
    "CompressionHookState", "Decentralized", "DiLoCo", "GradientAllReduce", "LocalSGD",
    "LowPrecisionDecentralized", "LowRank", "QAdam", "QAdamOptimizer", "TopK", "__version__",
    "compressed_allreduce_hook", "recommend", "with_bagua",
]
