"""bagua_algos: with_bagua() and the Bagua algorithms (DESIGN.md section 5).

    import bagua_comm as bc
    from bagua_algos import with_bagua, GradientAllReduce

    bc.init_process_group()
    model = with_bagua(model, [optimizer], GradientAllReduce())
"""

from ._version import __version__
from .algorithm import Algorithm, AlgorithmImpl
from .gradient_allreduce import GradientAllReduce
from .module import BaguaModule, with_bagua

__all__ = [
    "Algorithm", "AlgorithmImpl", "BaguaModule", "GradientAllReduce", "__version__", "with_bagua",
]
