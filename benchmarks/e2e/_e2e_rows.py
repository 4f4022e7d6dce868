"""What each row of the main job trains with: torch DDP (plain, ``fp16_compress_hook``,
PowerSGD, and ``ddp_bytegrad_hook``: DDP with bagua's MinMaxUInt8 compressed allreduce as its
communication hook) and the bagua algorithms, with the modes that trade bytes differently as rows of
their own.

A row is ``(kind, registry name, keyword arguments, note)``.  ``kind`` is ``"torch"`` for DDP
and its communication hooks (``HOOK_ROWS``: DDP with a bagua_algos hook, whose bytes
bagua_comm's traffic counter accounts), ``"bagua"`` for ``bagua_algos.Algorithm.init(name, **kwargs)``.
Algorithms that have a ``hierarchical`` mode run it whenever a host has more than one
process (``procs_per_host > 1``), and flat otherwise (one process per node has nothing to
average inside a node); ``bytegrad_flat`` is ByteGrad forced flat, beside it.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

TORCH_ROWS = ("ddp", "ddp_fp16", "ddp_powersgd")
HOOK_ROWS = ("ddp_bytegrad_hook",)     # torch DDP + bagua_algos.ddp_hooks
HIERARCHICAL = ("gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
                "topk")
# "alone": every rank trains on its own shard, no communication at all (no wrapper, zero
# bytes): the floor every algorithm must beat, and what picks the headline target (the first
# of DDP's losses it cannot reach)
ALONE = "alone"
DEFAULT_ROWS = ["ddp", ALONE, "ddp_fp16", "ddp_powersgd", "ddp_bytegrad_hook",
                "gradient_allreduce", "bytegrad",
                "bytegrad_flat", "decentralized", "decentralized_shift_one",
                "low_precision_decentralized", "async", "qadam", "local_sgd", "diloco", "diloco_u4",
                "diloco_u4_m05", "ft_diloco",
                "topk", "low_rank", "low_rank_r32_u8", "auto"]
# --quick's rows (nox -s demo): the DDP peers, bagua's every-step compressed rows, the periodic
# ones (torchft's DiLoCo beside ours) and the automatic choice; every row with --algorithms
QUICK_ROWS = ["ddp", ALONE, "ddp_powersgd", "ddp_bytegrad_hook", "bytegrad", "topk",
              "low_rank_r32_u8", "local_sgd", "diloco_u4_m05", "diloco_u4_m05_hide", "ft_diloco",
              "auto", "auto_wrap"]
# "auto": recommend(model, compute_s=<a step's compute>, total_steps=<DDP's steps to the
# deepest target>), then with_bagua with its algorithm and bucket size, as docs/tradeoff.md
# tells a user to for a run of known length (network measured at the start, its time
# counted); the trade-off map scores the choice by this row
# "auto_wrap": with_bagua(model, [opt], "auto") as a user writes it, told nothing: the network
# measured at the wrap, then the first steps trained locally and timed before the rule
# chooses (bagua_algos.tuning.timed_choice); its time includes both
AUTO_WRAP = "auto_wrap"
AUTO_ROWS = ("auto", AUTO_WRAP)
# Communicate every sync_every steps (sync_every_for); ft_diloco (torchft's DiLoCo, the peer:
# benchmarks/e2e/_e2e_ft.py) runs with the sync_every the diloco row chose.
SYNC_ROWS = ("local_sgd", "diloco", "diloco_u8", "diloco_u4", "ft_diloco", "diloco_warm",
             "diloco_stream", "diloco_m05", "diloco_u4_m05", "diloco_u4_m05_stream",
             "diloco_u4_m05_hide")
# Rows whose syncs overlap inner steps (overlap_steps = hidden_sync_steps): the ranks never
# hold one model, so their held-out loss is the anchor's (the synced model every rank agrees
# on, the one a user evaluates and keeps), read when each sync lands
HIDING_ROWS = ("diloco_u4_m05_hide",)
# Rows whose ranks hold different models (most of the time): their held-out loss is the mean
# over the ranks' models, labelled as such in the table and the JSON (``loss_over``)
SEPARATE_MODELS = (ALONE, "decentralized", "decentralized_shift_one",
                   "low_precision_decentralized", "async", *SYNC_ROWS)
# A compressed DiLoCo row's outer-gradient bytes per sync as a fraction of float32's: the rule
# gives it its own H (a 4-bit sync costs 1/8 of the allreduce, so it can sync ~8x as often)
OUTER_BYTES = {"diloco_u8": 1 / 4, "diloco_u4": 1 / 8, "diloco_u4_m05": 1 / 8,
               "diloco_u4_m05_stream": 1 / 8, "diloco_u4_m05_hide": 1 / 8}
# The full run's sweep of DiLoCo's H around the rule's choice (rows "diloco@x0.5" ...; a row
# "diloco@64" fixes H=64): DiLoCo's H is a knob the user picks, so the main job shows how time
# to DDP's loss and bytes move with it instead of one point.
SYNC_SWEEP = ("x0.5", "x2", "x4")


def split_row(row: str) -> tuple[str, str | None]:
    """``"diloco@x2"`` -> ``("diloco", "x2")``; ``"diloco@64"`` -> ``("diloco", "64")``; a
    row without ``@`` -> ``(row, None)``.  Only the sync rows take an ``@H``."""
    base, sep, h = row.partition("@")
    if not sep:
        return row, None
    if base not in SYNC_ROWS or not h:
        raise ValueError(f"row {row!r}: only {', '.join(SYNC_ROWS)} take '@H' or '@xK' (H: "
                         f"sync_every; xK: K times the rule's choice)")
    try:
        value = float(h[1:]) if h.startswith("x") else int(h)
    except ValueError:
        raise ValueError(f"row {row!r}: '@{h}' is neither an integer H nor 'xK'") from None
    if value <= 0:
        raise ValueError(f"row {row!r}: H (or the factor) must be > 0")
    return base, h


def sync_every_of_row(row: str, chosen: int) -> int:
    """The H a sync row runs: its ``@H``, ``@xK`` x ``chosen`` (the rule's H), else ``chosen``."""
    _base, h = split_row(row)
    if h is None:
        return chosen
    if h.startswith("x"):
        return max(2, round(float(h[1:]) * chosen))
    return int(h)
_VARIANTS = {  # row name: (registry name, fixed keyword arguments)
    "bytegrad_flat": ("bytegrad", {"hierarchical": False}),
    "decentralized": ("decentralized", {"peer_selection_mode": "all"}),
    "decentralized_shift_one": ("decentralized", {"peer_selection_mode": "shift_one"}),
    # TopK, values min-max quantised (8-bit; 4-bit for a "_u4" row).  "topk" is the main
    # job's row: 0.5%, the density whose bytes stay under the PowerSGD hook's on 4 hosts
    # (an allgather grows with the rank count); the others are opt-in, for comparison.
    "topk": ("topk", {"density": 0.005}),
    "topk_u4": ("topk", {"density": 0.005}),
    "topk_1pct": ("topk", {"density": 0.01}),
    "topk_1pct_u4": ("topk", {"density": 0.01}),
    "low_rank": ("low_rank", {"rank": 2}),         # as ddp_powersgd's default rank
    # opt-in: more bytes per step (rank r sends r/2 times rank 2's), less loss lost per step
    "low_rank_r8": ("low_rank", {"rank": 8}),
    "low_rank_r16": ("low_rank", {"rank": 16}),
    # rank 32 with its factors min-max quantised to 8 bits (8 chunks per rank): about rank
    # 8's float32 bytes at rank 32's loss per step; a default row (on 4 hosts at 100 Mbit/s
    # it reached DDP's loss 1.41x sooner than ByteGrad), r64 opt-in
    "low_rank_r32_u8": ("low_rank", {"rank": 32}),
    "low_rank_r64_u8": ("low_rank", {"rank": 64}),
    # DiLoCo with its outer gradient min-max quantised (8- or 4-bit) with error feedback, as
    # INTELLECT-1 (int8) and Streaming DiLoCo (4-bit) send it, each at the H the rule gives
    # its bytes (OUTER_BYTES); diloco_u4 is a default row, diloco_u8 opt-in
    "diloco_u8": ("diloco", {}),
    "diloco_u4": ("diloco", {}),
    # DiLoCo as the anchors run it, one change per row (issue 44): the outer momentum ramped
    # over the first 8 outer steps; Streaming DiLoCo (2 fragments, each sync applied one
    # inner step after it started, so it overlaps that step); the outer momentum 0.5
    # instead of 0.9 (at the main job's small H, 0.9 carried the outer steps past the loss
    # alone reaches: docs/algorithms/diloco.md); and the 4-bit outer gradient with it
    # (diloco_u4_m05, a default row: DiLoCo as recommend runs it)
    "diloco_warm": ("diloco", {"outer_warmup": 8}),
    "diloco_stream": ("diloco", {"fragments": 2, "overlap_steps": 1}),
    "diloco_m05": ("diloco", {"outer_momentum": 0.5}),
    "diloco_u4_m05": ("diloco", {"outer_momentum": 0.5}),
    "diloco_u4_m05_stream": ("diloco", {"outer_momentum": 0.5, "fragments": 2,
                                        "overlap_steps": 1}),
    # recommend's DiLoCo whose every sync overlaps the inner steps its transfer takes
    # (hidden_sync_steps; one fragment): the sync's time hidden for that many steps' delay
    "diloco_u4_m05_hide": ("diloco", {"outer_momentum": 0.5}),
}


def powersgd_start(warmup: int) -> int:
    """The uncompressed warm-up steps of ``ddp_powersgd`` (its ``start_powerSGD_iter``: at
    least 2, torch's minimum with error feedback) and of ``low_rank`` (``start_step``), the
    same for both so that their losses compare: without it LowRank's loss after 30 steps was
    2.97 against the hook's 2.18 (2 ranks, small), with it 2.19
    (``benchmarks/studies/low_rank_vs_powersgd.py``)."""
    return max(2, warmup)


def default_rows(procs_per_host: int) -> list[str]:
    """The rows of a run: ``bytegrad_flat`` only where there is a hierarchy to compare."""
    return [r for r in DEFAULT_ROWS if procs_per_host > 1 or r != "bytegrad_flat"]


def bagua_spec(row: str, procs_per_host: int, *, warmup: int = 2,
               world: int = 1) -> tuple[str, dict]:
    """``(registry name, kwargs)`` of a bagua row (``warmup``: the job's warm-up steps;
    ``world``: the ranks, whose count a compressed allreduce's chunks must divide)."""
    row = split_row(row)[0]
    name, kwargs = _VARIANTS.get(row, (row, {}))
    kwargs = dict(kwargs)
    if name == "low_rank":
        kwargs["start_step"] = powersgd_start(warmup)
        if row.endswith("_u8"):
            from bagua_comm.compression import MinMaxUInt8

            kwargs["compressor"] = MinMaxUInt8(8 * world)
    if name == "topk":    # values min-max quantised, 4-bit where the row name says so
        from bagua_comm.compression import MinMaxUInt4, MinMaxUInt8

        kwargs["compressor"] = MinMaxUInt4(1) if row.endswith("_u4") else MinMaxUInt8(1)
    if row.startswith("diloco_u"):
        from bagua_comm.compression import MinMaxUInt4, MinMaxUInt8

        kwargs["compressor"] = (MinMaxUInt4 if row.startswith("diloco_u4") else MinMaxUInt8)(
            world, error_feedback=True)
    if name in HIERARCHICAL and "hierarchical" not in kwargs:
        kwargs["hierarchical"] = procs_per_host > 1
    return name, kwargs


def _sync_seconds(ddp_step_s: float, compute_s: float, bytes_scale: float,
                  network: dict | None) -> float:
    """One sync of a DiLoCo row: what DDP's allreduce costs in a step (``ddp_step_s -
    compute_s``: the same bytes, once; ``bytes_scale`` of it for a compressed outer gradient),
    or, for a 4-bit row on a known link, as ``recommend`` prices it."""
    from bagua_algos.tuning.recommend import DILOCO_OUTER_BYTES, diloco_sync_seconds

    if network is not None and bytes_scale == DILOCO_OUTER_BYTES:
        return diloco_sync_seconds(**network)
    return max(0.0, ddp_step_s - compute_s) * bytes_scale


def sync_every_for(ddp_step_s: float, compute_s: float, total_steps: int | None, *,
                   overhead: float = 0.1, bytes_scale: float = 1.0,
                   network: dict | None = None, overlap: bool = False) -> int:
    """``sync_every`` for the workload, by the rule ``recommend`` uses
    (``bagua_algos.tuning.recommend.diloco_sync_every``): one sync costs about what DDP's allreduce
    costs in a step (``ddp_step_s - compute_s``: the same bytes, once; ``bytes_scale`` of it
    for a compressed outer gradient).  ``total_steps``: the run's length as a user plans it,
    DDP's steps to the deepest target (the ``auto`` row tells ``recommend`` the same); the
    rule plans the H that reaches that loss soonest (``diloco_plan``).  None: the length is
    unknown, and H is the one whose sync adds ``overhead`` (10%) to its compute.
    ``network`` (``diloco_sync_seconds``' arguments: the cell's shaped link): a 4-bit row's
    sync is priced as ``recommend`` prices it, since a compressed allreduce's latency does not
    shrink with its bytes (at 50 ms, DDP's allreduce / 8 said 0.125 s a sync; it took 0.37).
    ``overlap``: the row hides each sync behind inner steps (``diloco_plan(overlap=True)``:
    H at least the steps hidden + 1, only the last sync's paid)."""
    from bagua_algos.tuning.recommend import diloco_plan, diloco_sync_every

    comm = _sync_seconds(ddp_step_s, compute_s, bytes_scale, network)
    if overlap and total_steps is not None:
        return diloco_plan(comm, compute_s, total_steps, overlap=True).sync_every
    return diloco_sync_every(comm, compute_s, overhead, total_steps=total_steps)


def hidden_sync_steps(sync_every: int, compute_s: float, network: dict | None, *,
                      ddp_step_s: float = 0.0, bytes_scale: float = 1 / 8) -> int:
    """Inner steps a DiLoCo sync overlaps (``overlap_steps``) so that its transfer hides
    behind them: the sync as :func:`sync_every_for` prices it (on a known link the 4-bit
    sync as ``recommend`` does, slow start included where the hosts restart TCP after
    idle), over ``compute_s``.  At most H - 1; 1 where neither the link nor DDP's step is
    known."""
    from bagua_algos.tuning.diloco_cost import overlap_steps_for

    if (not network and not ddp_step_s) or compute_s <= 0:
        return 1
    sync_s = _sync_seconds(ddp_step_s, compute_s, bytes_scale, network)
    return overlap_steps_for(sync_s, compute_s, sync_every)


def jsonable(kwargs: dict) -> dict:
    """An algorithm's keyword arguments for the JSON report: objects (a compressor) by repr."""
    return {k: v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)
            for k, v in kwargs.items()}


def mode_note(row: str, procs_per_host: int, *, powersgd_rank: int = 2, warmup: int = 2,
              async_interval_ms: float | None = None, sync_every: int | None = None,
              overlap_steps: int | None = None) -> str:
    """The short mode description printed in the table's ``mode`` column."""
    if row == "ddp":
        return "built-in"
    if row == ALONE:
        return "no communication"
    if row == AUTO_WRAP:
        return "with_bagua(..., 'auto'), steps timed"
    if row == "ddp_fp16":
        return "fp16 hook"
    if row == "ddp_powersgd":
        return f"rank {powersgd_rank}, EF, warm, start {powersgd_start(warmup)}"
    if row == "ddp_bytegrad_hook":
        return "8-bit hook, flat"
    if row == "async":
        return f"every {async_interval_ms:g}ms"
    if split_row(row)[0] == "ft_diloco":
        return f"torchft, H={sync_every}" if sync_every else "torchft"
    if split_row(row)[0] in SYNC_ROWS and sync_every:
        base = split_row(row)[0]
        kw = _VARIANTS.get(base, ("", {}))[1]
        bits = (", 4-bit EF" if base.startswith("diloco_u4") else
                ", 8-bit EF" if base.startswith("diloco_u8") else "")
        extra = "".join(part for key, part in (
            ("outer_momentum", f", mu {kw.get('outer_momentum')}"),
            ("outer_warmup", f", warm-up {kw.get('outer_warmup')}"),
            ("fragments", f", {kw.get('fragments')} frag. overlap {kw.get('overlap_steps')}"))
            if key in kw)
        if overlap_steps:
            extra += f", overlap {overlap_steps} (anchor's loss)"
        return f"H={sync_every}{bits}{extra}"
    if row.startswith("topk"):
        density = _VARIANTS[row][1]["density"]
        return (f"{density:.1%}, {4 if row.endswith('_u4') else 8}-bit values, EF, "
                f"{'hier' if procs_per_host > 1 else 'flat'}")
    if row.startswith("low_rank"):
        bits = ", 8-bit factors" if row.endswith("_u8") else ""
        return (f"rank {_VARIANTS[row][1]['rank']}{bits}, EF, warm, "
                f"start {powersgd_start(warmup)}")
    _name, kwargs = bagua_spec(row, procs_per_host)
    parts = []
    if "peer_selection_mode" in kwargs:
        parts.append(kwargs["peer_selection_mode"])
    if "hierarchical" in kwargs:
        parts.append("hier" if kwargs["hierarchical"] else "flat")
    return ", ".join(parts)


# -- byte accounting for torch's hooks ------------------------------------------------------
class AllReduceCounter:
    """Counts the bytes DDP's hooks hand to ``torch.distributed.all_reduce`` on the default
    group, as a ring allreduce sends them (``2 (n-1)/n`` of the tensor per rank).

    ``fp16_compress_hook`` and ``powerSGD_hook`` call ``dist.all_reduce`` (the module
    attribute) with the default group, so wrapping it sees their traffic; the harness's own
    collectives pass their own group and are not counted.  Plain DDP (no hook: its C++
    allreduce) is counted by :meth:`add_gradients`.
    """

    def __init__(self):
        self.bytes = 0.0
        self._lock = threading.Lock()
        self._orig = dist.all_reduce

        def counting(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
            if group is None or group is dist.group.WORLD:
                n = dist.get_world_size()
                with self._lock:
                    self.bytes += 2 * (n - 1) / n * tensor.numel() * tensor.element_size()
            return self._orig(tensor, op=op, group=group, async_op=async_op)

        dist.all_reduce = counting

    def add_gradients(self, model) -> None:
        """One step of plain DDP: every gradient, ring-allreduced."""
        n = dist.get_world_size()
        self.bytes += 2 * (n - 1) / n * sum(p.numel() * p.element_size()
                                            for p in model.parameters() if p.requires_grad)


def serialized(hook):
    """Run ``hook``'s whole chain of collectives for one bucket before the next bucket's.

    ``powerSGD_hook`` allreduces P, then allreduces Q from a callback of P's future.  On gloo
    that callback runs on gloo's thread when P's allreduce finishes, while autograd keeps
    launching the next buckets' P allreduces on the same process group: the ranks then issue
    collectives in different orders, and gloo fails with "Received data size doesn't match
    expected size" (or hangs).  Starting bucket ``b + 1``'s chain from the callback that ends
    bucket ``b``'s makes the order the same on every rank (P0 Q0 P1 Q1 ...).
    """
    last: list = [None]

    def wrapped(state, bucket):
        out: torch.futures.Future = torch.futures.Future()

        def start(_prev=None):
            try:
                fut = hook(state, bucket)
            except Exception as err:  # surfaced to DDP through the returned future
                out.set_exception(err)
                return

            def finish(f):
                try:
                    out.set_result(f.value())
                except Exception as err:
                    out.set_exception(err)

            fut.add_done_callback(finish)

        prev, last[0] = last[0], out
        if prev is None:
            start()
        else:
            prev.add_done_callback(start)  # runs inline when prev is already done
        return out

    return wrapped


def build_torch(row: str, model, *, powersgd_rank: int = 2,
                powersgd_start: int = 2, bucket_cap_mb: float | None = None):
    """torch DDP for ``row`` with its communication hook (``ddp_bytegrad_hook``: bagua's
    ``compressed_allreduce_hook`` with its default state, MinMaxUInt8 with one chunk per rank,
    no error feedback: ``bytegrad_flat``'s compression inside DDP)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel

    kw = {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    ddp = DistributedDataParallel(model, **kw)
    if row == "ddp":
        pass  # DDP as users run it: its built-in C++ allreduce
    elif row == "ddp_fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif row == "ddp_powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=powersgd_rank,
                                   start_powerSGD_iter=powersgd_start, use_error_feedback=True,
                                   warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, serialized(psgd.powerSGD_hook))
    elif row == "ddp_bytegrad_hook":
        from bagua_algos.ddp_hooks import CompressionHookState, compressed_allreduce_hook

        ddp.register_comm_hook(CompressionHookState(), compressed_allreduce_hook)
    else:
        raise ValueError(f"not a torch row: {row!r}")
    return ddp
