"""Low-precision decentralized SGD: ring neighbours exchange 8-bit compressed differences of
their weights after each optimizer step (Bagua's algorithm, after arXiv 1803.06443)."""

from __future__ import annotations

import torch

import bagua_comm as bc

from ._comm import prepare_hierarchy
from .algorithm import Algorithm, AlgorithmImpl
from .decentralized import check_bool, check_interval


class LowPrecisionDecentralized(Algorithm, name="low_precision_decentralized"):
    """Ring topology with weights 1/3 (self, left, right); only compressed differences travel.

    Each rank keeps replicas ``l``, ``r`` of its neighbours' weights and ``x`` of its own last
    communicated weights.  After ``optimizer.step()`` turned ``x`` into ``w``:
    ``z = w + l/3 + r/3 - 5/3 x`` (the step from ``x`` to ``(x + l + r)/3`` plus the local
    update), ``x <- x + Q(z)`` becomes the new weights, ``Q(z)`` (MinMaxUInt8) goes to both
    neighbours and each replica moves by the difference its owner sent.  On two ranks both
    neighbours are the same peer, which then gets one message.  ``hierarchical=True`` averages
    inside each node first (full precision) and runs the ring among node leaders.
    """

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        check_bool("hierarchical", hierarchical)
        check_interval(communication_interval)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval

    def reify(self, group):
        return LowPrecisionDecentralizedImpl(group, self)


class LowPrecisionDecentralizedImpl(AlgorithmImpl):
    flatten_weights = True
    uses_grad_buckets = False

    def __init__(self, group, algo: LowPrecisionDecentralized):
        super().__init__(group)
        self.hierarchical = algo.hierarchical
        self.interval = algo.communication_interval
        self.rounds = 0
        if self.hierarchical:
            prepare_hierarchy(group)
        self.ring = group.inter_node_group() if self.hierarchical else group
        self._resync = False          # replicas to re-derive from the neighbours (resume)
        self._mine_from_weights = False

    def init_operations(self, module, buckets):
        from bagua_comm.compression import MinMaxUInt8

        self.buckets = buckets
        self.compressor = MinMaxUInt8(1)
        self.mine = [b.weight.clone() for b in buckets]     # x: my last communicated weights
        self.left = [b.weight.clone() for b in buckets]     # replicas (everyone starts equal)
        self.right = [b.weight.clone() for b in buckets]

    def forward_pre_hook(self, module):
        if self._mine_from_weights:    # a checkpoint whose buckets did not fit
            self._mine_from_weights = False
            with torch.no_grad():
                for x, b in zip(self.mine, self.buckets):
                    x.copy_(b.gather_weights())

    def _resync_replicas(self, i: int) -> None:
        """Set the replicas of both neighbours to their ``x`` (full precision, once after a
        resume).  Exact: a replica always equals its owner's ``x`` bit for bit, since both
        add the same decoded differences."""
        g = self.ring
        left_rank, right_rank = (g.rank - 1) % g.size, (g.rank + 1) % g.size
        works = [bc.send(self.mine[i], p, group=g, async_op=True)
                 for p in {left_rank, right_rank}]
        works.append(bc.recv(self.left[i], left_rank, group=g, async_op=True))
        if right_rank != left_rank:
            works.append(bc.recv(self.right[i], right_rank, group=g, async_op=True))
        for work in works:
            work.wait()
        if right_rank == left_rank:
            self.right[i].copy_(self.left[i])

    def _ring_step(self, i: int, w: torch.Tensor) -> None:
        g = self.ring
        left_rank, right_rank = (g.rank - 1) % g.size, (g.rank + 1) % g.size
        x, left, right = self.mine[i], self.left[i], self.right[i]
        diff = w + left / 3 + right / 3 - x * (5 / 3)
        payload = self.compressor.compress(diff)
        q = torch.empty_like(diff)
        self.compressor.decompress(payload, q)
        x.add_(q)
        w.copy_(x)
        from_left = torch.empty_like(payload)
        from_right = torch.empty_like(payload) if left_rank != right_rank else from_left
        peers = {left_rank: from_left, right_rank: from_right}
        works = []
        for peer, buf in peers.items():
            works.append(bc.send(payload, peer, group=g, async_op=True))
            works.append(bc.recv(buf, peer, group=g, async_op=True))
        for work in works:
            work.wait()
        for replica, buf in ((left, from_left), (right, from_right)):
            self.compressor.decompress(buf, q)
            replica.add_(q)

    def post_optimizer_step_hook(self, module, optimizer):
        if (module.step - 1) % self.interval:
            return
        intra = self.group.intra_node_group() if self.hierarchical else None
        with torch.no_grad():
            for i, b in enumerate(self.buckets):
                w = b.gather_weights()
                if intra is not None and intra.size > 1:
                    bc.reduce_inplace(w, 0, bc.ReduceOp.AVG, group=intra)
                if self.ring.is_member() and self.ring.size > 1:
                    if self._resync:
                        self._resync_replicas(i)
                    self._ring_step(i, w)
                if intra is not None and intra.size > 1:
                    bc.broadcast(w, 0, group=intra)
                b.scatter_weights()
        self._resync = False
        self.rounds += 1

    def state_dict(self):
        return {"rounds": self.rounds, "mine": [t.clone() for t in self.mine],
                "left": [t.clone() for t in self.left], "right": [t.clone() for t in self.right]}

    def load_state_dict(self, state):
        for name in ("mine", "left", "right"):
            saved, ours = state[name], getattr(self, name)
            if len(saved) != len(ours) or any(a.shape != b.shape for a, b in zip(saved, ours)):
                raise ValueError(f"checkpoint's {name!r} replicas do not match this model's "
                                 "buckets (same model and bucket_size are needed)")
            for a, b in zip(ours, saved):
                a.copy_(b)
        self.rounds = int(state["rounds"])
        # Every rank re-derives its replicas at the next round, whichever file it loaded
        # (rank 0 cannot know whether its peers loaded their own files or its own).
        self._resync = True

    def load_foreign_state_dict(self, state, *, world_size, rank):
        self.rounds = int(state.get("rounds", 0))
        saved = state.get("mine", [])
        if len(saved) == len(self.mine) and all(a.shape == b.shape
                                                for a, b in zip(saved, self.mine)):
            for a, b in zip(self.mine, saved):
                a.copy_(b)
        else:
            self._mine_from_weights = True
        self._resync = True
        return ("each rank's replicas of its ring neighbours are re-derived from the "
                "neighbours' weights (one full-precision exchange at the next round)")
