"""GradientAllReduce: full-precision allreduce of gradients, flat or hierarchical."""

from __future__ import annotations

import functools

import bagua_comm as bc

from .._engine.checks import check_bool
from .._engine.comm import Reducer, prepare_hierarchy
from ..algorithm import Algorithm, AlgorithmImpl


class GradientAllReduce(Algorithm, name="gradient_allreduce"):
    """Average (or sum) gradients over all ranks: the result is bit-identical on every rank.

    ``hierarchical=True`` reduces inside each node first, allreduces among node leaders and
    broadcasts back inside the node: inter-node traffic shrinks by the ranks per node.

    Sparse gradients (``torch.nn.Embedding(sparse=True)``, ``EmbeddingBag(sparse=True)``) are
    averaged as DDP averages them, by a sparse exchange of their own at the end of backward
    (row counts, then indices and values, by allgather), never densified.
    """

    sparse_allreduce = True
    joinable = True

    def __init__(self, hierarchical: bool = False, average: bool = True):
        check_bool("hierarchical", hierarchical)
        check_bool("average", average)
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, group):
        return GradientAllReduceImpl(group, self.hierarchical, self.average)


class GradientAllReduceImpl(AlgorithmImpl):
    synchronous = True
    ddp_first_layout = True      # DDP's buckets at every step: bit for bit with DDP

    def __init__(self, group, hierarchical, average):
        super().__init__(group)
        self.op = bc.ReduceOp.AVG if average else bc.ReduceOp.SUM
        self.reducer = Reducer(group, hierarchical, "bagua-allreduce")
        self._launchers: tuple | None = None     # (buckets, hierarchical, launchers)

    @property
    def hierarchical(self) -> bool:
        return self.reducer.hierarchical

    @hierarchical.setter
    def hierarchical(self, value: bool) -> None:   # the autotuner switches it between steps
        self.reducer.hierarchical = value

    def grad_divisor(self, bucket):
        """Flat averaging on CPU (gloo) multiplies each gradient by 1/world size as it is
        copied into the bucket, then allreduces a sum, exactly as DDP's reducer does (so the
        result is DDP's bit for bit at any world size, with DDP's bucket layout): one pass
        over the gradients, none left at the end of backward; bit-identical on every rank.
        NCCL averages natively, so GPU buckets are left to it; the hierarchical mode
        averages inside its own chain."""
        if (self.op is bc.ReduceOp.AVG and not self.reducer.hierarchical
                and bucket.device.type == "cpu" and self.group.size > 1):
            return self.group.size
        return None

    def carries_unused_flags(self, ctx):
        """Flat or hierarchical, a sum or a mean: a flag some rank set stays > 0, one no
        rank set stays 0, so the flags can ride in the last bucket's allreduce.  They do at
        2 ranks and hierarchically.  Flat over 3 or more ranks they take an allreduce of
        their own, as DDP's used-parameter map (find_unused_parameters=True): gloo's ring
        sums an element in an order that depends on the buffer's length, so a bucket longer
        than DDP's would sum some gradients in another order than DDP (at 2 ranks the order
        of a sum of two is moot)."""
        return self.reducer.hierarchical or self.group.size <= 2

    def bucket_ready_hook(self, ctx, bucket):
        buf = bucket.grad_and_flags if self.carries_unused_flags(ctx) else bucket.grad
        if self.grad_divisor(bucket) is not None:      # divided while gathering
            return self.reducer.allreduce(buf, bc.ReduceOp.SUM)
        return self.reducer.allreduce(buf, self.op)

    def bucket_launchers(self, ctx, buckets):
        """The same list at every step of a layout and mode: flat, each bucket's allreduce is
        a :func:`bagua_comm.allreduce_launcher` (on gloo, torch's own collective, no Python);
        hierarchical, the reducer's chain.  What :meth:`bucket_ready_hook` does."""
        hier = self.reducer.hierarchical
        cached = self._launchers
        if cached is not None and cached[0] is buckets and cached[1] == hier:
            return cached[2]
        carried = self.carries_unused_flags(ctx)
        out = []
        for b in buckets:
            buf = b.grad_and_flags if carried else b.grad
            divisor = self.grad_divisor(b)
            op = bc.ReduceOp.SUM if divisor is not None else self.op
            if hier:
                start = functools.partial(self.reducer.allreduce, buf, op)
            else:
                start = bc.allreduce_launcher(buf, op, group=self.group)
            out.append((divisor, start))
        self._launchers = (buckets, hier, out)
        return out

    def autotune_knobs(self):
        """Knobs the autotuner may switch between steps: ``hierarchical`` averages either
        way (same maths) and can pay where several ranks share a node."""
        g = self.group
        if g.num_nodes > 1 and g.size > g.num_nodes:
            prepare_hierarchy(g)      # collective: every rank builds its tuner together
            return {"hierarchical": ([False, True], False)}
        return {}

    def shutdown(self):
        self.reducer.close()
