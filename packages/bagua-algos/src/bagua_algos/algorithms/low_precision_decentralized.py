"""Low-precision decentralized SGD: ring neighbours exchange 8-bit compressed differences of
their weights after each optimizer step (Bagua's algorithm, after arXiv 1803.06443)."""

from __future__ import annotations

import torch

import bagua_comm as bc
from bagua_comm._ring import low_precision_ring_launcher

from .._engine import _hot
from .._engine.checks import check_bool, check_interval
from .._engine.comm import Reducer
from .._engine.overflow import all_finite
from .._engine.state import export_flat, import_flat
from ..algorithm import Algorithm, AlgorithmImpl
from ._shared import alignment, check_compressor, decode_add, make_compressor


class LowPrecisionDecentralized(Algorithm, name="low_precision_decentralized"):
    """Ring topology with weights 1/3 (self, left, right); only compressed differences travel.

    Each rank keeps replicas ``l``, ``r`` of its neighbours' weights and ``x`` of its own last
    communicated weights.  After ``optimizer.step()`` turned ``x`` into ``w``:
    ``z = w + l/3 + r/3 - 5/3 x`` (the step from ``x`` to ``(x + l + r)/3`` plus the local
    update), ``x <- x + Q(z)`` becomes the new weights, ``Q(z)`` goes to both neighbours and
    each replica moves by the difference its owner sent.  ``Q`` is ``compressor`` (any
    ``bagua_comm.compression.Compressor``; default ``MinMaxUInt8`` with one chunk per
    bucket).  On two ranks both neighbours are the same peer, which then gets one message.
    ``hierarchical=True`` averages inside each node first (full precision) and runs the ring
    among node leaders.
    """

    def compresses(self):
        return True

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1,
                 compressor=None):
        check_bool("hierarchical", hierarchical)
        check_interval(communication_interval)
        check_compressor(compressor)
        self.hierarchical = hierarchical
        self.communication_interval = communication_interval
        self.compressor = compressor

    def reify(self, group):
        return LowPrecisionDecentralizedImpl(group, self)


class LowPrecisionDecentralizedState:
    """Per bucket: ``mine`` (x), the replicas ``left``/``right`` (exported keyed by
    parameter), and temporaries reused every round (the difference, its decoding, the
    payload and the neighbours' payloads)."""

    NAMES = ("mine", "left", "right")

    def __init__(self, compressor):
        self.compressor = compressor
        self.rounds = 0
        self.mine: list[torch.Tensor] = []
        self.left: list[torch.Tensor] = []
        self.right: list[torch.Tensor] = []
        self.diff: list[torch.Tensor] = []
        self.decoded: list[torch.Tensor] = []
        self.payload: list[torch.Tensor | None] = []
        self.from_left: list[torch.Tensor | None] = []
        self.from_right: list[torch.Tensor | None] = []

    def build(self, buckets) -> None:
        self.mine = [b.weight.clone() for b in buckets]     # everyone starts equal
        self.left = [b.weight.clone() for b in buckets]
        self.right = [b.weight.clone() for b in buckets]
        self.diff = [torch.empty_like(b.weight) for b in buckets]
        self.decoded = [torch.empty_like(b.weight) for b in buckets]
        n = len(buckets)
        self.payload, self.from_left, self.from_right = [None] * n, [None] * n, [None] * n

    def export(self, buckets) -> dict:
        out = {"rounds": self.rounds}
        for name in self.NAMES:
            out[name] = export_flat(buckets, getattr(self, name))
        return out

    def load(self, buckets, state, names=NAMES) -> int:
        """Load ``names`` from ``state``; returns how many parameters were found (of the
        last name)."""
        found = 0
        for name in names:
            found = import_flat(buckets, getattr(self, name), state.get(name, {}),
                                f"LowPrecisionDecentralized's {name!r} replicas")
        self.rounds = int(state.get("rounds", 0))
        return found


def _payloads(st, i: int, distinct: bool):
    """Bucket ``i``'s payload and the two receive buffers (one when both neighbours are the
    same rank), made at the first round and reused: the compressed difference has
    ``compressor.payload_numel(numel)`` bytes."""
    if st.payload[i] is None:
        diff = st.diff[i]
        st.payload[i] = torch.empty(st.compressor.payload_numel(diff.numel()),
                                    dtype=torch.uint8, device=diff.device)
    if st.from_left[i] is None:
        st.from_left[i] = torch.empty_like(st.payload[i])
        st.from_right[i] = torch.empty_like(st.payload[i]) if distinct else st.from_left[i]
    return st.payload[i], st.from_left[i], st.from_right[i]


class LowPrecisionDecentralizedImpl(AlgorithmImpl):
    flatten_weights = True
    uses_grad_buckets = False

    def __init__(self, group, algo: LowPrecisionDecentralized):
        super().__init__(group)
        self.hierarchical = algo.hierarchical
        self.interval = algo.communication_interval
        self.reducer = Reducer(group, self.hierarchical, "bagua-low-precision")
        self.ring = self.reducer.peers
        self.state = LowPrecisionDecentralizedState(make_compressor(algo.compressor, 1))
        self._resync = False          # replicas to re-derive from the neighbours (resume)
        self._mine_from_weights = False
        # one round per training step: the step whose backward ended and whose round has not
        # run yet, and the optimizers that stepped since
        self._owed: int | None = None
        self._stepped: set[int] = set()

    def bucket_alignment(self) -> int:
        return alignment(self.state.compressor, 1)

    @property
    def rounds(self) -> int:
        return self.state.rounds

    def init_operations(self, ctx, buckets):
        self.buckets = buckets
        self.state.build(buckets)
        self._compiled_of = None      # new buffers: the compiled round is made again

    def forward_pre_hook(self, ctx):
        if self._owed is not None:     # not every optimizer stepped: the round runs now
            self._round(self._owed)
        if self._mine_from_weights:    # a checkpoint that did not cover every parameter
            self._mine_from_weights = False
            with torch.no_grad():
                for x, b in zip(self.state.mine, self.buckets):
                    x.copy_(b.gather_weights())

    def _resync_replicas(self, i: int) -> None:
        """Set the replicas of both neighbours to their ``x`` (full precision, once after a
        resume).  Exact: a replica always equals its owner's ``x`` bit for bit, since both
        add the same decoded differences."""
        g, st = self.ring, self.state
        left_rank, right_rank = (g.rank - 1) % g.size, (g.rank + 1) % g.size
        ops = [bc.P2POp("recv", st.left[i], left_rank)]
        if right_rank != left_rank:
            ops.append(bc.P2POp("recv", st.right[i], right_rank))
        ops += [bc.P2POp("send", st.mine[i], p) for p in {left_rank, right_rank}]
        bc.batch_isend_irecv(ops, group=g)      # grouped: see exchange_shift_one
        if right_rank == left_rank:
            st.right[i].copy_(st.left[i])

    def _ring_step(self, i: int, w: torch.Tensor, bucket) -> None:
        g, st, comp = self.ring, self.state, self.state.compressor
        left_rank, right_rank = (g.rank - 1) % g.size, (g.rank + 1) % g.size
        x, left, right = st.mine[i], st.left[i], st.right[i]
        diff, q = st.diff[i], st.decoded[i]
        # diff = w + left/3 + right/3 - 5/3 x, with the rounding of that expression, in
        # reused buffers (q is scratch until it receives the decoding)
        torch.div(left, 3, out=diff)
        diff.add_(w)
        torch.div(right, 3, out=q)
        diff.add_(q)
        torch.mul(x, 5 / 3, out=q)
        diff.sub_(q)
        if diff.numel() > bucket.numel:
            diff[bucket.numel:].zero_()
        payload, from_left, from_right = _payloads(st, i, left_rank != right_rank)
        comp.compress(diff, key=bucket.name, out=payload)
        decode_add(comp, payload, x, q)
        w.copy_(x)
        peers = {left_rank: from_left, right_rank: from_right}
        # One grouped exchange (see decentralized.exchange_shift_one).
        bc.batch_isend_irecv([bc.P2POp("recv", buf, peer) for peer, buf in peers.items()]
                             + [bc.P2POp("send", payload, peer) for peer in peers], group=g)
        for replica, buf in ((left, from_left), (right, from_right)):
            decode_add(comp, buf, replica, q)

    # One round per training step, whatever the optimizers do: a backward owes a round, run
    # after every optimizer in the list has stepped; else at the end of backward when a
    # gradient is not finite (a GradScaler will skip this rank's step, maybe on this rank
    # only: the peers' rounds must still find this one); else at the next forward.  Every
    # rank therefore runs the same rounds in the same order.
    def post_backward_hook(self, ctx):
        if self._owed is not None:     # a backward without a step in between
            self._round(self._owed)
        self._owed, self._stepped = ctx.step, set()
        if not self._communicates(ctx.step):
            return
        if not all_finite([p.grad for b in self.buckets for p in b.params]):
            self._round(ctx.step)

    def post_optimizer_step_hook(self, ctx, optimizer):
        if self._owed is None:
            return
        self._stepped.add(id(optimizer))
        if all(id(opt) in self._stepped for opt in ctx.optimizers):
            self._round(self._owed)

    def _communicates(self, step: int) -> bool:
        return (step - 1) % self.interval == 0

    def _compiled(self) -> _hot.WeightRound | None:
        """The round as compiled ring jobs (``bagua_comm._ring``: MinMaxUInt8 on gloo CPU
        float32, flat), made once per layout; None where a bucket takes the Python path."""
        if self._compiled_of is self.buckets:
            return self._compiled_round
        self._compiled_of, self._compiled_round = self.buckets, None
        g, st = self.ring, self.state
        if self.reducer.hierarchical or g.size < 2:
            return None
        distinct = g.size > 2
        starts = []
        for i, b in enumerate(self.buckets):
            w = b.gather_weights()
            if w.dtype != torch.float32 or w.device.type != "cpu":
                return None
            payload, from_left, from_right = _payloads(st, i, distinct)
            start = low_precision_ring_launcher(w, st.mine[i], st.left[i], st.right[i],
                                                st.diff[i], payload, from_left, from_right,
                                                b.numel, st.compressor, group=g)
            if start is None:
                return None
            starts.append(start)
        self._compiled_round = _hot.WeightRound([list(b.params) for b in self.buckets],
                                           [b.weight_views() for b in self.buckets], starts)
        return self._compiled_round

    _compiled_of = _compiled_round = None

    def _round(self, step: int) -> None:
        self._owed, self._stepped = None, set()
        if not self._communicates(step):
            return
        compiled = self._compiled()
        if compiled is not None:
            if self._resync:
                with torch.no_grad():
                    for i in range(len(self.buckets)):
                        self._resync_replicas(i)
            compiled()
            self._resync = False
            self.state.rounds += 1
            return
        with torch.no_grad():
            for i, b in enumerate(self.buckets):
                w = b.gather_weights()

                def ring(t, _g, i=i, b=b):
                    if self._resync:
                        self._resync_replicas(i)
                    self._ring_step(i, t, b)

                # flat: the ring over every rank; hierarchical: node average, the ring among
                # node leaders, node broadcast
                self.reducer.reduce_with(w, ring, average=True)
                b.scatter_weights()
        self._resync = False
        self.state.rounds += 1

    def state_dict(self):
        return self.state.export(self.buckets)

    def load_state_dict(self, state):
        self.state.load(self.buckets, state)
        # Every rank re-derives its replicas at the next round, whichever file it loaded
        # (rank 0 cannot know whether its peers loaded their own files or its own).
        self._resync = True

    def foreign_view(self, state):
        return None          # the saving rank's own weights: never another rank's

    def load_foreign_state_dict(self, state, *, world_size, rank):
        found = self.state.load(self.buckets, state, names=("mine",))
        if found < sum(len(b.params) for b in self.buckets):
            self._mine_from_weights = True
        self._resync = True
        return ("each rank's replicas of its ring neighbours are re-derived from the "
                "neighbours' weights (one full-precision exchange at the next round)")

    def after_rebucket(self, ctx, buckets, state):
        # the replicas are this rank's own, carried exactly: no re-derivation needed
        self.init_operations(ctx, buckets)
        self.state.load(buckets, state)

    def shutdown(self):
        self.reducer.close()
