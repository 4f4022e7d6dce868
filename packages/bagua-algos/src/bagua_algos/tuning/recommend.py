"""Choosing the algorithm from the network: measure bandwidth and latency, apply the rule.

    from bagua_algos import recommend, with_bagua
    rec = recommend(model)                  # collective: every rank, same group
    model = with_bagua(model, [opt], rec.algorithm)
    # or in one go (an explicit algorithm, or BAGUA_ALGORITHM=<name>, overrules it):
    model = with_bagua(model, [opt], "auto")

The measurement (:func:`measure_network`) is a ring shift between ranks on different nodes
(rank r sends to r + local_size): first tiny messages (latency = the time of one shift: one
way where a send goes at once, about two one-way delays on gloo, whose send waits for the
receiver's "ready" notice -- measured 10.7 ms at 5 ms and 101 ms at 50 ms one way; the rule
then counts latency in units of one such exchange), then growing probes (bandwidth = bytes / (time - latency)) until a probe takes long
enough to be read or the time budget is spent.  Every rank times its own exchanges; the times
are reduced with MAX, so every rank holds the same numbers and computes the same choice.
The probes and the codec's timing run on the job's device (its parameters'): a GPU job is
priced by NCCL and the CUDA codec, each timing ending when the GPU is done.

The rule (:func:`choose`) is a cost model of one training step per algorithm, checked against
the trade-off map (benchmarks/tradeoff.py, docs/tradeoff.md):

    comm(a)  = rounds(a) * latency + wire_bytes(a) / bandwidth [+ codec(a) * model bytes]
    score(a) = (compute + comm(a)) * steps_factor(a)

with ``rounds``/``wire_bytes`` per rank for a ring allreduce (2(n-1) rounds, 2(n-1)/n of the
model), ByteGrad (the same, 4x fewer bytes), Decentralized shift_one (one exchange of the
model with one peer) and LowPrecisionDecentralized (one exchange, compressed, with two ring
neighbours), and, with the computation time known, DiLoCo with a 4-bit outer gradient (one
compressed allreduce every H steps); ``steps_factor`` is how many more steps an algorithm
needs to reach the same loss (measured on the map's workload; DiLoCo's grows with log H).
The lowest score wins; near-ties (within 5%, or 50% when the computation time is not given)
go to the exact algorithm.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

import bagua_comm as bc

from .._engine.small import max_small
from .diloco_cost import (  # noqa: F401  (DiLoCo's cost model, re-exported: recommend's API)
    CODEC_S_PER_BYTE,
    COMPRESSED_ROUNDS,
    DILOCO_MIN_SYNC_EVERY,
    DILOCO_MIN_SYNCS,
    DILOCO_OUTER_BYTES,
    DILOCO_OUTER_MOMENTUM,
    DILOCO_PLAN_MARGIN,
    DILOCO_STEPS_PER_LOG_H,
    DILOCO_SYNC_HOST_S,
    DiLoCoPlan,
    diloco_open_plan,
    diloco_plan,
    diloco_run_plan,
    diloco_steps_factor,
    diloco_sync_every,
    diloco_sync_seconds,
)

log = logging.getLogger("bagua_algos.recommend")

#: Extra steps each algorithm needs to reach the loss full-precision DDP reaches (x), from the
#: trade-off map's runs: compression and gossip cost a little convergence.  DiLoCo's depends on
#: H: :func:`diloco_steps_factor`.
STEPS_FACTOR = {"gradient_allreduce": 1.0, "bytegrad": 1.05, "decentralized": 1.25,
                "low_precision_decentralized": 1.4}
#: Scores within this ratio of the exact algorithm's count as a tie (it wins); wider when the
#: step's computation is unknown (the steps factors then only weigh the communication).
TIE, TIE_UNKNOWN_COMPUTE = 1.05, 1.5
#: The exact allreduce's communication per step below which nothing is worth approximating,
#: whatever the ratios (a fast, near network: loopback measured 2 ranks 0.2 ms apart, where
#: the ratios alone preferred one exchange with one peer to the allreduce's two rounds).
NEGLIGIBLE_S = 0.01
_UINT8 = 4.0  # MinMaxUInt8 sends a quarter of float32's bytes
#: Seconds of transfer (beyond the latency) that make a bandwidth probe readable: the
#: probe stops at the first size whose transfer is at least this and :data:`PROBE_READ_LAT`
#: of the latency it is corrected by (each further probe is 4x the bytes and, at 50 ms one
#: way, ~0.4 s of the measurement: two shots and a MAX; a 1 MiB probe at 100 Mbit/s, 0.08 s,
#: reads to ~7%, and 4 MiB cost 1.06 s of a 10 s run at 0 ms)
PROBE_READ_S = 0.05
#: ... and this fraction of the latency: at 50 ms one way a fresh connection's 256 KiB probe,
#: still in TCP's slow start, took 0.05 s beyond it (40 Mbit/s on a 100 Mbit/s link)
PROBE_READ_LAT = 0.7
#: The largest bandwidth probe, bytes
_MAX_PROBE = 64 * 1024 * 1024
#: float32 elements of the buffer measure_network compresses and decompresses (4 MiB)
_CODEC_PROBE = 1 << 20


@dataclass
class NetworkMeasurement:
    """What :func:`measure_network` found (the same on every rank)."""

    bandwidth_mbit: float
    latency_ms: float  # one tiny exchange between two ranks on different nodes (gloo: ~2 one-way)
    world_size: int
    nodes: int
    elapsed_s: float
    probes: list = field(default_factory=list)  # (bytes, seconds) of each bandwidth probe
    #: seconds per float32 byte for one MinMaxUInt8 compress + decompress, on the slowest rank
    #: (None: not measured; :data:`CODEC_S_PER_BYTE` is assumed)
    codec_s_per_byte: float | None = None
    #: net.ipv4.tcp_slow_start_after_idle on any rank (None: not Linux, unknown)
    tcp_slow_start_after_idle: bool | None = None
    #: whether a connection idle for a retransmission timeout restarts from TCP's initial
    #: window on any rank: the switch above on and a congestion control that obeys it (None:
    #: unknown).  BBR keeps its model across idle (Linux skips the restart for a congestion
    #: control with its own ``cong_control``): with the switch on, a DiLoCo sync after 1.2 s of
    #: silence took 0.31-0.33 s under BBR, as with the switch off, and 0.37-0.38 s under CUBIC
    #: (0.29-0.30 s off); 4 hosts at 100 Mbit/s, 50 ms one way, MTU 9000.  What a sync pays in
    #: slow start (see the log line)
    tcp_restarts_after_idle: bool | None = None
    #: the device the probes and the codec ran on: the job's (its parameters'), so that a GPU
    #: job is priced by its own transport (NCCL) and its own codec kernels, not gloo and CPU
    device: str = "cpu"


#: Where the switch lives (per network namespace, Linux)
_SSAI = "/proc/sys/net/ipv4/tcp_slow_start_after_idle"
#: ... and the congestion control new connections get (gloo sets none of its own)
_CC = "/proc/sys/net/ipv4/tcp_congestion_control"
#: The exchange latency above which the slow-start switch is worth a warning: a burst restarted
#: from TCP's initial window of ~14 KB needs ~log2(bytes / 14 KB) round trips to reach a
#: megabyte window (about 7), which at this latency is >= 0.1 s a step
SLOW_START_WARN_MS = 15.0


def _slow_start_after_idle() -> float:
    """1.0/0.0: this host's net.ipv4.tcp_slow_start_after_idle; -1.0: not readable."""
    try:
        with open(_SSAI) as f:
            return float(int(f.read().strip()) != 0)
    except (OSError, ValueError):
        return -1.0


def _restarts_after_idle(ssai: float) -> float:
    """1.0/0.0: whether this host's new TCP connections restart from the initial window after
    idle (``ssai``, :func:`_slow_start_after_idle`, on and a congestion control that is not
    BBR, which Linux exempts); -1.0: unknown.  The switch alone where the congestion control
    cannot be read."""
    if ssai <= 0:
        return ssai
    try:
        with open(_CC) as f:
            cc = f.read().strip()
    except OSError:
        return ssai
    return 0.0 if cc.startswith("bbr") else 1.0


def slow_start_note(m: NetworkMeasurement) -> str:
    """A warning for the log line when TCP restarts slow start after idle on a far link
    ("" otherwise)."""
    if not m.tcp_restarts_after_idle or m.latency_ms < SLOW_START_WARN_MS:
        return ""
    return (f"; note: net.ipv4.tcp_slow_start_after_idle=1 on these hosts: at "
            f"{m.latency_ms:.0f} ms each step's burst restarts TCP from its initial window "
            f"(several round trips); `sysctl -w net.ipv4.tcp_slow_start_after_idle=0` on every "
            f"host removes that (docs/tradeoff.md)")


@dataclass
class Recommendation:
    """:func:`recommend`'s answer: the algorithm to use, and why.  ``bucket_size``: the
    bucket size (bytes) the network asks for (None: with_bagua's default will do), which
    ``with_bagua(..., "auto")`` uses unless it is given one."""

    name: str
    kwargs: dict
    algorithm: object
    measurement: NetworkMeasurement | None
    reason: str
    scores: dict
    bucket_size: int | None = None


#: with_bagua's default bucket size (module.DEFAULT_BUCKET_SIZE) and the largest suggested
_DEFAULT_BUCKET, _MAX_BUCKET = 10 * 1024 * 1024, 256 * 1024 * 1024
#: One-way latencies each bucket's collective waits for, per algorithm whose communication
#: is per gradient bucket: the ring allreduce's 2(n-1) steps; the compressed allreduce's two
#: exchanges (scatter, then gather), each a receive notice and the data (measured on 4 hosts
#: at 50 ms one way: 205 ms for a 4 KB compressed allreduce; 13 MB in 1 / 2 / 4 buckets took
#: 683 / 899 / 1379 ms, about 230 ms per extra bucket).
def _bucket_latencies(name: str, n: int) -> int | None:
    return {"gradient_allreduce": 2 * (n - 1), "bytegrad": 4}.get(name)


def bucket_size_for(name: str, bandwidth_mbit: float, latency_ms: float, nodes: int,
                    model_bytes: float) -> int | None:
    """A bucket size (bytes) large enough that each bucket's fixed latency cost stays under a
    quarter of its transfer time, for the algorithms that communicate per gradient bucket;
    None where with_bagua's default (10 MiB) already does (or the algorithm has no such
    cost).  Under 50 ms one way at 100 Mbit/s this puts a 13 MB model in one ByteGrad bucket
    (fewer buckets, less overlap with backward, but each one pays ~4 latencies)."""
    phases = _bucket_latencies(name, nodes)
    if not phases or nodes < 2 or latency_ms <= 0:
        return None
    bps = bandwidth_mbit * 1e6 / 8
    wire = 4 * phases * latency_ms / 1e3 * bps          # bytes each link must carry per bucket
    ring = 2 * (nodes - 1) / nodes
    raw = wire / ring * (_UINT8 if name == "bytegrad" else 1.0)
    size = int(min(max(raw, _DEFAULT_BUCKET), _MAX_BUCKET, max(model_bytes, _DEFAULT_BUCKET)))
    return size if size > _DEFAULT_BUCKET else None


def choose(bandwidth_mbit: float, latency_ms: float, world_size: int, model_bytes: float, *,
           compute_s: float = 0.0, nodes: int | None = None,
           total_steps: int | None = None,
           codec_s_per_byte: float | None = None,
           slow_start: bool = False) -> tuple[str, dict, str, dict]:
    """The rule: ``(name, kwargs, reason, scores)`` for a network and a model.

    ``bandwidth_mbit``/``latency_ms`` (one way) between nodes, ``model_bytes`` the gradient
    bytes per step, ``compute_s`` a step's computation (0: unknown, communication only).
    With the computation known, DiLoCo (train locally, average every H steps) is a candidate
    too: its cost only makes sense against it (``recommend(model, compute_s=...)`` is told it;
    ``with_bagua(..., "auto")`` times its first steps for it: ``timed_choice``); ``total_steps`` (the run's planned steps: DDP's steps
    to the loss it aims at) plans its H for that run, with its syncs blocking or hidden
    behind inner steps (``overlap_steps``), whichever is faster (:func:`diloco_run_plan`).
    ``codec_s_per_byte`` (seconds per model byte for one compress + decompress, as
    :func:`measure_network` times it; None: :data:`CODEC_S_PER_BYTE`) prices the compressed
    algorithms' encoding.  ``slow_start``: the hosts restart TCP from its initial window after
    idle (``net.ipv4.tcp_slow_start_after_idle=1`` and a congestion control other than BBR:
    ``NetworkMeasurement.tcp_restarts_after_idle``), which a DiLoCo sync, after H silent steps,
    pays in round trips (:func:`~bagua_algos.tuning.diloco_cost.diloco_sync_seconds`).
    Raises ``ValueError`` naming the argument for a non-positive bandwidth, a negative latency,
    compute time or codec cost, or a world size below 1.
    """
    for name, v, ok in (("bandwidth_mbit", bandwidth_mbit, bandwidth_mbit > 0),
                        ("latency_ms", latency_ms, latency_ms >= 0),
                        ("model_bytes", model_bytes, model_bytes >= 0),
                        ("compute_s", compute_s, compute_s >= 0),
                        ("codec_s_per_byte", codec_s_per_byte,
                         codec_s_per_byte is None or codec_s_per_byte >= 0),
                        ("total_steps", total_steps, total_steps is None or (
                            isinstance(total_steps, int) and not isinstance(total_steps, bool)
                            and total_steps >= 1)),
                        ("world_size", world_size, world_size >= 1)):
        if not ok:
            raise ValueError(f"{name} must be "
                             f"{'an int >= 1' if name in ('world_size', 'total_steps') else '>= 0'}"
                             f"{' and > 0' if name == 'bandwidth_mbit' else ''}, got {v!r}")
    nodes = world_size if nodes is None else nodes
    hier = nodes < world_size
    n = max(nodes, 1)
    if n == 1:  # one node: the shaped link is not used, nothing to trade
        return ("gradient_allreduce", {"hierarchical": False},
                "one node: gradient_allreduce (exact)", {"gradient_allreduce": compute_s})
    lat, bps = latency_ms / 1e3, bandwidth_mbit * 1e6 / 8
    ring = 2 * (n - 1) / n * model_bytes
    per_byte = CODEC_S_PER_BYTE if codec_s_per_byte is None else codec_s_per_byte
    codec = 2 * per_byte * model_bytes
    comm = {
        "gradient_allreduce": 2 * (n - 1) * lat + ring / bps,
        "bytegrad": COMPRESSED_ROUNDS * lat + ring / _UINT8 / bps + codec,
        "decentralized": lat + model_bytes / bps,
        "low_precision_decentralized": lat + 2 * model_bytes / _UINT8 / bps + codec,
    }
    h, hide = None, 0
    factor = dict(STEPS_FACTOR)
    if compute_s > 0:    # communicating rarely pays only against a known computation time
        # one 4-bit compressed allreduce of the model (its latency rounds, an eighth of the
        # bytes, the codec) every H steps
        sync = diloco_sync_seconds(bandwidth_mbit, latency_ms, n, model_bytes, codec_s_per_byte,
                                   slow_start=slow_start)
        if total_steps is None:   # open-ended: syncs blocking or hidden, cheaper a step
            h, hide = diloco_open_plan(sync, compute_s)
            per_sync = (DILOCO_SYNC_HOST_S + max(0.0, sync - hide * compute_s)) if hide else sync
            comm["diloco"], factor["diloco"] = per_sync / h, diloco_steps_factor(h)
        else:     # the run's plan: syncs blocking or hidden, whichever is faster
            plan = diloco_run_plan(sync, compute_s, total_steps)
            h, hide = plan.sync_every, plan.overlap_steps
            # the plan's time per DDP step: (compute + comm) x factor = time / total_steps
            factor["diloco"] = (plan.steps + hide) / total_steps
            comm["diloco"] = plan.time_s / (plan.steps + hide) - compute_s
    scores = {a: (compute_s + c) * factor[a] for a, c in comm.items()}
    best = min(scores, key=scores.get)
    if (scores["gradient_allreduce"] <= (TIE if compute_s else TIE_UNKNOWN_COMPUTE) * scores[best]
            or comm["gradient_allreduce"] < NEGLIGIBLE_S):
        best = "gradient_allreduce"
    kwargs = {"hierarchical": hier}
    if best == "diloco":
        kwargs = diloco_kwargs(h, hide, hier, n if hier else world_size)
    if best == "decentralized":
        kwargs["peer_selection_mode"] = "shift_one"
    why = {"gradient_allreduce": "the network is fast enough for the exact allreduce",
           "bytegrad": "bandwidth-bound: 8-bit compressed allreduce sends 4x fewer bytes",
           "decentralized": "latency-bound: one exchange with one peer per step instead of "
                            f"{2 * (n - 1)} rounds",
           "low_precision_decentralized": "latency- and bandwidth-bound: one compressed "
                                          "exchange with two neighbours",
           "diloco": f"communication dominates the step: train locally and average every "
                     f"{h} steps, the outer gradient in 4 bits, outer momentum "
                     f"{DILOCO_OUTER_MOMENTUM} (DiLoCo)"
                     + (f", each sync hidden behind the {hide} inner steps it takes (keep "
                        f"model.synced_state_dict(), the model the ranks agree on)"
                        if hide else "")}[best]
    est = ", ".join(f"{a} {1e3 * s:.0f}" for a, s in sorted(scores.items(), key=lambda x: x[1]))
    return best, kwargs, f"{why} (est. ms/step x steps factor: {est})", scores


def diloco_kwargs(sync_every: int, overlap_steps: int, hierarchical: bool,
                  exchangers: int) -> dict:
    """The DiLoCo the rule picks: ``sync_every`` inner steps, each sync hidden behind
    ``overlap_steps`` of them (0: blocking), outer momentum :data:`DILOCO_OUTER_MOMENTUM`, the
    outer gradient in 4 bits with error feedback, one chunk per rank exchanging it
    (``exchangers``: the node leaders when ``hierarchical``, else every rank)."""
    from bagua_comm.compression import MinMaxUInt4

    kwargs = {"hierarchical": hierarchical, "sync_every": sync_every}
    if overlap_steps:
        kwargs["overlap_steps"] = overlap_steps
    kwargs["outer_momentum"] = DILOCO_OUTER_MOMENTUM
    kwargs["compressor"] = MinMaxUInt4(exchangers, error_feedback=True)
    return kwargs


def _shift(buf: torch.Tensor, out: torch.Tensor, dst: int, src: int, group) -> None:
    s = bc.send(buf, dst, group=group, async_op=True)
    r = bc.recv(out, src, group=group, async_op=True)
    s.wait()
    r.wait()


def _settle(device: torch.device) -> None:
    """Wait for the device's queued work (a timing on a GPU ends when its kernels have)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _codec_seconds(numel: int = _CODEC_PROBE, device: torch.device | None = None) -> float:
    """This rank's best of two MinMaxUInt8 compress + decompress of ``numel`` float32s, on
    ``device`` (the job's: the CUDA kernels for a GPU job)."""
    from bagua_comm.compression import MinMaxUInt8

    device = torch.device("cpu") if device is None else device
    codec = MinMaxUInt8(1)
    x = torch.randn(numel).to(device)
    out = torch.empty_like(x)
    codec.decompress(codec.compress(x), out)     # first use: kernels compiled, buffers made
    best = float("inf")
    for _ in range(2):
        _settle(device)
        t = time.monotonic()
        codec.decompress(codec.compress(x), out)
        _settle(device)
        best = min(best, time.monotonic() - t)
    return best


def _max(values: list[float], group) -> list[float]:
    # one round (each rank's values straight to every peer), not gloo's allreduce: 2(n-1)
    # rounds, ~0.6 s a MAX between 4 hosts at 50 ms one way, three of them a measurement
    return max_small(values, group)


def _job_device(device) -> torch.device:
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be the job's 'cpu' or 'cuda' device (the probes and the "
                         f"codec run there), got {str(device)!r}")
    return device


def _nodes(group) -> tuple[int, int]:
    """(nodes, stride): the group's nodes (``LOCAL_WORLD_SIZE`` processes each, where that
    divides the group) and the rank distance to the same local rank on the next node."""
    local = max(1, bc.get_local_size())
    local = local if group.size % local == 0 else 1
    nodes = max(1, group.size // local)
    return nodes, local if nodes > 1 else 1


def _tiny_rounds(group, dst: int, src: int, device) -> list[float]:
    """Two timed tiny ring-shift exchanges (after one that brings the connections up and pays
    first-use costs): each costs a round trip, 0.1 s apiece at 50 ms one way."""
    tiny, tiny_out = torch.zeros(1, device=device), torch.zeros(1, device=device)
    _shift(tiny, tiny_out, dst, src, group)
    _settle(device)
    rounds = []
    for _ in range(2):
        t = time.monotonic()
        _shift(tiny, tiny_out, dst, src, group)
        _settle(device)
        rounds.append(time.monotonic() - t)
    return rounds


def far_apart(group) -> bool:
    """Whether the group's nodes are so far apart that the exact allreduce's latency alone
    (2(n - 1) tiny exchanges) costs :data:`NEGLIGIBLE_S` or more a step (collective: the
    slowest rank's faster tiny exchange decides, one round to agree; a few ms on a LAN, about
    0.35 s at 50 ms one way)."""
    nodes, stride = _nodes(group)
    if nodes < 2:
        return False
    rank, world = group.rank, group.size
    rounds = _tiny_rounds(group, (rank + stride) % world, (rank - stride) % world,
                          torch.device("cpu"))
    (exchange,) = _max([min(rounds)], group)
    return 2 * (nodes - 1) * exchange >= NEGLIGIBLE_S


def measure_network(group=None, *, time_limit_s: float = 3.0,
                    device: torch.device | str | None = None) -> NetworkMeasurement:
    """Bandwidth and latency (one tiny exchange) between ranks on different nodes (collective).

    Takes at most about ``time_limit_s`` (a probe is only started when the previous one says
    it fits); every rank returns the same numbers.  ``device`` (default CPU) is the job's:
    the probes are tensors there (a CUDA device's go through NCCL) and the codec is timed
    there, each timing ending when the device is done.
    """
    return _measure(group, time_limit_s, device, [])[0]


def _measure(group, time_limit_s, device, agree: list[float]):
    """:func:`measure_network`, and ``agree`` (each rank's own numbers) MAX-reduced in the
    measurement's first collective: the rest of a choice's inputs, at no extra collective."""
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0, got {time_limit_s!r}")
    device = _job_device(device)
    group = bc.get_default_group() if group is None else group
    rank, world = group.rank, group.size
    nodes, stride = _nodes(group)
    dst, src = (rank + stride) % world, (rank - stride) % world
    t0 = time.monotonic()
    if world == 1:
        return NetworkMeasurement(float("inf"), 0.0, 1, 1, 0.0, device=str(device)), agree
    ssai = _slow_start_after_idle()
    restarts = _restarts_after_idle(ssai)
    rounds = _tiny_rounds(group, dst, src, device)
    # Every rank encodes at once, as in training: processes sharing cores pay for it here.
    codec = _codec_seconds(device=device)
    probes, size, first = [], 64 * 1024, True
    while True:
        buf = torch.zeros(size // 4, device=device)
        out = torch.empty_like(buf)
        best = float("inf")
        for _ in range(2):  # the faster of two: the first may pay TCP's window growth
            _settle(device)
            t = time.monotonic()
            _shift(buf, out, dst, src, group)
            _settle(device)
            best = min(best, time.monotonic() - t)
        if first:
            # One MAX for the latency (the faster tiny exchange: delays only add to it), the
            # codec, the first probe and the caller's numbers: each collective costs a
            # latency round (at 50 ms one way ~0.15 s between 4 hosts), as much as a probe
            latency, codec, ssai, restarts, best, spent, *agree = _max(
                [min(rounds), codec, ssai, restarts, best, time.monotonic() - t0, *agree],
                group)
            first = False
        else:
            best, spent = _max([best, time.monotonic() - t0], group)
        probes.append((size, best))
        # long enough to be read: its transfer at least PROBE_READ_S and PROBE_READ_LAT of
        # the latency it is corrected by (at 10 Mbit/s a 256 KiB probe, 0.2 s)
        read = max(PROBE_READ_S, PROBE_READ_LAT * latency)
        if best - latency > read or size >= _MAX_PROBE:
            break
        # the next, 4x this one, only if it fits in what is left of the time limit, twice
        # over.  Not straight to the size this one's rate says is readable: a shaper's burst
        # lets a small probe through at line rate (at 10 Mbit/s a 64 KiB probe looked fast
        # enough that the jump sent 64 MiB, 114 s)
        if spent + 2 * 4.5 * best > time_limit_s:
            break
        size *= 4
    size, t = probes[-1]
    bandwidth = size * 8 / max(t - latency, 1e-6) / 1e6
    return NetworkMeasurement(bandwidth, latency * 1e3, world, nodes, spent, probes,
                              codec / (4 * _CODEC_PROBE), None if ssai < 0 else bool(ssai),
                              None if restarts < 0 else bool(restarts),
                              str(device)), agree


def recommend(model: torch.nn.Module | None = None, *, model_bytes: float | None = None,
              group=None, compute_s: float = 0.0, total_steps: int | None = None,
              time_limit_s: float = 3.0,
              measurement: NetworkMeasurement | None = None) -> Recommendation:
    """Measure the network (unless ``measurement`` is given) and pick the algorithm for it.

    Collective: every rank of ``group`` calls it; every rank gets the same answer: the
    measurement's numbers and ``compute_s``, ``model_bytes`` and ``total_steps`` are reduced
    with MAX (the slowest rank's step) in its first collective, so every rank computes the
    same choice (with ``measurement`` given, rank 0's choice is broadcast).  Logs one line
    (logger ``bagua_algos.recommend``, and stderr on rank 0) with
    what it measured and why it chose.  ``compute_s`` (a step's forward, backward and
    optimizer step, seconds) makes DiLoCo a candidate; ``total_steps`` (the run's planned
    optimizer steps: DDP's steps to the loss it aims at) plans its ``sync_every`` for that run
    and, where hiding each sync behind inner steps is faster, its ``overlap_steps``
    (:func:`diloco_run_plan`; keep ``model.synced_state_dict()`` then).
    ``BAGUA_ALGORITHM=<registry name>`` overrules it: no
    measurement, that algorithm.
    """
    from ..algorithm import Algorithm

    if model is None and model_bytes is None:
        raise ValueError("recommend needs model (a torch.nn.Module) or model_bytes")
    if model_bytes is None:
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                          if p.requires_grad)
    # the job's device: a GPU job is priced by NCCL and the CUDA codec, not gloo and the CPU
    device = _job_device(next((p.device for p in model.parameters()), None)
                         if model is not None else None)
    forced = os.environ.get("BAGUA_ALGORITHM", "").strip()
    if forced and forced != "auto":
        algo = Algorithm.init(forced)
        reason = f"BAGUA_ALGORITHM={forced} overrules the automatic choice"
        return Recommendation(forced, {}, algo, None, reason, {})
    group = bc.get_default_group() if group is None else group
    if measurement is None:
        # The choice's other inputs are agreed in the measurement's first MAX (compute_s:
        # the slowest rank's), so every rank computes the same choice: a broadcast of rank
        # 0's would cost two more collectives (0.3-0.6 s between 4 hosts at 50 ms one way).
        m, (compute_s, model_bytes, steps) = _measure(
            group, time_limit_s, device,
            [compute_s, model_bytes, -1.0 if total_steps is None else total_steps])
        total_steps = None if steps < 0 else int(steps)
    else:
        m = measurement
    name, kwargs, why, scores = choose(m.bandwidth_mbit, m.latency_ms, m.world_size,
                                       model_bytes, compute_s=compute_s, nodes=m.nodes,
                                       total_steps=total_steps,
                                       codec_s_per_byte=m.codec_s_per_byte,
                                       slow_start=bool(m.tcp_restarts_after_idle))
    bucket = bucket_size_for(name, m.bandwidth_mbit, m.latency_ms, m.nodes, model_bytes)
    if measurement is not None:    # given, perhaps not alike on every rank: rank 0's choice
        name, kwargs, bucket = bc.broadcast_object((name, kwargs, bucket), src=0, group=group)
    line = (f"bagua auto: {name}{kwargs} -- {'given' if measurement else 'measured'} "
            f"{m.bandwidth_mbit:.0f} Mbit/s, "
            f"{m.latency_ms:.2f} ms a tiny exchange between {m.nodes} nodes of {m.world_size} ranks"
            f" (on {m.device})"
            + (f", 8-bit codec {1e-9 / m.codec_s_per_byte:.2f} GB/s"
               if m.codec_s_per_byte else "")
            + f" in {m.elapsed_s:.2f}s; {why}"
            + (f"; buckets of {bucket / 2**20:.0f} MiB (each bucket pays the latency)"
               if bucket else "") + slow_start_note(m))
    log.info(line)
    if group.rank == 0:
        print(line, flush=True)
    return Recommendation(name, kwargs, Algorithm.init(name, **kwargs), m, line, scores, bucket)
