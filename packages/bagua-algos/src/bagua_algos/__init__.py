"""bagua_algos: with_bagua() and the Bagua algorithms.

    import bagua_comm as bc
    from bagua_algos import with_bagua, GradientAllReduce

    bc.init_process_group()
    model = with_bagua(model, [optimizer], GradientAllReduce())
    model = with_bagua(model, [optimizer], "auto")   # chosen from the measured network
"""

from ._recommend import recommend
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
from .module import BaguaModule, with_bagua

__all__ = [
    "Algorithm", "AlgorithmImpl", "AsyncModelAverage", "BaguaModule", "ByteGrad",
    "Decentralized", "DiLoCo", "GradientAllReduce", "LocalSGD", "LowPrecisionDecentralized",
    "LowRank", "QAdam", "QAdamOptimizer", "TopK", "__version__", "recommend", "with_bagua",
]
