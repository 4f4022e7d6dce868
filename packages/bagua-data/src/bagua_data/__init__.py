"""bagua_data: load-balanced distributed samplers.

``LoadBalancingDistributedSampler`` follows ``torch.utils.data.DistributedSampler``'s contract
and orders samples so that every rank's i-th sample has near-equal complexity;
``LoadBalancingDistributedBatchSampler`` turns it into variable-size batches with the same
batch count on every rank.  Both can save and restore their position mid-epoch.
"""

from ._version import __version__
from .batch_sampler import LoadBalancingDistributedBatchSampler
from .sampler import LoadBalancingDistributedSampler

__all__ = ["LoadBalancingDistributedBatchSampler", "LoadBalancingDistributedSampler",
           "__version__"]
