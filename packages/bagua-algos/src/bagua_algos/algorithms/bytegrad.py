"""ByteGrad: gradients allreduced through 8-bit compression (MinMaxUInt8 by default,
scatter-reduce-gather), hierarchical by default, with optional error feedback."""

from __future__ import annotations

import bagua_comm as bc

from .._checks import check_bool
from .._comm import Reducer
from .._compression import (
    CompressorState,
    alignment,
    check_chunks,
    check_compressor,
    make_compressor,
)
from ..algorithm import Algorithm, AlgorithmImpl


class ByteGrad(Algorithm, name="bytegrad"):
    """Compressed gradient allreduce: about a quarter of the bytes of full precision.

    ``hierarchical=True`` averages inside each node in full precision and compresses only the
    traffic among node leaders.  ``error_feedback=True`` carries each gradient's quantisation
    error into the next step (EF-SGD); the residuals are checkpointed with the optimizer.
    ``compressor`` is any ``bagua_comm.compression.Compressor`` (default: ``MinMaxUInt8``
    with one chunk per rank); ``error_feedback`` configures the default one, a compressor
    passed in brings its own.  Every rank decodes the same bytes, so ranks stay
    bit-identical.
    """

    def __init__(self, hierarchical: bool = True, average: bool = True,
                 error_feedback: bool = False, compressor=None):
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        check_bool("error_feedback", error_feedback)
        check_compressor(compressor)
        if error_feedback and compressor is not None:
            raise ValueError("error_feedback=True configures the default compressor; a "
                             "compressor passed in keeps its own error feedback (e.g. "
                             "MinMaxUInt8(chunks, error_feedback=True)): drop one of the two")
        self.hierarchical = hierarchical
        self.average = average
        self.error_feedback = error_feedback
        self.compressor = compressor

    def reify(self, group):
        return ByteGradImpl(group, self)


def layout(buckets) -> list[list[str]]:
    return [list(b.names) for b in buckets]


class CompressedAllReduce:
    """Flat or hierarchical compressed allreduce of buckets through one compressor, with its
    state keyed by parameter (shared by ByteGrad and QAdam)."""

    def __init__(self, group, hierarchical: bool, compressor, *, average: bool = True,
                 error_feedback: bool = False, name: str = "bagua-compressed"):
        peers = group.num_nodes if hierarchical else group.size
        check_chunks(compressor, peers, "compressor")      # before any communication
        self.reducer = Reducer(group, hierarchical, name)
        self.op = bc.ReduceOp.AVG if average else bc.ReduceOp.SUM
        self.compressor = make_compressor(compressor, self.reducer.peers.size, error_feedback)
        self.state = CompressorState(self.compressor, self.reducer.peers)
        self.buckets = []

    def alignment(self) -> int:
        return alignment(self.compressor, self.reducer.peers.size)

    def __call__(self, tensor, bucket):
        """Start the allreduce of ``tensor`` (laid out like ``bucket``) in place."""
        if tensor.numel() > bucket.numel:                   # padding: zero, not last decode
            tensor[bucket.numel:].zero_()
        return self.reducer.compressed_allreduce(tensor, self.compressor, bucket.name, self.op)

    def state_dict(self) -> dict:
        return {**self.state.export(self.buckets), "layout": layout(self.buckets)}

    def load_state_dict(self, state: dict) -> None:
        self.state.load(self.buckets, state, same_layout=state.get("layout") ==
                        layout(self.buckets))

    def share(self, state: dict) -> dict:
        """Collective part of re-bucketing (see CompressorState.share_gather)."""
        self.state.share_gather(self.buckets, state)
        return state

    def close(self):
        self.reducer.close()


class ByteGradState:
    """ByteGrad's state: the compressed allreduce (its compressor's residuals)."""

    def __init__(self, group, algo: ByteGrad):
        self.allreduce = CompressedAllReduce(group, algo.hierarchical, algo.compressor,
                                             average=algo.average,
                                             error_feedback=algo.error_feedback,
                                             name="bagua-bytegrad")


def reset_residuals_note(state) -> str | None:
    """What resetting the compressors saved in ``state`` loses (None: nothing)."""
    saved = state.get("compressor", {}) if isinstance(state, dict) else {}
    if isinstance(saved, dict) and (saved.get("scatter") or saved.get("gather")):
        return ("error-feedback residuals are per rank and restart at zero (for a bit-exact "
                "resume at the same world size, save optimizer.state_dict() on every rank "
                "and load each rank's own file)")
    return None


class ByteGradImpl(AlgorithmImpl):
    synchronous = True

    def __init__(self, group, algo: ByteGrad):
        super().__init__(group)
        self.state = ByteGradState(group, algo)

    def bucket_alignment(self) -> int:
        return self.state.allreduce.alignment()

    def init_operations(self, ctx, buckets):
        self.state.allreduce.buckets = buckets

    def bucket_ready_hook(self, ctx, bucket):
        return self.state.allreduce(bucket.grad, bucket)

    def state_dict(self):
        return {"compressor": self.state.allreduce.state_dict()}

    def load_state_dict(self, state):
        self.state.allreduce.load_state_dict(state["compressor"])

    def before_rebucket(self, ctx):
        state = self.state_dict()
        self.state.allreduce.share(state["compressor"])
        return state

    def load_foreign_state_dict(self, state, *, world_size, rank):
        # Residuals are one rank's quantisation error (and their chunking follows the world
        # size): another rank's would add its error twice, so this rank's start at zero.
        return reset_residuals_note(state)

    def shutdown(self):
        self.state.allreduce.close()
