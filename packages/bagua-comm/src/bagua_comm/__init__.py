"""bagua_comm: process groups, communication primitives, compression and buckets.

CPU tensors travel through torch.distributed's gloo backend; GPU tensors through our own
binding to libnccl, loaded at first use (nothing CUDA-related is imported here).
"""

from . import bucket, compression, traffic
from ._compressed import compressed_allreduce, compressed_allreduce_launcher
from ._nccl import NcclError
from ._nccl_loader import nccl_available, nccl_version
from ._version import __version__
from .bucket import Bucket
from .ops import ReduceOp
from .primitives import (
    P2POp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    allreduce_launcher,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    barrier,
    batch_isend_irecv,
    broadcast,
    broadcast_object,
    gather,
    gather_inplace,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from .process_group import (
    ProcessGroup,
    destroy_process_group,
    get_backend,
    get_default_group,
    get_local_rank,
    get_local_size,
    get_node_rank,
    get_rank,
    get_world_size,
    init_process_group,
    is_initialized,
    new_group,
)
from .work import Work

__all__ = [
    "Bucket", "NcclError", "P2POp", "ProcessGroup", "ReduceOp", "Work", "__version__",
    "allgather", "allgather_inplace", "allreduce", "allreduce_inplace", "allreduce_launcher", "alltoall",
    "alltoall_inplace", "alltoall_v", "barrier", "batch_isend_irecv", "broadcast", "broadcast_object", "bucket",
    "compressed_allreduce", "compressed_allreduce_launcher", "compression", "destroy_process_group", "gather", "gather_inplace",
    "get_backend", "get_default_group", "get_local_rank", "get_local_size", "get_node_rank",
    "get_rank", "get_world_size", "init_process_group", "is_initialized", "nccl_available",
    "nccl_version", "new_group", "recv", "reduce", "reduce_inplace", "reduce_scatter",
    "reduce_scatter_inplace", "scatter", "scatter_inplace", "send", "traffic",
]
