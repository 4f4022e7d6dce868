"""Decentralized SGD (D-PSGD): every rank averages its weights with its peers', overlapped
with forward and backward, then applies its own gradient."""

from __future__ import annotations

import torch

import bagua_comm as bc

from ._comm import Runner, hierarchical, prepare_hierarchy
from .algorithm import Algorithm, AlgorithmImpl

PEER_SELECTION_MODES = ("all", "shift_one")


def check_interval(value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"communication_interval must be an int >= 1, got {value!r}")


def check_bool(name, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def shift_one_peer(rank: int, size: int, round_: int) -> int:
    """Bagua's ``shift_one`` pairing: ranks of the lower half are paired with ranks of the
    upper half, and the pairing rotates by one every communication round."""
    half = size // 2
    if rank < half:
        return (rank + round_) % half + half
    return (rank - half - round_) % half


def exchange_shift_one(buf: torch.Tensor, group: bc.ProcessGroup, round_: int) -> None:
    """Average ``buf`` with this round's peer in ``group`` (in place)."""
    peer = shift_one_peer(group.rank, group.size, round_)
    theirs = torch.empty_like(buf)
    works = [bc.send(buf, peer, group=group, async_op=True),
             bc.recv(theirs, peer, group=group, async_op=True)]
    for w in works:
        w.wait()
    buf.add_(theirs).div_(2)


class Decentralized(Algorithm, name="decentralized"):
    """Each rank averages its weights with peers (``"all"``: everyone; ``"shift_one"``: one
    peer per round, the pairing rotating), every ``communication_interval`` steps.

    The exchange of the weights a forward starts from runs during forward and backward; at the
    end of backward the weights become the average and the optimizer applies the local
    gradient: ``x <- mean_peers(x) - lr * grad(x)``.  ``hierarchical=True`` averages inside
    each node first and exchanges among node leaders only.
    """

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all",
                 communication_interval: int = 1):
        check_bool("hierarchical", hierarchical)
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(f"peer_selection_mode must be one of {PEER_SELECTION_MODES}, "
                             f"got {peer_selection_mode!r}")
        check_interval(communication_interval)
        self.hierarchical = hierarchical
        self.peer_selection_mode = peer_selection_mode
        self.communication_interval = communication_interval

    def reify(self, group):
        return DecentralizedImpl(group, self)


class DecentralizedImpl(AlgorithmImpl):
    flatten_weights = True
    uses_grad_buckets = False

    def __init__(self, group, algo: Decentralized):
        super().__init__(group)
        self.hierarchical = algo.hierarchical
        self.mode = algo.peer_selection_mode
        self.interval = algo.communication_interval
        self.rounds = 0
        self.runner = Runner("bagua-decentralized")
        self._work = None
        if self.hierarchical:
            prepare_hierarchy(group)
        exchanging = group.inter_node_group() if self.hierarchical else group
        if self.mode == "shift_one" and exchanging.size > 1 and exchanging.size % 2:
            raise ValueError(f"peer_selection_mode='shift_one' needs an even number of "
                             f"{'nodes' if self.hierarchical else 'ranks'}, got "
                             f"{exchanging.size}; use 'all'")

    def init_operations(self, module, buckets):
        self.buckets = buckets
        self.peer_weights = [torch.empty_like(b.weight) for b in buckets]

    def should_communicate(self, module) -> bool:
        return (module.step - 1) % self.interval == 0

    def _exchange(self, buf: torch.Tensor, round_: int) -> None:
        def among(t, g):
            if self.mode == "all":
                bc.allreduce_inplace(t, bc.ReduceOp.AVG, group=g)
            else:
                exchange_shift_one(t, g, round_)

        if self.hierarchical:
            hierarchical(self.group, buf, among, average=True)
        elif self.group.size > 1:
            among(buf, self.group)

    def forward_pre_hook(self, module):
        if self._work is not None or not self.should_communicate(module):
            return
        for b, peer in zip(self.buckets, self.peer_weights):
            peer.copy_(b.gather_weights())
        round_ = self.rounds

        def run():
            for peer in self.peer_weights:
                self._exchange(peer, round_)

        self._work = self.runner.submit(run)

    def post_backward_hook(self, module):
        if self._work is None:
            return
        work, self._work = self._work, None
        work.wait()
        with torch.no_grad():
            for b, peer in zip(self.buckets, self.peer_weights):
                b.weight.copy_(peer)
                b.scatter_weights()
        self.rounds += 1

    def state_dict(self):
        return {"rounds": self.rounds}

    def load_state_dict(self, state):
        self.rounds = int(state["rounds"])

    def load_foreign_state_dict(self, state, *, world_size, rank):
        # The round counter is the same on every rank; peers follow from (rank, size, round).
        self.load_state_dict(state)
        if world_size == self.group.size:
            return None
        what = "shift_one pairing" if self.mode == "shift_one" else "peer set"
        return (f"the {what} is re-derived for {self.group.size} ranks from round "
                f"{self.rounds}; every rank starts from the loaded weights")

    def shutdown(self):
        if self._work is not None:
            self._work.wait()
            self._work = None
        self.runner.close()
