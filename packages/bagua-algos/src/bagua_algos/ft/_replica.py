"""``FaultTolerant``: with_bagua under torchft's per-step quorum (one process per replica).

Each step starts with a quorum from the torchft Lighthouse (:meth:`FaultTolerant.step`'s
``__enter__``).  When the quorum's members changed, torchft reconfigures its gloo group and
this class rebuilds the bagua group and the :class:`~bagua_algos.BaguaModule` on it: the
survivors go on at the new size.  A replica that joins (restarted or new) gets, before its
first step, the live state of a healthy peer through torchft's checkpoint transport:
parameters, optimizer state (which carries the algorithm's state), LR scheduler and the
sampler's committed position.  A step in which communication failed is not committed by
anyone who saw the failure (torchft's ``should_commit``), and its samples go back to the
epoch's pool.
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

import bagua_comm as bc

from .._engine.checkpoint import STATE_KEY as _STATE_KEY
from .._engine.consistency import configuration
from ..algorithm import Algorithm
from ..module import BaguaModule
from ._data import CommittedBatches
from ._errors import forget_frames, is_comm_error
from ._group import close_connections, configure_failure, reconfigurable_gloo
from ._lighthouse import no_quorum_error
from ._rebuild import _detach, digest_ahead, keep_pending, rebuild
from ._speculate import alive, communicates_in_step, drain, restore, snapshot, synced_fragments
from ._transport import SecretRefused, job_secret, make_transport

logger = logging.getLogger("bagua_algos.ft")
_UNSUPPORTED = {"async": "it communicates in a background thread, outside the steps a "
                         "quorum commits"}


def _positive_timedelta(name, value) -> None:
    if not isinstance(value, timedelta) or value <= timedelta(0):
        raise ValueError(f"{name} must be a positive datetime.timedelta, got {value!r}")


# quorums tried in one step when members keep failing while the group is set up
_REBUILD_ATTEMPTS = 5
# the spacing of torchft's resent quorum requests when the Lighthouse does not answer (it
# was restarted: the request in flight was lost with it), see _quorum_retries
_RESEND_MS = 250


def _quorum_retries(quorum_timeout: timedelta) -> int:
    """How many times torchft's manager resends a quorum request the Lighthouse lost.  It
    waits ``quorum_timeout / (retries + 1)`` before each resend (and reconnects), so this
    spaces them ``_RESEND_MS`` apart over ``quorum_timeout``; without retries (torchft's
    default) a request lost with a restarted Lighthouse is never resent and the step fails
    after ``quorum_timeout``."""
    return max(1, int(quorum_timeout.total_seconds() * 1000) // _RESEND_MS - 1)


def _model_meta(module: torch.nn.Module, optimizer, algorithm: Algorithm, wrap: dict) -> dict:
    """What a joiner must share with the running job, field by field: with_bagua's
    same-on-every-rank description (parameter names, shapes, dtypes; the algorithm and its
    settings; the optimizer; the wrap's settings)."""
    # torch's normalisation of the optimizer's defaults, as before each wrap (see _rebuild)
    optimizer.__setstate__(optimizer.__getstate__())
    return {"algorithm": algorithm.name,
            "shapes": {n: tuple(p.shape) for n, p in module.named_parameters()},
            "dtypes": {n: str(t.dtype).replace("torch.", "")
                       for n, t in [*module.named_parameters(), *module.named_buffers()]},
            "configuration": configuration(module, [optimizer], algorithm, wrap)}


def _refusal(mine: dict, theirs) -> str | None:
    """Why this replica cannot join a job described by ``theirs`` (None: it can)."""
    theirs = theirs if isinstance(theirs, dict) else {}
    if theirs == mine:
        return None
    if theirs.get("shapes") != mine["shapes"]:
        return (f"parameter shapes differ ({mine['algorithm']} vs {theirs.get('algorithm')}; "
                "parameter shapes differ)")
    dtypes = theirs.get("dtypes") or {}
    if dtypes != mine["dtypes"]:
        return "dtypes differ: " + ", ".join(
            f"{n} is {dtypes.get(n)} in the job, {d} here"
            for n, d in mine["dtypes"].items() if dtypes.get(n) != d)
    fields = [f"  {k}: the job has {theirs.get('configuration', {}).get(k, '<missing>')}, "
              f"this replica {v}" for k, v in mine["configuration"].items()
              if theirs.get("configuration", {}).get(k) != v]
    return "its configuration differs:\n" + "\n".join(fields or ["  (another bagua version)"])


class Step:
    """One training step (see :meth:`FaultTolerant.step`): ``batch`` (with ``data=``),
    ``committed`` after the block, ``error`` the communication failure it absorbed."""

    def __init__(self, ft: FaultTolerant):
        self.ft = ft
        self.batch = None
        self.committed = False
        self.error: BaseException | None = None

    def __enter__(self) -> Step:
        self.ft._start(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None and not is_comm_error(exc):
            self.ft._abandon()
            # the peers wait in this step's collectives for a replica that left it
            self.ft._leave_group()
            return False                       # a bug in the step: raise it
        if exc is not None:
            forget_frames(exc)
            self.error = exc
            self.ft.manager.report_error(exc)
        self.committed = self.ft._finish()
        return True


class FaultTolerant:
    """Train ``model`` with ``algorithm`` on a changing set of replicas, restart-free.

    One process per replica group (a host), each running this; a torchft Lighthouse at
    ``lighthouse`` (``http://host:port``) forms the quorum of each step.  ``scheduler``: an
    LR scheduler stepped once per committed step.  ``data=(dataset, sampler, batch_size)``
    with a ``bagua_data.LoadBalancingDistributedSampler``: each step's ``batch`` comes from
    the committed position, re-dealt over the quorum when it changes.

    Use::

        ft = FaultTolerant(model, optimizer, ByteGrad(), lighthouse=..., replica_id="host1",
                           scheduler=sched, data=(dataset, sampler, 32))
        while ft.committed_steps < total:
            optimizer.zero_grad()
            with ft.step() as step:
                x, y = step.batch
                loss_fn(ft.model(x), y).backward()

    ``timeout`` bounds every collective and the state transfer; ``heartbeat_interval`` is
    how often this replica tells the Lighthouse it is alive (the Lighthouse's
    ``heartbeat_timeout_ms`` decides how soon a silent replica is dropped).
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 algorithm: Algorithm, *, lighthouse: str, replica_id: str,
                 min_replicas: int = 1, scheduler=None, data=None,
                 timeout: timedelta = timedelta(seconds=10),
                 quorum_timeout: timedelta = timedelta(seconds=60),
                 connect_timeout: timedelta = timedelta(seconds=10),
                 heartbeat_interval: timedelta = timedelta(milliseconds=100),
                 bucket_size: int | None = None, do_flatten: bool = True,
                 secret: str | bytes | None = None):
        if not isinstance(model, torch.nn.Module) or isinstance(model, BaguaModule):
            raise ValueError("model must be a plain torch.nn.Module (FaultTolerant wraps it "
                             f"with with_bagua itself), got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ValueError(f"optimizer must be a torch.optim.Optimizer, got "
                             f"{type(optimizer).__name__}")
        if not isinstance(algorithm, Algorithm):
            raise ValueError(f"algorithm must be a bagua_algos.Algorithm, got "
                             f"{type(algorithm).__name__}")
        if algorithm.name in _UNSUPPORTED:
            raise ValueError(f"algorithm {algorithm.name!r} cannot run under FaultTolerant: "
                             f"{_UNSUPPORTED[algorithm.name]}")
        if getattr(algorithm, "peer_selection_mode", None) == "shift_one":
            raise ValueError("algorithm 'decentralized' with peer_selection_mode='shift_one' "
                             "cannot run under FaultTolerant: it pairs ranks, so it needs an even "
                             "number of replicas, and a quorum that loses or gains one has an odd "
                             "number; use peer_selection_mode='all'")
        if not isinstance(lighthouse, str) or not lighthouse:
            raise ValueError(f"lighthouse must be the Lighthouse's address "
                             f"('http://host:port'), got {lighthouse!r}")
        if not isinstance(replica_id, str) or not replica_id:
            raise ValueError(f"replica_id must be a non-empty str, got {replica_id!r}")
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 1:
            raise ValueError(f"min_replicas must be an int >= 1, got {min_replicas!r}")
        for name, value in (("timeout", timeout), ("quorum_timeout", quorum_timeout),
                            ("connect_timeout", connect_timeout),
                            ("heartbeat_interval", heartbeat_interval)):
            _positive_timedelta(name, value)
        self._secret = job_secret(secret)
        if bc.is_initialized() and bc.get_world_size() > 1:
            raise ValueError("FaultTolerant runs one process per replica group: this process "
                             f"belongs to a bagua_comm world of {bc.get_world_size()}")
        if data is not None and not isinstance(data, CommittedBatches):
            if not isinstance(data, tuple) or len(data) != 3:
                raise ValueError("data must be (dataset, sampler, batch_size), got "
                                 f"{type(data).__name__}")
            data = CommittedBatches(*data)
        try:
            from torchft import Manager
        except ImportError as err:
            raise RuntimeError("bagua_algos.ft needs torchft: pip install 'bagua-algos[ft]' "
                               f"({err})") from None

        self._module, self.optimizer, self.algorithm = model, optimizer, algorithm
        self._lighthouse, self._quorum_timeout = lighthouse, quorum_timeout
        self._min_replicas = min_replicas
        self.scheduler, self.data = scheduler, data
        # False where the training loop steps the scheduler itself (Lightning): it is still
        # carried to a joining replica
        self._step_scheduler = True
        self._wrap = {"bucket_size": bucket_size, "do_flatten": do_flatten}
        self._meta = _model_meta(model, optimizer, algorithm, {**self._wrap, "autotune": None})
        self.model: BaguaModule | None = None
        self._group: bc.ProcessGroup | None = None
        self._generation = 0
        self._healed: dict | None = None
        self._dirty = False
        self._step0 = 0
        # (algorithm state, data state) of a rebuild that failed half-way, for the next one
        self._pending: tuple | None = None
        # _shared_view of _pending's state, taken while its algorithm was still attached
        self._pending_view: tuple | None = None
        # (the _pending it is of, the digests the next rebuild compares, on a thread)
        self._ahead: tuple | None = None
        #: seconds each heal took on this replica (state received and applied)
        self.heal_times: list[float] = []
        if not bc.is_initialized():
            bc.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        self._pg = reconfigurable_gloo(timeout)
        try:
            self.manager = Manager(
                pg=self._pg, load_state_dict=lambda state: self._receive(state),
                state_dict=lambda: self._send(),
                min_replica_size=min_replicas, use_async_quorum=False, timeout=timeout,
                quorum_timeout=quorum_timeout, connect_timeout=connect_timeout, rank=0,
                world_size=1, store_addr="127.0.0.1", store_port=self._store.port,
                lighthouse_addr=lighthouse, replica_id=replica_id,
                heartbeat_interval=heartbeat_interval, init_sync=True,
                quorum_retries=_quorum_retries(quorum_timeout),
                checkpoint_transport=make_transport(self._secret, timeout))
        except Exception as err:   # torchft's Rust client raises plain Exceptions
            raise RuntimeError(f"cannot join the torchft Lighthouse at {lighthouse!r} within "
                               f"connect_timeout={connect_timeout}: {err}") from err

    # -- state transfer (torchft calls these) ---------------------------------------------------
    def _send(self) -> dict:
        """The live state a joining replica copies (torchft calls this between steps)."""
        return self._live_state()

    def _live_state(self) -> dict:
        optimizer = self.optimizer.state_dict()    # with the algorithm's state, when wrapped
        if self._pending is not None and self._pending[0] is not None:
            # a rebuild failed half-way (the module is detached, its optimizer hook gone), or
            # a step voted down was undone: the algorithm's state kept for the next rebuild
            # is the live one
            optimizer[_STATE_KEY] = self._pending[0]
        return {"meta": self._meta,
                "model": self._module.state_dict(),
                "optimizer": optimizer,
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
                "data": None if self.data is None else self.data.state_dict()}

    def _receive(self, state: dict) -> None:
        why = _refusal(self._meta, state.get("meta"))
        if why is not None:
            # raised here, on the joiner alone, before it takes part in any collective: the
            # running replicas drop it at their next quorum
            raise ValueError("this replica cannot join the running job: " + why)
        self._healed = state

    # -- steps ------------------------------------------------------------------------------
    @property
    def committed_steps(self) -> int:
        """Steps the job has committed (the same on every replica of the quorum)."""
        return self.manager.current_step()

    @property
    def world_size(self) -> int:
        return self._pg.members[1]

    def step(self) -> Step:
        """A context manager around one step's forward and backward: quorum (and healing)
        on entry; on exit the optimizer and scheduler step if the quorum commits."""
        return Step(self)

    def _start(self, step: Step) -> None:
        if self.model is not None and self.model.engine.busy:
            self._dirty = True       # a step abandoned mid-backward
        import time
        for attempt in range(1, _REBUILD_ATTEMPTS + 1):
            t0 = time.perf_counter()
            self._quorum()
            self._check_secret()
            healed, self._healed = self._healed, None
            failed = configure_failure(self._pg, self.manager)
            if failed is None:
                if not (healed is not None or self._dirty or self.model is None
                        or self._pg.generation != self._generation):
                    break
                try:
                    self._rebuild(healed)
                except Exception as err:
                    # A member of the new quorum failed while the group was being set up
                    # (it died, or it was refused: another model)
                    if not is_comm_error(err) or attempt == _REBUILD_ATTEMPTS:
                        raise
                    failed = err
                    forget_frames(err)
                else:
                    if healed is not None:
                        self.heal_times.append(time.perf_counter() - t0)
                    break
            elif attempt == _REBUILD_ATTEMPTS:
                raise RuntimeError(f"bagua_algos.ft: the quorum's group could not be set up "
                                   f"in {attempt} quorums in a row") from failed
            # vote this step down and take the next quorum, which no longer holds the
            # member that failed, instead of failing a healthy replica
            logger.warning(f"bagua_algos.ft: a peer failed while the quorum formed ({failed}); "
                           "this step is not committed, trying the next quorum")
            step.error = failed
            self.manager.report_error(failed)
            self.manager.should_commit()
            self._abandon()
            self._leave_group()
        self._step0 = self.model.step
        if self.data is not None:
            step.batch = self.data.next()

    def _quorum(self) -> None:
        """A quorum of at least ``min_replicas`` replicas: a smaller one (the Lighthouse's
        own minimum is lower) is voted down without a forward and asked again, for
        ``quorum_timeout`` at most, then this raises instead of running steps that can
        never commit."""
        import time
        deadline = None
        while True:
            try:
                self.manager.start_quorum()
            except Exception as err:        # torchft's Rust client: plain Exceptions
                if isinstance(err, TimeoutError) or "timeout" in str(err).lower():
                    # torchft's Manager cannot go on (its failed quorum is re-raised by every
                    # later call) and its threads would keep the process from exiting
                    lost = no_quorum_error(self._lighthouse, self._quorum_timeout, err)
                    self.close()
                    raise lost from err
                raise
            alive = self.manager.num_participants()
            if alive >= self._min_replicas:
                return
            now = time.monotonic()
            deadline = deadline or now + self._quorum_timeout.total_seconds()
            if now > deadline:
                self.close()
                raise RuntimeError(
                    f"bagua_algos.ft: the quorum from the Lighthouse at {self._lighthouse!r} "
                    f"held {alive} replica(s), fewer than min_replicas={self._min_replicas}, "
                    f"for quorum_timeout={self._quorum_timeout}: too few replicas alive (start "
                    "more, or lower min_replicas)")
            self.manager.should_commit()        # the empty step, voted down (too few)
            time.sleep(0.05)

    def _check_secret(self) -> None:
        """Leave the job when the running replicas refused this one's heal request for its
        secret (a misconfigured replica: it would stall the others at every quorum)."""
        err = self.manager.errored()
        refused = getattr(err, "original_exception", err)
        if isinstance(refused, SecretRefused):
            self.close()
            raise refused

    def _rebuild(self, healed: dict | None) -> None:
        rebuild(self, healed)

    def _finish(self) -> bool:
        saved = None
        if self.model is not None and communicates_in_step(self.model.impl):
            # the step's exchange runs before the vote; a step voted down is undone
            saved = snapshot(self._module, self.optimizer)
            # every replica runs the step's exchanges, one that will vote the step down (its
            # heal failed) included: its peers' collectives need it
            try:
                self.optimizer.step()
                drain(self.model.impl)
                # a step without an exchange (a local step) still learns here whether a
                # peer died in it: its samples are then dealt again, not lost
                alive(self._group)
            except Exception as err:
                if not is_comm_error(err):
                    self._undo(saved)
                    raise
                forget_frames(err)
                logger.warning(f"bagua_algos.ft: a peer failed in the step's exchange "
                               f"({err}); this step is not committed")
                self.manager.report_error(err)
        committed = self.manager.should_commit()
        if committed:
            if saved is None:
                self.optimizer.step()
            if self.scheduler is not None and self._step_scheduler:
                self.scheduler.step()
            if self.data is not None:
                self.data.commit()
                self.data.mark_synced(*synced_fragments(self.model))
        elif saved is not None:
            self._undo(saved)
        else:
            self._abandon()
        if not committed:
            grouped = self.world_size > 1
            if self.data is not None and grouped:
                # the next quorum most likely lacks the peer that failed: its re-deal is
                # computed while the Lighthouse waits for that peer's heartbeat to run out
                self.data.prepare(self.world_size - 1)
            self._leave_group()
            if grouped:
                digest_ahead(self)
        return committed

    def _undo(self, saved: tuple) -> None:
        """A speculative optimizer step voted down: the state before it, the algorithm's
        kept for the rebuild at the next step."""
        own = restore(self._module, self.optimizer, saved, _STATE_KEY)
        self._abandon()
        keep_pending(self, own)

    def _abandon(self) -> None:
        if self.data is not None:
            self.data.rollback()
        if self.model is not None:
            self.model.step = self._step0
        self._dirty = True

    def _leave_group(self) -> None:
        """After a step this replica voted down: close its connections, so that a peer still
        blocked in a collective with it (gloo's send waits for the receiver; with a member
        dead, the others give up one by one) fails at once instead of after the collective
        timeout.  The next quorum, which every failed vote makes torchft reconfigure,
        rebuilds the group."""
        if self.world_size > 1:
            self._abort()

    def _abort(self) -> None:
        """Leave the group now (a step abandoned for a bug, or :meth:`close`): the module
        detached (the algorithm's state kept for the next rebuild, as after a failed one)
        and this replica's connections closed, so that a peer waiting in a collective with
        it fails at once instead of after the collective timeout."""
        if self.model is not None:
            if self._pending is None:
                keep_pending(self, self.model.bagua_state_dict())
            _detach(self.model)
            self.model = None
        close_connections(self._group, self._pg)
        self._group = None
        self._dirty = True

    # -- state, for checks and checkpoints ----------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a joining replica copies, plus the algorithm's state as its own entry."""
        state = self._live_state()
        state["bagua"] = state["optimizer"].get(_STATE_KEY)
        state["step"] = self.committed_steps
        return state

    def close(self) -> None:
        """Leave the job: close this replica's connections (a peer in a collective with it
        fails at once) and stop its torchft servers (not collective)."""
        self._abort()
        self.manager.shutdown(wait=False)
