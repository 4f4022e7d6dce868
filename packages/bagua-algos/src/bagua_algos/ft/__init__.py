"""Restart-free fault tolerance on torchft (extra ``bagua-algos[ft]``).

``import bagua_algos`` never imports this package, and this package imports torchft only
when a :class:`FaultTolerant` is made (or :func:`lighthouse` is called).
"""

from ._data import CommittedBatches
from ._lighthouse import lighthouse
from ._replica import FaultTolerant, Step, is_comm_error

__all__ = ["CommittedBatches", "FaultTolerant", "Step", "is_comm_error", "lighthouse"]
