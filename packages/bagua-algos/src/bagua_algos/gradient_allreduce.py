"""GradientAllReduce: full-precision allreduce of gradients, flat or hierarchical."""

from __future__ import annotations

import bagua_comm as bc

from ._comm import Runner, hierarchical, prepare_hierarchy
from .algorithm import Algorithm, AlgorithmImpl


def _check_bool(name, value):
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


class GradientAllReduce(Algorithm, name="gradient_allreduce"):
    """Average (or sum) gradients over all ranks: the result is bit-identical on every rank.

    ``hierarchical=True`` reduces inside each node first, allreduces among node leaders and
    broadcasts back inside the node: inter-node traffic shrinks by the ranks per node.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True):
        _check_bool("hierarchical", hierarchical)
        _check_bool("average", average)
        self.hierarchical = hierarchical
        self.average = average

    def reify(self, group):
        return GradientAllReduceImpl(group, self.hierarchical, self.average)


class GradientAllReduceImpl(AlgorithmImpl):
    def __init__(self, group, hierarchical, average):
        super().__init__(group)
        self.hierarchical = hierarchical
        self.op = bc.ReduceOp.AVG if average else bc.ReduceOp.SUM
        self.runner = Runner("bagua-allreduce")
        if hierarchical:
            prepare_hierarchy(group)

    def allreduce(self, tensor, async_op: bool):
        """Allreduce ``tensor`` in place (flat: gloo's async handle; hierarchical: the
        three-stage chain on the background runner)."""
        if not self.hierarchical:
            return bc.allreduce_inplace(tensor, self.op, group=self.group, async_op=async_op)
        average = self.op is bc.ReduceOp.AVG

        def chain():
            def among_leaders(t, inter):
                bc.allreduce_inplace(t, self.op, group=inter)

            hierarchical(self.group, tensor, among_leaders, average)

        if async_op:
            return self.runner.submit(chain)
        chain()
        return None

    def bucket_ready_hook(self, module, bucket):
        return self.allreduce(bucket.grad, async_op=True)

    def autotune_knobs(self):
        """Knobs the autotuner may switch between steps: ``hierarchical`` averages either
        way (same maths) and can pay where several ranks share a node."""
        g = self.group
        if g.num_nodes > 1 and g.size > g.num_nodes:
            prepare_hierarchy(g)      # collective: every rank builds its tuner together
            return {"hierarchical": ([False, True], False)}
        return {}

    def shutdown(self):
        self.runner.close()
