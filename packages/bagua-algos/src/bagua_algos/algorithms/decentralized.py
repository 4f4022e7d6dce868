"""Decentralized SGD (D-PSGD): every rank averages its weights with its peers', overlapped
with forward and backward, then applies its own gradient."""

from __future__ import annotations

import torch

import bagua_comm as bc
from bagua_comm._peer_average import peer_average_launcher

from .._engine import _hot
from .._engine.checks import check_bool, check_interval
from .._engine.comm import Reducer
from ..algorithm import Algorithm, AlgorithmImpl

PEER_SELECTION_MODES = ("all", "shift_one")


def shift_one_peer(rank: int, size: int, round_: int) -> int:
    """Bagua's ``shift_one`` pairing: ranks of the lower half are paired with ranks of the
    upper half, and the pairing rotates by one every communication round."""
    half = size // 2
    if rank < half:
        return (rank + round_) % half + half
    return (rank - half - round_) % half


def exchange_shift_one(buf: torch.Tensor, group: bc.ProcessGroup, round_: int,
                       theirs: torch.Tensor | None = None) -> None:
    """Average ``buf`` with this round's peer in ``group`` (in place); ``theirs`` (optional)
    is a reusable receive buffer shaped like ``buf``."""
    peer = shift_one_peer(group.rank, group.size, round_)
    if theirs is None:
        theirs = torch.empty_like(buf)
    # One grouped operation: NCCL's recv and send each block the GPU until the peer's match
    # runs, so as two launches both ranks would wait in recv forever; gloo posts the receive
    # first (its "ready to receive" notice then does not queue behind outgoing data).
    bc.batch_isend_irecv([bc.P2POp("recv", theirs, peer), bc.P2POp("send", buf, peer)],
                         group=group)
    buf.add_(theirs).div_(2)


class Decentralized(Algorithm, name="decentralized"):
    """Each rank averages its weights with peers (``"all"``: everyone; ``"shift_one"``: one
    peer per round, the pairing rotating), every ``communication_interval`` steps.

    The exchange of the weights a forward starts from runs during forward and backward; at the
    end of backward the weights become the average and the optimizer applies the local
    gradient: ``x <- mean_peers(x) - lr * grad(x)``.  ``hierarchical=True`` averages inside
    each node first and exchanges among node leaders only.  On gloo CPU float32 (flat) the
    exchange is one compiled job on the group's worker (``bagua_comm._peer_average``), with
    the same results as the general path.
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


class DecentralizedState:
    """Rounds so far, and per-bucket buffers reused every round: the weights being averaged
    with the peers and (``shift_one``) the peer's weights being received."""

    def __init__(self):
        self.rounds = 0
        self.peer_weights: list[torch.Tensor] = []
        self.received: list[torch.Tensor | None] = []

    def build(self, buckets, shift_one: bool) -> None:
        self.peer_weights = [torch.empty_like(b.weight) for b in buckets]
        self.received = [torch.empty_like(b.weight) if shift_one else None for b in buckets]


class DecentralizedImpl(AlgorithmImpl):
    flatten_weights = True
    uses_grad_buckets = False

    def __init__(self, group, algo: Decentralized):
        super().__init__(group)
        self.mode = algo.peer_selection_mode
        self.interval = algo.communication_interval
        if algo.hierarchical:
            exchanging = group.num_nodes
            if self.mode == "shift_one" and exchanging > 1 and exchanging % 2:
                raise ValueError(f"peer_selection_mode='shift_one' needs an even number of "
                                 f"nodes, got {exchanging}; use 'all'")
        elif self.mode == "shift_one" and group.size > 1 and group.size % 2:
            raise ValueError(f"peer_selection_mode='shift_one' needs an even number of ranks, "
                             f"got {group.size}; use 'all'")
        self.reducer = Reducer(group, algo.hierarchical, "bagua-decentralized",
                               own_stream=True)   # submitted from the training stream
        self.state = DecentralizedState()
        self._work = None

    @property
    def rounds(self) -> int:
        return self.state.rounds

    def init_operations(self, ctx, buckets):
        self.buckets = buckets
        self.state.build(buckets, self.mode == "shift_one")
        self._compiled_of = None      # new buffers: the compiled round is made again

    def should_communicate(self, ctx) -> bool:
        return (ctx.step - 1) % self.interval == 0

    #: whether a layout may take the compiled path (tests compare it with the Python path)
    compiled = True
    _compiled_of = _compiled_round = None

    def _compiled(self) -> _hot.ExchangeRound | None:
        """The round as one compiled job (``bagua_comm._peer_average``: gloo CPU float32,
        flat), made once per layout; None where it takes the Python path (hierarchical
        among several nodes, NCCL, other dtypes, one rank)."""
        key = (self.buckets, self.reducer.hierarchical)
        if self._compiled_of is not None and self._compiled_of[0] is key[0] \
                and self._compiled_of[1] == key[1]:
            return self._compiled_round
        self._compiled_of, self._compiled_round = key, None
        if not self.compiled or self.reducer.hierarchical:
            return None
        st = self.state
        weights = [b.gather_weights() for b in self.buckets]
        theirs = st.received if self.mode == "shift_one" else []
        launch = peer_average_launcher(weights, st.peer_weights, theirs, self.mode,
                                       group=self.group)
        if launch is None:
            return None
        self._compiled_round = _hot.ExchangeRound([list(b.params) for b in self.buckets],
                                                  [b.weight_views() for b in self.buckets],
                                                  launch)
        return self._compiled_round

    def forward_pre_hook(self, ctx):
        if self._work is not None or (ctx.step - 1) % self.interval:
            return
        compiled = self._compiled()
        if compiled is not None:
            self._work, self._finish = compiled.start(self.state.rounds), compiled.finish
            return
        st = self.state
        for b, peer in zip(self.buckets, st.peer_weights):
            peer.copy_(b.gather_weights())
        round_, mode = st.rounds, self.mode

        def run():
            for peer, theirs in zip(st.peer_weights, st.received):
                def among(t, g, theirs=theirs):
                    if mode == "all":
                        bc.allreduce_inplace(t, bc.ReduceOp.AVG, group=g)
                    else:
                        exchange_shift_one(t, g, round_, theirs)

                self.reducer.reduce_with(peer, among, average=True)

        self._work, self._finish = self.reducer.exchange(run), self._copy_back

    def _copy_back(self, work) -> None:
        work.wait()
        with torch.no_grad():
            for b, peer in zip(self.buckets, self.state.peer_weights):
                b.weight.copy_(peer)
                b.scatter_weights()

    def post_backward_hook(self, ctx):
        if self._work is None:
            return
        work, self._work = self._work, None
        self._finish(work)
        self.state.rounds += 1

    def state_dict(self):
        return {"rounds": self.state.rounds}

    def load_state_dict(self, state):
        self.state.rounds = int(state["rounds"])

    def before_rebucket(self, ctx):
        # A forward without its backward left an exchange in flight: every rank did the same
        # forwards, so every rank drops that round alike.
        if self._work is not None:
            self._work.wait()
            self._work = None
        return self.state_dict()

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
        self.reducer.close()
