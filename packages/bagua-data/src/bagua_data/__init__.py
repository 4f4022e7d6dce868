"""bagua_data: load-balanced distributed samplers.

``LoadBalancingDistributedSampler`` follows ``torch.utils.data.DistributedSampler``'s contract
and orders samples so that every rank's i-th sample has near-equal complexity;
``LoadBalancingDistributedBatchSampler`` turns it into variable-size batches with the same
batch count on every rank; ``LengthGroupedDistributedBatchSampler`` makes batches of similar
lengths (little padding) whose cost is near-equal on every rank at every step.  All can save
and restore their position mid-epoch, also at another world size.
"""

from ._version import __version__
from .batch_sampler import LoadBalancingDistributedBatchSampler
from .length_grouped import LengthGroupedDistributedBatchSampler
from .sampler import LoadBalancingDistributedSampler

__all__ = ["LengthGroupedDistributedBatchSampler", "LoadBalancingDistributedBatchSampler",
           "LoadBalancingDistributedSampler", "__version__"]
