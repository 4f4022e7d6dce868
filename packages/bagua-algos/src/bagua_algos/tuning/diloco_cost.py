"""DiLoCo's cost model: what one sync costs on a link, how many steps DiLoCo needs at a sync
period H, and the H (and, with overlap, the inner steps a sync hides behind) that reaches a
run's target loss soonest.  :mod:`.recommend` prices DiLoCo with it; the main job's DiLoCo
rows (benchmarks/e2e) plan with the same functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Seconds per model byte to compress and decompress once, when it was not measured
#: (MinMaxUInt8 on one free CPU core runs at about 1 GB/s each way); the compressed
#: algorithms pay it twice per step.  :func:`measure_network` times it on the ranks
#: themselves (``NetworkMeasurement.codec_s_per_byte``): processes sharing cores, or a slow
#: CPU, pay several times this.
CODEC_S_PER_BYTE = 1e-9

#: DiLoCo's extra steps grow with log H (its ranks step on their own share of the batch, and
#: averaging every H steps recovers part of it): 1 + b ln H.  Re-derived at depth from the
#: trade-off map's 4-host cells (small model, 4-bit outer gradient, outer momentum 0.5, to DDP's
#: loss after 80 steps, a target training alone never reaches): 110 steps at H=11 (b 0.16),
#: 130 at H=65 (0.15), 200 at H=100 (0.16, 2 syncs; one sync at step 100 reached DDP's loss
#: after ~60 steps: 0.15).  The target is reached at a sync, so a run of H-step periods takes
#: whole periods (:func:`diloco_plan`).  The earlier 0.4 came from 10-30-step targets, where
#: the rows were still in their first sync period.
DILOCO_STEPS_PER_LOG_H = 0.16
#: Syncs a planned run holds at least: on the map no run reached a deep target with one (the
#: anchor's outer step then acts once), two sufficed at H=65 and H=100
DILOCO_MIN_SYNCS = 2
#: The shortest sync period recommend plans.  At H = 2 DiLoCo (outer lr 0.7, momentum 0.5)
#: needed more steps than the steps factor says (112 to DDP's loss after 80 steps, where
#: H = 4 needed 96, H = 6-10 90, H = 20 100; benchmarks/studies/diloco_depth.py), and a sync
#: every other step pays the sync's host work (outer step, codec) half the steps: at
#: 300 Mbit/s, 0 ms on 4 hosts H = 2 took 29.9 s where ByteGrad took 19.5 s
DILOCO_MIN_SYNC_EVERY = 4
#: Headroom on the predicted steps: the target is reached only at a sync, so a plan whose
#: last sync falls just short of ``factor x total_steps`` costs a whole extra period
DILOCO_PLAN_MARGIN = 1.1
#: The outer momentum recommend's DiLoCo runs with (outer_lr stays 0.7): a steady outer
#: gradient moves the anchor 0.7 / (1 - 0.5) = 1.4x per sync instead of 7x at 0.9.  At depth
#: (the runs above) 0.9 never reached DDP's loss after 40 steps at H = 2 and 4 (its loss
#: stopped falling after ~35 steps, near what training alone reaches), needed 70 steps at H = 8
#: where 0.5 needed 55, and the same 80 at H = 16
DILOCO_OUTER_MOMENTUM = 0.5
#: DiLoCo as recommend runs it: the outer gradient in 4 bits with error feedback (an eighth of
#: float32's bytes; the main job's fastest DiLoCo row), so each sync costs about this much of
#: a float32 allreduce's transfer
DILOCO_OUTER_BYTES = 1 / 8


#: Seconds a sync costs the ranks beyond its transfer, that no overlap hides: the outer
#: step, the codec and the wait for the slowest rank, paid at every sync.  Measured on the
#: main job's 4 hosts (4 ranks on 2 cores, the small model, 100 Mbit/s, 0 ms): a row hiding
#: its sync at H = 4 stepped in 0.107 s where its compute took 0.080-0.089 s, 0.07-0.11 s
#: a sync.  The plan with overlap prices it (without overlap, callers' ``sync_s`` carries it
#: and ties go to fewer syncs)
DILOCO_SYNC_HOST_S = 0.1


#: The shortest sync period planned with overlap.  Measured on the main job's small model to
#: DDP's loss after 80 steps, a sync overlapping T inner steps cost the anchor nothing beyond
#: those T steps at H >= 16 (H/T = 16/14, 20/8, 20/18, 22/13, 27/2, 75/8, 75/18), but at H = 4,
#: T = 2 it needed 116 steps where H = 4 without overlap needed 96
DILOCO_MIN_HIDDEN_SYNC_EVERY = 16


def diloco_steps_factor(sync_every: int) -> float:
    """DiLoCo's estimated steps to DDP's loss, as a multiple of DDP's, at ``sync_every``."""
    return 1.0 + DILOCO_STEPS_PER_LOG_H * math.log(max(1, sync_every))


#: Latency rounds (in units of the measured exchange) of a compressed allreduce, whatever the
#: ranks: its two exchanges (chunks to their owners, then the reduced chunks to everyone) each
#: go to every peer at once (measured on 4 hosts at 50 ms one way: ByteGrad four one-way
#: latencies a bucket, DiLoCo's 4-bit sync 0.37 s where 2(n-1) rounds said 0.6 s)
COMPRESSED_ROUNDS = 2


#: TCP's congestion window after the connection was idle (Linux's initial window: 10 segments
#: of 1448 bytes).  With net.ipv4.tcp_slow_start_after_idle=1 (Linux's default) a burst sent
#: after a silence longer than a retransmission timeout restarts from it and doubles each
#: round trip, under any congestion control but BBR (which Linux exempts): a DiLoCo sync,
#: after H steps of silence, always does
TCP_INITIAL_WINDOW = 10 * 1448


def slow_start_round_trips(nbytes: float) -> float:
    """Round trips a burst of ``nbytes`` takes from TCP's initial window (which doubles each
    round trip): about ``1 + log2(nbytes / TCP_INITIAL_WINDOW)``, at least 1."""
    return 1.0 + math.log2(max(1.0, nbytes / TCP_INITIAL_WINDOW))


def diloco_sync_seconds(bandwidth_mbit: float, latency_ms: float, nodes: int,
                        model_bytes: float, codec_s_per_byte: float | None = None, *,
                        slow_start: bool = False) -> float:
    """One DiLoCo sync as ``recommend`` runs it: a compressed allreduce of the model's outer
    gradient in 4 bits among ``nodes`` (:data:`COMPRESSED_ROUNDS` exchanges of
    ``latency_ms``, the ring's bytes / 8, the codec).  ``latency_ms`` is recommend's unit,
    one tiny exchange (about a round trip on gloo).  ``slow_start``: the hosts restart TCP
    from its initial window after idle (``net.ipv4.tcp_slow_start_after_idle=1`` and a
    congestion control other than BBR: ``NetworkMeasurement.tcp_restarts_after_idle``), so
    each exchange takes :func:`slow_start_round_trips` of one peer's share instead of one
    round trip.  Measured on 4 hosts at 100 Mbit/s, 50 ms one way (MTU 9000), a sync of the
    main job's small model after 1.2 s of silence: 0.31-0.33 s under BBR with the switch on
    or off, 0.37-0.38 s under CUBIC with it on (0.29-0.30 s off); one round trip per
    exchange says 0.30 s."""
    n = max(1, nodes)
    per_byte = CODEC_S_PER_BYTE if codec_s_per_byte is None else codec_s_per_byte
    ring = 2 * (n - 1) / n * model_bytes
    trips = slow_start_round_trips(model_bytes * DILOCO_OUTER_BYTES / n) if slow_start else 1.0
    return (COMPRESSED_ROUNDS * trips * latency_ms / 1e3
            + ring * DILOCO_OUTER_BYTES / (bandwidth_mbit * 1e6 / 8)
            + 2 * per_byte * model_bytes)


@dataclass(frozen=True)
class DiLoCoPlan:
    """A DiLoCo run planned to reach the loss DDP reaches after ``total_steps`` steps."""

    sync_every: int   # H
    steps: int        # optimizer steps the run is planned for: ``syncs x sync_every``
    syncs: int
    time_s: float     # predicted: ``steps x compute_s + syncs x sync_s`` (with overlap:
    #                   ``(steps + overlap_steps) x compute_s``)
    overlap_steps: int = 0   # the inner steps each sync overlaps (DiLoCo's ``overlap_steps``)


def overlap_steps_for(sync_s: float, compute_s: float, sync_every: int = 512) -> int:
    """The inner steps a sync of ``sync_s`` seconds overlaps so that it hides behind them
    (DiLoCo's ``overlap_steps``): ``ceil(sync_s / compute_s)``, within [1, H - 1] (a sync
    lands before the next one starts); 1 where the step's compute is not known."""
    if compute_s <= 0:
        return 1
    return max(1, min(int(sync_every) - 1, math.ceil(max(0.0, sync_s) / compute_s)))


def diloco_plan(sync_s: float, compute_s: float, total_steps: int, *,
                min_syncs: int = DILOCO_MIN_SYNCS,
                margin: float = DILOCO_PLAN_MARGIN, overlap: bool = False,
                host_s: float | None = None) -> DiLoCoPlan:
    """The H that reaches DDP's loss after ``total_steps`` steps soonest, by the cost model
    ``time = steps x compute_s + syncs x sync_s``: DiLoCo needs
    ``margin x diloco_steps_factor(H) x total_steps`` steps, and reaches the target at a sync,
    so with ``k`` syncs H is the smallest with ``k x H`` at least that.  Every ``k`` from
    ``min_syncs`` up (H down to :data:`DILOCO_MIN_SYNC_EVERY`) is priced; the cheapest wins,
    ties (within 2%) to fewer syncs: a sync's host work (the outer step, the codec) comes on
    top of ``sync_s`` as callers estimate it (measured on the map: 0.15-0.2 s a sync at
    100 Mbit/s where DDP's allreduce / 8 said 0.09).  H within
    [:data:`DILOCO_MIN_SYNC_EVERY`, 512].

    ``overlap``: each sync overlaps the ``T = ceil(sync_s / compute_s)`` inner steps its
    transfer takes (DiLoCo's ``overlap_steps``, Streaming DiLoCo), so only the last sync's
    ``T`` steps are paid (the synced model, the anchor, reaches the target when that sync
    lands: ``benchmarks/studies/diloco_depth.py`` measured exactly ``+T`` steps on it) and
    the others cost nothing on the wire.  H is then at least ``T + 1`` (a sync lands before
    the next one starts) and :data:`DILOCO_MIN_HIDDEN_SYNC_EVERY`; a sync longer than 511
    steps pays the rest, and every sync pays ``host_s`` (default :data:`DILOCO_SYNC_HOST_S`
    with overlap, 0 without), so that a sync cheap on the wire is not planned every few
    steps.  Priced by the expected time to the target, not whole periods with headroom
    (:func:`_hidden_plan`); the plan's ``time_s`` is that, its ``steps`` and ``syncs`` the
    whole periods that cover ``S``.  The plan's ``overlap_steps`` is ``T`` (0 without
    overlap)."""
    n = max(1, int(total_steps))
    c, sync_s = max(0.0, compute_s), max(0.0, sync_s)
    hide = overlap_steps_for(sync_s, c) if overlap else 0
    host = max(0.0, (DILOCO_SYNC_HOST_S if overlap else 0.0) if host_s is None else host_s)
    floor = max(DILOCO_MIN_SYNC_EVERY, hide + 1)
    if overlap:
        return _hidden_plan(n, c, sync_s, hide, host, max(floor, DILOCO_MIN_HIDDEN_SYNC_EVERY),
                            min_syncs)
    plans = []
    for k in range(max(1, min_syncs), n + 1):
        h = max(floor, math.ceil(margin * n / k))
        for _ in range(8):         # the factor grows with H: settle the fixed point
            need = math.ceil(margin * n * diloco_steps_factor(h) / k)
            if need <= h:
                break
            h = need
        h = min(512, h)
        t = k * h * c + k * (host + sync_s)
        plans.append(DiLoCoPlan(h, k * h, k, t, hide))
        if h <= floor:
            break
    fastest = min(p.time_s for p in plans)
    return min((p for p in plans if p.time_s <= 1.02 * fastest), key=lambda p: p.syncs)


def _hidden_plan(n: int, c: float, sync_s: float, hide: int, host: float, floor: int,
                 min_syncs: int) -> DiLoCoPlan:
    """:func:`diloco_plan` with overlap.  A run stops at the first sync that reaches its
    target, which the anchor does after about ``S = diloco_steps_factor(H) x n`` steps: on
    average half a period past it, then the last sync's ``T`` steps.  With the syncs'
    transfers hidden, each costs only its host work (and any wire time beyond ``T`` steps),
    so H trades that against the half period:
    ``time = (S + H / 2 + T) x c + S / H x (host + max(0, sync - T x c))``, least over H in
    [``floor``, 512] (``floor`` at least :data:`DILOCO_MIN_HIDDEN_SYNC_EVERY`) with at least
    ``min_syncs`` syncs in S.  Not :func:`diloco_plan`'s
    whole-period headroom: on the main job's 4 hosts at 100 Mbit/s, 50 ms that picked H = 27
    (5 x 27 = 135 >= 1.1 x 1.53 x 80), whose 4th sync at 108 steps fell short and the 5th
    landed at 150, where H = 22 had landed at 123 (5 x 22 = 110 reached it)."""
    wire = max(0.0, sync_s - hide * c)
    best = None
    for h in range(floor, 513):
        need = n * diloco_steps_factor(h)
        if best is not None and need / h < min_syncs:
            break
        t = (need + h / 2 + hide) * c + need / h * (host + wire)
        if best is None or t < best[0]:
            best = (t, h, need)
    t, h, need = best
    k = max(min_syncs, math.ceil(need / h))
    return DiLoCoPlan(h, k * h, k, t, hide)


def diloco_run_plan(sync_s: float, compute_s: float, total_steps: int) -> DiLoCoPlan:
    """The faster of DiLoCo's two plans for a run: every sync blocking, or every sync
    overlapping the inner steps it takes (Streaming DiLoCo; the run's result is then the
    anchor, ``synced_state_dict()``).  Both are priced with a sync's host work
    (:data:`DILOCO_SYNC_HOST_S`, which the blocking plan's own choice of H leaves to its tie
    rule); ties (within 2%) go to the blocking one, whose ranks hold the synced model.
    The hidden plan's time is its expected time to the target, the blocking plan's its whole
    periods with headroom, so the comparison leans towards hiding by up to half a period; on
    the main job's map hiding was the faster row in 3 of 4 cells (docs/tradeoff.md)."""
    plain = diloco_plan(sync_s, compute_s, total_steps)
    hidden = diloco_plan(sync_s, compute_s, total_steps, overlap=True)
    if hidden.time_s < (plain.time_s + plain.syncs * DILOCO_SYNC_HOST_S) / 1.02:
        return hidden
    return plain


def diloco_open_plan(sync_s: float, compute_s: float) -> tuple[int, int]:
    """``(H, T)`` for a run of unknown length: every sync blocking at
    :func:`diloco_sync_every`'s H (``T = 0``), or every sync hidden behind the ``T`` inner
    steps its transfer takes, whichever costs less a step in the long run, ties (within 2%)
    to blocking.  A step costs ``diloco_steps_factor(H) x (compute + per sync / H)``, a sync
    :data:`DILOCO_SYNC_HOST_S` of host work on top of its transfer when blocking, and that
    and any transfer beyond ``T`` steps when hidden (H at least ``T + 1`` and
    :data:`DILOCO_MIN_HIDDEN_SYNC_EVERY`); the hidden run's one-off ``T`` steps at its end
    are left out.  On the main job's 4 hosts at 100 Mbit/s, 50 ms (a sync ~0.5 s, a step
    0.1 s) the blocking rule's H = 34 reached DDP's loss after 80 steps in 15.1 s, the hidden
    H = 16, T = 5 in 10.4 s."""
    c, sync_s = max(0.0, compute_s), max(0.0, sync_s)
    h = diloco_sync_every(sync_s, c)
    blocking = diloco_steps_factor(h) * (c + (sync_s + DILOCO_SYNC_HOST_S) / h)
    hide = overlap_steps_for(sync_s, c)
    wire = max(0.0, sync_s - hide * c) + DILOCO_SYNC_HOST_S
    floor = max(DILOCO_MIN_SYNC_EVERY, hide + 1, DILOCO_MIN_HIDDEN_SYNC_EVERY)
    if floor > 512:
        return h, 0
    hidden, hh = min((diloco_steps_factor(k) * (c + wire / k), k) for k in range(floor, 513))
    return (hh, hide) if hidden < blocking / 1.02 else (h, 0)


def diloco_sync_every(comm_s: float, compute_s: float, overhead: float = 0.1, *,
                      total_steps: int | None = None,
                      min_syncs: int = DILOCO_MIN_SYNCS) -> int:
    """DiLoCo's ``sync_every`` (H) for a step of ``compute_s`` whose sync would take
    ``comm_s``.  With ``total_steps`` (the run's planned optimizer steps: DDP's steps to the
    loss the run aims at), the H of :func:`diloco_plan`: the fewest seconds to that loss.
    Without it, the run's length is unknown: one sync spread over H steps adds at most
    ``overhead`` (10%) of their compute, H >= comm / (overhead x compute).  Within
    [:data:`DILOCO_MIN_SYNC_EVERY`, 512].
    The main job's DiLoCo rows use this same rule (benchmarks/e2e/_e2e_rows.py), told DDP's
    steps to the deepest target."""
    if total_steps is not None:
        return diloco_plan(comm_s, compute_s, total_steps, min_syncs=min_syncs).sync_every
    want = math.ceil(max(0.0, comm_s) / (overhead * max(compute_s, 1e-6)))
    return int(min(512, max(DILOCO_MIN_SYNC_EVERY, want)))

