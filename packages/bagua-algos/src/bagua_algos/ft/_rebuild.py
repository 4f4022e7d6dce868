"""The rebuild of a fault-tolerant replica's group and module after a membership change.

The bagua group is made anew on the quorum's gloo groups; its members prove the job's
secret and agree on an up-to-date source and on what is already equal (``_source``); each
takes the source's state where it is behind, the module is wrapped anew, and the sampler
dealt over the new ranks.  What only depends on the state a failed step left (the digests
the agreement compares, the re-deal) is computed while the Lighthouse waits (``_ahead``).
"""

from __future__ import annotations

import contextlib
import logging

from .._engine.checkpoint import STATE_KEY as _STATE_KEY
from ..module import BaguaModule, _wrap, _wrap_configuration
from ._ahead import Ahead
from ._errors import is_comm_error
from ._group import bagua_group, release
from ._source import agree, digest, share, state_digest

logger = logging.getLogger("bagua_algos.ft")


@contextlib.contextmanager
def _quiet(name: str):
    """with_bagua's warning about an optimizer that already holds state is about checkpoints
    loaded too early; here the state is the live one, on purpose."""
    log = logging.getLogger(name)
    old = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(old)


def _detach(model: BaguaModule) -> None:
    """Detach the algorithm; an exchange of it that failed (a peer died in it) is dropped
    with it instead of raising again."""
    try:
        model.detach_algorithm()
    except Exception as err:
        if not is_comm_error(err):
            raise
        logger.info(f"bagua_algos.ft: a failed exchange dropped with the old group ({err})")


def _shared_view(impl, own: dict, data_state: dict | None) -> tuple | None:
    """What a rebuild's source broadcasts, as this replica would load it: its algorithm
    state without the saving rank (the foreign load reads the impl's ``foreign_view`` of
    it) and the sampler's committed position (None: only its saving rank can use it)."""
    seen = impl.foreign_view(own.get("impl"))
    if seen is None:
        return None
    return {k: v for k, v in own.items() if k not in ("rank", "impl")}, seen, data_state


def _view_digest(view: tuple | None) -> bytes:
    """:func:`digest` of a :func:`_shared_view` (empty, counted unequal, for None)."""
    return b"" if view is None else digest(*view)


def _digests(module, optimizer, algorithm, wrap: dict, size: int) -> tuple[bytes, bytes]:
    """This replica's digests of its wrap configuration and of its state (parameters,
    buffers, optimizer), for the source choice's allgather (empty alone).

    torch's Optimizer.load_state_dict (here when healing, in a rebuild's share on the
    replicas behind) adds keys to the optimizer's defaults ("differentiable") through
    __setstate__; a replica whose optimizer was never loaded lacks them, and QAdam's
    description in the wrap's configuration includes its optimizer: every replica takes
    torch's own normalisation before the digests and each wrap."""
    optimizer.__setstate__(optimizer.__getstate__())
    if size <= 1:
        return b"", b""
    return (digest(_wrap_configuration(module, [optimizer], algorithm, **wrap)),
            state_digest(module, optimizer, _STATE_KEY))


def rebuild(ft, healed: dict | None) -> None:
    """Wrap the model anew on the current quorum's group, carrying every piece of state
    (from the healthy peer when healing; the shared state from an up-to-date replica,
    never from one whose heal failed, see ``_source``)."""
    rank, size = ft._pg.members
    ahead, ft._ahead = ft._ahead, None
    if healed is not None or ahead is None or ahead[0] is not ft._pending:
        ahead = None                     # the state it digested is not the one here
    view = None                          # unknown: the source's state is broadcast
    if ft._pending is not None:          # a rebuild that failed: its state, not a fresh one
        own, data_state = ft._pending
        if healed is None:
            view = ft._pending_view
    else:
        own = ft.model.bagua_state_dict() if ft.model is not None else None
        data_state = ft.data.state_dict() if ft.data is not None else None
        if own is not None and healed is None:
            view = _shared_view(ft.model.impl, own, data_state)
    own_rank = own.get("rank", -1) if isinstance(own, dict) else -1
    if ft.model is not None:
        _detach(ft.model)
        ft.model = None
    release(ft._group)
    ft._group = None
    if healed is not None:
        ft._module.load_state_dict(healed["model"])
        opt_state = dict(healed["optimizer"])
        own = opt_state.pop(_STATE_KEY, None)
        ft.optimizer.load_state_dict(opt_state)
        if ft.scheduler is not None:
            ft.scheduler.load_state_dict(healed["scheduler"])
        data_state = healed["data"]
    ft._pending, ft._pending_view = (own, data_state), None
    digests = None
    if ahead is not None:
        try:
            digests = ahead[1].result()  # started a heartbeat timeout ago
        except Exception as err:
            logger.info(f"bagua_algos.ft: the digests computed ahead failed ({err})")
    if digests is None:
        digests = (*_digests(ft._module, ft.optimizer, ft.algorithm, ft._wrap,
                             size), _view_digest(view))
    ft._group = bagua_group(ft._pg)
    survivor = healed is None and ft._generation > 0
    # this replica's rank in the group before (the sampler's plan's; without one, the
    # rank its algorithm state was saved at): -1 for a replica that joins
    old_rank = -1 if not survivor else (
        ft.data.sampler.rank if ft.data is not None else own_rank)
    agreement = agree(
        ft._group, ft.manager.current_step(), ft.manager.errored() is None, old_rank,
        *digests[:2], secret=ft._secret,   # proven by every member first, then agreed
        shared=digests[2], own_rank=own_rank)
    src, agreed, old_ranks, same_config, same_state, same_shared, own_ranks = agreement
    # every member a survivor holding what the source would send: nothing to broadcast
    # (a few ms of the stall); its state is loaded as the source's would be
    quiet = agreed and same_state and same_shared and own_ranks[src] >= 0
    if survivor and ft.data is not None:   # every replica goes on from the source's
        data_state = ft.data.give_back(old_ranks[src])
    if quiet and own is not None and (own.get("world_size"), own.get("rank")) != (size, rank):
        own = {**own, "rank": own_ranks[src]}     # where the source's would be loaded
    shared = None if quiet else share(ft._group, src, ft._module, {
        "optimizer": None if agreed else ft.optimizer.state_dict(),
        "scheduler": None if agreed or ft.scheduler is None
        else ft.scheduler.state_dict(),
        "data": None if agreed else data_state, "bagua": own,
        "owed": None if data_state is None else data_state.get("owed")},
        params=not same_state) if size > 1 else None
    if shared is not None and rank != src:
        if not agreed:                 # this replica is behind: the source's state
            ft.optimizer.load_state_dict(shared["optimizer"])
            if ft.scheduler is not None:
                ft.scheduler.load_state_dict(shared["scheduler"])
            data_state = shared["data"]
        if not agreed or own is None or (own.get("world_size"), own.get("rank")) != (
                size, rank):
            own = shared["bagua"]
    ft.optimizer.__setstate__(ft.optimizer.__getstate__())
    # every replica holds the source's parameters and (all states equal, or not all up to
    # date) optimizer state: the wrap's check and broadcast would move equal values
    in_sync = same_config and (same_state or not agreed)
    with _quiet("bagua_algos"):
        ft.model = _wrap(ft._module, [ft.optimizer], ft.algorithm,
                         group=ft._group, in_sync=in_sync, **ft._wrap)
    if own is not None:
        ft.model.load_bagua_state_dict(own)
    if ft.data is not None and data_state is not None:
        # the samples owed as the source counts them (a joiner's state predates them)
        if shared is not None and shared["owed"] is not None:
            data_state = {**data_state, "owed": shared["owed"]}
        ft.data.rebind(size, rank, data_state)
    ft._pending = None
    ft._generation = ft._pg.generation
    ft._dirty = False
    logger.info(f"bagua_algos.ft: training at {size} replicas (this one: rank {rank})"
                f"{', healed from a peer' if healed is not None else ''}"
                f"{'' if agreed else f', shared state from rank {src}'}")


def digest_ahead(ft) -> None:
    """Start the next rebuild's digests (the wrap configuration; the parameters,
    buffers and optimizer state: a second at 1 GB of state; what the source would send)
    on a thread: nothing they cover changes until that rebuild (see ``_ahead``)."""
    module, optimizer, algorithm, wrap = ft._module, ft.optimizer, ft.algorithm, ft._wrap
    view = ft._pending_view
    ft._ahead = (ft._pending, Ahead(
        lambda: (*_digests(module, optimizer, algorithm, wrap, 2), _view_digest(view)),
        "bagua-ft-digests"))


def keep_pending(ft, own: dict) -> None:
    """Keep the algorithm's state ``own`` and the committed position for the next
    rebuild, with their :func:`_shared_view` while the algorithm is still attached."""
    data_state = None if ft.data is None else ft.data.state_dict()
    ft._pending = (own, data_state)
    ft._pending_view = _shared_view(ft.model.impl, own, data_state)
