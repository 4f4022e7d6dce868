"""bagua_algos: with_bagua() and the Bagua algorithms.

    import bagua_comm as bc
    from bagua_algos import with_bagua, GradientAllReduce

    bc.init_process_group()
    model = with_bagua(model, [optimizer], GradientAllReduce())
"""

from ._version import __version__
from .algorithm import Algorithm, AlgorithmImpl
from .async_model_average import AsyncModelAverage
from .bytegrad import ByteGrad
from .decentralized import Decentralized
from .gradient_allreduce import GradientAllReduce
from .low_precision_decentralized import LowPrecisionDecentralized
from .module import BaguaModule, with_bagua
from .q_adam import QAdam, QAdamOptimizer

__all__ = [
    "Algorithm", "AlgorithmImpl", "AsyncModelAverage", "BaguaModule", "ByteGrad",
    "Decentralized", "GradientAllReduce", "LowPrecisionDecentralized", "QAdam",
    "QAdamOptimizer", "__version__", "with_bagua",
]
