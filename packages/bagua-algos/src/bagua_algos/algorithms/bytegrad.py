"""ByteGrad: gradients allreduced through 8-bit compression (MinMaxUInt8 by default,
scatter-reduce-gather), hierarchical by default, with optional error feedback."""

from __future__ import annotations

from .._engine.checks import check_bool
from ..algorithm import Algorithm, AlgorithmImpl
from ._shared import CompressedAllReduce, check_compressor, reset_residuals_note


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

    dense_gradients = True

    def compresses(self):
        return True

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


class ByteGradState:
    """ByteGrad's state: the compressed allreduce (its compressor's residuals)."""

    def __init__(self, group, algo: ByteGrad):
        self.allreduce = CompressedAllReduce(group, algo.hierarchical, algo.compressor,
                                             average=algo.average,
                                             error_feedback=algo.error_feedback,
                                             name="bagua-bytegrad")


class ByteGradImpl(AlgorithmImpl):
    # its buckets go through compressed_allreduce (the group's aux channel, or the node
    # groups when hierarchical): the group's own channel is free for the unused check
    unused_check_beside = True

    synchronous = True

    def __init__(self, group, algo: ByteGrad):
        super().__init__(group)
        self.state = ByteGradState(group, algo)
        # (buckets, hierarchical, launchers, whether the last one carries the flags)
        self._launchers: tuple | None = None

    def bucket_alignment(self) -> int:
        return self.state.allreduce.alignment()

    def init_operations(self, ctx, buckets):
        self.state.allreduce.buckets = buckets

    def _carried_launchers(self, ctx):
        """This layout's launchers when the last one carries the flags (its compressed
        allreduce is compiled: flat MinMaxUInt8 on gloo CPU, float32), else None."""
        buckets = self.state.allreduce.buckets
        if not buckets:
            return None
        got = self.bucket_launchers(ctx, buckets)
        cached = self._launchers
        return got if cached is not None and cached[2] is got and cached[3] else None

    def carries_unused_flags(self, ctx):
        """Where the last bucket's compressed allreduce is compiled, the flags ride in its
        own exchange as an exact, uncompressed tail: no collective of their own."""
        return self._carried_launchers(ctx) is not None

    def bucket_ready_hook(self, ctx, bucket):
        carried = self._carried_launchers(ctx)
        if carried is not None:     # every start (a joined rank's too) carries the flags
            return carried[bucket.index][1]()
        return self.state.allreduce(bucket.grad, bucket)

    def bucket_launchers(self, ctx, buckets):
        """What :meth:`bucket_ready_hook` starts, as launchers made once per layout and mode
        (:meth:`CompressedAllReduce.launchers`: compiled for MinMaxUInt8 on gloo, the last
        one carrying the flags where it can)."""
        return self._launchers_of(ctx, buckets)[2]

    def _launchers_of(self, ctx, buckets):
        hier = self.state.allreduce.reducer.hierarchical
        cached = self._launchers
        if cached is not None and cached[0] is buckets and cached[1] == hier:
            return cached
        flags = buckets[-1].flags if buckets else None
        starts, carried = self.state.allreduce.launchers(buckets, [b.grad for b in buckets],
                                                         flags)
        out = [(self.grad_divisor(b), s) for b, s in zip(buckets, starts)]
        self._launchers = (buckets, hier, out, carried)
        return self._launchers

    def state_dict(self):
        return {"compressor": self.state.allreduce.state_dict()}

    def load_state_dict(self, state):
        self.state.allreduce.load_state_dict(state["compressor"])

    def before_rebucket(self, ctx):
        state = self.state_dict()
        self.state.allreduce.share(state["compressor"])
        return state

    def foreign_view(self, state):
        return reset_residuals_note(state)      # all that a foreign load reads

    def load_foreign_state_dict(self, state, *, world_size, rank):
        # Residuals are one rank's quantisation error (and their chunking follows the world
        # size): another rank's would add its error twice, so this rank's start at zero.
        return reset_residuals_note(state)

    def shutdown(self):
        self.state.allreduce.close()
