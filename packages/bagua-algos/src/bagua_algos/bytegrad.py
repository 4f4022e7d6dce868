"""ByteGrad: gradients allreduced through 8-bit MinMaxUInt8 compression
(scatter-reduce-gather), hierarchical by default, with optional error feedback."""

from __future__ import annotations

import bagua_comm as bc

from ._comm import Runner, hierarchical, prepare_hierarchy
from .algorithm import Algorithm, AlgorithmImpl
from .decentralized import check_bool


class ByteGrad(Algorithm, name="bytegrad"):
    """Compressed gradient allreduce: about a quarter of the bytes of full precision.

    ``hierarchical=True`` averages inside each node in full precision and compresses only the
    traffic among node leaders.  ``error_feedback=True`` carries each bucket's quantisation
    error into the next step (EF-SGD); the residuals are checkpointed with the optimizer.
    Every rank decodes the same bytes, so ranks stay bit-identical.
    """

    def __init__(self, hierarchical: bool = True, average: bool = True,
                 error_feedback: bool = False):
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        check_bool("error_feedback", error_feedback)
        self.hierarchical = hierarchical
        self.average = average
        self.error_feedback = error_feedback

    def reify(self, group):
        return ByteGradImpl(group, self.hierarchical, self.average, self.error_feedback)


class CompressedAllReduce:
    """One compressor per bucket, flat or hierarchical compressed allreduce (shared by
    ByteGrad and QAdam)."""

    def __init__(self, group, hierarchical: bool, average: bool, error_feedback: bool = False):
        self.group = group
        self.hierarchical = hierarchical
        self.op = bc.ReduceOp.AVG if average else bc.ReduceOp.SUM
        self.error_feedback = error_feedback
        self.runner = Runner("bagua-compressed")
        if hierarchical:
            prepare_hierarchy(group)
        self.peers = group.inter_node_group() if hierarchical else group
        self.compressors: dict[str, object] = {}

    def compressor(self, key: str):
        if key not in self.compressors:
            from bagua_comm.compression import MinMaxUInt8

            self.compressors[key] = MinMaxUInt8(self.peers.size,
                                                error_feedback=self.error_feedback)
        return self.compressors[key]

    def __call__(self, tensor, key: str):
        """Start the allreduce of ``tensor`` in place; returns a handle with ``wait()``."""
        comp = self.compressor(key)
        if not self.hierarchical:
            return bc.compressed_allreduce(tensor, tensor, self.op, comp, key=key,
                                           group=self.group, async_op=True)

        def among_leaders(t, inter):
            bc.compressed_allreduce(t, t, self.op, comp, key=key, group=inter)

        return self.runner.submit(
            lambda: hierarchical(self.group, tensor, among_leaders, self.op is bc.ReduceOp.AVG))

    def state_dict(self):
        return {k: c.state_dict() for k, c in self.compressors.items()}

    def load_state_dict(self, state):
        for key, s in state.items():
            self.compressor(key).load_state_dict(s)

    def close(self):
        self.runner.close()


def reset_residuals_note(state) -> str | None:
    """What resetting the compressors saved in ``state`` loses (None: nothing)."""
    saved = state.get("compressors", {}) if isinstance(state, dict) else {}
    if any(s.get("residuals") for s in saved.values() if isinstance(s, dict)):
        return ("error-feedback residuals are per rank and restart at zero (for a bit-exact "
                "resume at the same world size, save optimizer.state_dict() on every rank "
                "and load each rank's own file)")
    return None


class ByteGradImpl(AlgorithmImpl):
    def __init__(self, group, hierarchical, average, error_feedback):
        super().__init__(group)
        self.allreduce = CompressedAllReduce(group, hierarchical, average, error_feedback)

    def bucket_ready_hook(self, module, bucket):
        return self.allreduce(bucket.grad, bucket.name)

    def state_dict(self):
        return {"compressors": self.allreduce.state_dict()}

    def load_state_dict(self, state):
        self.allreduce.load_state_dict(state["compressors"])

    def load_foreign_state_dict(self, state, *, world_size, rank):
        # Residuals are one rank's quantisation error (and their chunking follows the world
        # size): another rank's would add its error twice, so this rank's start at zero.
        return reset_residuals_note(state)

    def shutdown(self):
        self.allreduce.close()
