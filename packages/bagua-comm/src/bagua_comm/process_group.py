"""Process groups: the default group, sub-groups and their hierarchical communicators.

A :class:`ProcessGroup` is an ordered list of global ranks plus the torch.distributed group
that carries its gloo traffic (and, on the ``nccl`` backend, our own NCCL communicator,
created lazily at first use).  Hierarchical communicators (intra-node, and inter-node among
node leaders) are built lazily and collectively: every rank must ask for them in the same
order, which the algorithms do during initialisation.
"""

from __future__ import annotations

import atexit
import gc
import importlib.util
import numbers
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _nccl_loader
from ._backends.gloo import GlooBackend
from ._backends.nccl import NcclBackend
from ._state import DEFAULT_TIMEOUT as _DEFAULT_TIMEOUT
from ._state import state as _state

_BACKENDS = ("auto", "gloo", "nccl")


class ProcessGroup:
    """An ordered set of global ranks that communicate together.

    Its ranks are kept sorted (as torch.distributed keeps them): group rank ``i`` is
    ``ranks[i]``.  Each group has its backend objects, chosen once when it is made: gloo for
    CPU tensors and, on the ``nccl`` backend, NCCL for CUDA tensors (see
    ``bagua_comm._backends``).
    """

    def __init__(self, ranks: list[int], torch_group, backend: str, local_world_size: int,
                 aux_torch_group=None, *, global_rank: int | None = None):
        """``global_rank``: this process's place in ``ranks`` numbering when ``torch_group``
        is not a group of torch's default world (a group reconfigured outside it, such as
        torchft's, see ``bagua_algos.ft``); by default ``torch.distributed.get_rank()``."""
        self.ranks = list(ranks)
        self.torch_group = torch_group
        # A second gloo group of the same ranks for multi-phase operations that run on the
        # group's worker thread (compressed_allreduce), so they never interleave with the
        # primitives the caller issues on ``torch_group`` meanwhile.
        self.aux_torch_group = aux_torch_group if aux_torch_group is not None else torch_group
        self.backend = backend
        self._local_world_size = local_world_size
        self._global_rank = dist.get_rank() if global_rank is None else int(global_rank)
        #: This process's rank inside the group, or -1 if it is not a member.
        self.rank = self.ranks.index(self._global_rank) if self._global_rank in self.ranks else -1
        self._intra = None
        self._inter = None
        self._destroyed = False
        self._id = len(_state.groups)  # same on every rank: groups are created collectively
        self._generation = _state.generation
        _state.groups.append(self)
        self._gloo = GlooBackend(self, torch_group, self.aux_torch_group)
        self._nccl = None
        if backend == "nccl":
            self._nccl = NcclBackend(self)

    def backend_for(self, tensor):
        """The backend that carries ``tensor``: NCCL for a CUDA tensor on the ``nccl``
        backend, gloo otherwise (arguments are validated before this is asked)."""
        return self._nccl if tensor.is_cuda and self._nccl is not None else self._gloo

    # -- membership -------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.ranks)

    def is_member(self) -> bool:
        return self.rank >= 0

    def global_rank(self, group_rank: int) -> int:
        return self.ranks[group_rank]

    # -- hierarchy --------------------------------------------------------------------------
    def _nodes(self) -> dict[int, list[int]]:
        nodes: dict[int, list[int]] = {}
        for r in self.ranks:
            nodes.setdefault(r // self._local_world_size, []).append(r)
        return nodes

    def intra_node_group(self) -> ProcessGroup:
        """Ranks of this group on this process's node (collective on first call)."""
        if self._intra is None:
            mine = None
            for members in self._nodes().values():
                g = _new_subgroup(members, self.backend, self._local_world_size)
                if self._global_rank in members:
                    mine = g
            self._intra = mine
        return self._intra

    def inter_node_group(self) -> ProcessGroup:
        """Node leaders of this group (first member on each node; collective on first call)."""
        if self._inter is None:
            leaders = [members[0] for members in self._nodes().values()]
            self._inter = _new_subgroup(leaders, self.backend, self._local_world_size)
        return self._inter

    def is_node_leader(self) -> bool:
        return self._global_rank in [m[0] for m in self._nodes().values()]

    @property
    def num_nodes(self) -> int:
        return len(self._nodes())

    # -- lifetime -----------------------------------------------------------------------------
    def destroy(self) -> None:
        """Release this group (its worker thread, NCCL communicator and torch groups); any
        later call with it raises.  Not collective.  The default group is released by
        :func:`destroy_process_group` instead."""
        if self is _state.default:
            raise ValueError("the default group is destroyed by destroy_process_group()")
        self._release()
        for tg in {id(self.torch_group): self.torch_group,
                   id(self.aux_torch_group): self.aux_torch_group}.values():
            if self.is_member() and tg is not dist.group.WORLD:
                try:
                    dist.destroy_process_group(tg)
                except (RuntimeError, ValueError, KeyError):
                    pass  # torch already released it

    def _release(self, abort: bool = False) -> None:
        self._destroyed = True
        for be in (self._gloo, self._nccl):
            if be is not None:
                be.close(abort)

    def __repr__(self) -> str:
        return f"ProcessGroup(ranks={self.ranks}, backend={self.backend!r})"


def _gloo_group(ranks):
    """A torch gloo group of ``ranks`` (collective over the world) with the job's timeout."""
    return dist.new_group(ranks=list(ranks), backend="gloo", timeout=_state.timeout,
                          use_local_synchronization=False)


def _new_subgroup(ranks, backend, local_world_size) -> ProcessGroup:
    ranks = sorted(ranks)
    tg = _gloo_group(ranks)
    aux = _gloo_group(ranks)
    return ProcessGroup(list(ranks), tg, backend, local_world_size, aux)


def _torch_timeout(default: timedelta) -> timedelta:
    """The timeout of torch's already initialised default group (``default`` if unknown)."""
    try:
        return dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return default


def _nccl_unavailable() -> str | None:
    """Why the nccl backend cannot work in this process, or None when it can."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        _nccl_loader.load()
    except RuntimeError as err:
        return str(err)
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    return None


def _resolve_backend(backend: str) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    override = os.environ.get("BAGUA_COMM_BACKEND")
    if backend == "auto" and override:
        if override not in ("gloo", "nccl"):
            raise ValueError(f"BAGUA_COMM_BACKEND must be 'gloo' or 'nccl', got {override!r}")
        backend = override
    if backend == "gloo":
        return backend
    reason = _nccl_unavailable()
    if reason is None:
        return "nccl"
    # auto on a machine without CUDA is the normal CPU case: no warning.
    if backend == "nccl" or torch.cuda.is_available():
        warnings.warn(f"bagua_comm: the nccl backend cannot be used ({reason}); falling back "
                      f"to gloo (CPU tensors). For GPUs install: {_nccl_loader.INSTALL_HINT}",
                      RuntimeWarning, stacklevel=3)
    return "gloo"


SHARED_STORE_WARNING = (
    "bagua_comm: torchrun shares its rendezvous TCPStore with the workers and may restart "
    "them (--max-restarts={restarts}). That store outlives every restart: a restarted worker "
    "can read the previous launch's gloo/NCCL addresses ('Gloo connectFullMesh failed ... "
    "Connection refused') and a node that joins later waits for MASTER_ADDR until it times "
    "out. Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (see "
    "docs/elastic.md).")


def _shared_store_hazard(environ=None) -> str | None:
    """The warning for a worker that torchrun may restart on a store that keeps every
    launch's keys (``TORCHELASTIC_USE_AGENT_STORE=True``, ``--max-restarts`` > 0), or None."""
    env = os.environ if environ is None else environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    except ValueError:
        return None
    return SHARED_STORE_WARNING.format(restarts=restarts) if restarts > 0 else None


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer (as torchrun sets "
                         f"it), got {os.environ[name]!r}") from None


def init_process_group(backend: str = "auto", *, store=None, rank=None, world_size=None,
                       local_world_size=None, timeout=_DEFAULT_TIMEOUT) -> None:
    """Join the job: from torchrun's environment, or from an explicit store/rank/world size.

    If ``torch.distributed`` is already initialised (``torch.distributed.init_process_group``
    was called first), bagua_comm adopts its default group: its rank, world size and timeout
    (unless ``timeout`` is given: then bagua_comm's default group is a gloo group of its own
    with that timeout, since torch's keeps the one it was created with), and with
    ``backend="auto"`` its backend (``nccl`` when torch's group has NCCL and bagua's NCCL
    backend can be used, else ``gloo``).

    ``timeout`` bounds every collective of every group bagua_comm creates (the default
    group, :func:`new_group`, the intra-/inter-node groups and the internal ones behind
    :func:`compressed_allreduce`): a peer that stops answering makes the others raise after
    about ``timeout`` instead of hanging.
    """
    if _state.default is not None:
        raise RuntimeError("bagua_comm.init_process_group was already called in this process; "
                           "call destroy_process_group() first")
    if not isinstance(timeout, timedelta) or timeout <= timedelta(0):
        raise ValueError(f"timeout must be a positive datetime.timedelta, got {timeout!r}")
    adopt = dist.is_initialized()
    if adopt and backend == "auto" and not os.environ.get("BAGUA_COMM_BACKEND"):
        backend = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
        if backend == "nccl" and _nccl_unavailable() is not None:
            backend = "gloo"
    backend = _resolve_backend(backend)
    if store is not None and (rank is None or world_size is None):
        raise ValueError("with store=..., pass rank= and world_size= too")
    if store is not None and not isinstance(store, dist.Store):
        raise ValueError(f"store must be a torch.distributed.Store (e.g. TCPStore, FileStore), "
                         f"got {type(store).__name__}")
    for name, v in (("rank", rank), ("world_size", world_size),
                    ("local_world_size", local_world_size)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ValueError(f"{name} must be an int, got {v!r}")
    if adopt:
        rank, world_size = dist.get_rank(), dist.get_world_size()
    rank = _env_int("RANK") if rank is None and "RANK" in os.environ else rank
    world_size = (_env_int("WORLD_SIZE") if world_size is None and "WORLD_SIZE" in os.environ
                  else world_size)
    if (rank is None or world_size is None) and store is None:
        raise RuntimeError("cannot find rank/world size: launch with torchrun, pass "
                           "store=, rank= and world_size=, or call "
                           "torch.distributed.init_process_group() first")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    if local_world_size is None:
        local_world_size = (_env_int("LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in os.environ
                            else world_size)
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"local_world_size must divide world_size={world_size}, "
                         f"got {local_world_size}")
    if store is None and rank == 0 and (hazard := _shared_store_hazard()) is not None:
        warnings.warn(hazard, RuntimeWarning, stacklevel=2)   # one line per job
    own_world = False      # adopted: a gloo group of our own when torch's cannot serve
    if adopt:
        if timeout == _DEFAULT_TIMEOUT:
            timeout = _torch_timeout(timeout)
        elif timeout != _torch_timeout(timeout):
            own_world = True   # torch's group keeps its own timeout: ours gets the one asked
    else:
        kw = {"timeout": timeout, "rank": rank, "world_size": world_size}
        if store is not None:
            kw["store"] = store
        dist.init_process_group("gloo", **kw)
        _state.owns_torch_pg = True
    if backend == "nccl":
        local_rank = rank % local_world_size
        _state.cuda_device = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(_state.cuda_device)
    _state.generation += 1
    atexit.unregister(_release_at_exit)
    atexit.register(_release_at_exit)
    _state.backend = backend
    _state.local_world_size = local_world_size
    _state.timeout = timeout
    ranks = list(range(world_size))
    # torch's default group carries CPU tensors only if it has gloo (a user's NCCL-only
    # group does not): then the default group gets a gloo group of its own.
    world = (dist.group.WORLD if not adopt or (_has_gloo() and not own_world)
             else _gloo_group(ranks))
    _state.default = ProcessGroup(ranks, world, backend, local_world_size, _gloo_group(ranks))


def _has_gloo() -> bool:
    try:
        return "gloo" in str(dist.get_backend_config())
    except (AttributeError, RuntimeError):
        return "gloo" in str(dist.get_backend())


def is_initialized() -> bool:
    return _state.default is not None


def destroy_process_group() -> None:
    if _state.default is None:
        return
    for g in _state.groups:
        g._release()
    if _state.owns_torch_pg and dist.is_initialized():
        dist.destroy_process_group()
    _state.reset()
    gc.collect()  # torch's groups go now, not at interpreter exit (see GlooBackend.close)


def _release_at_exit() -> None:
    """A script that never called destroy_process_group(): release our groups before the
    interpreter tears down (gloo aborts the process if its groups die during finalisation)."""
    try:
        destroy_process_group()
    except Exception:  # nothing to report to at exit
        pass


def _default() -> ProcessGroup:
    if _state.default is None:
        raise RuntimeError("bagua_comm is not initialised: call bagua_comm.init_process_group() "
                           "first")
    return _state.default


def get_default_group() -> ProcessGroup:
    return _default()


def get_rank() -> int:
    return _default().rank


def get_world_size() -> int:
    return _default().size


def get_local_size() -> int:
    _default()
    return _state.local_world_size


def get_local_rank() -> int:
    return get_rank() % get_local_size()


def get_node_rank() -> int:
    return get_rank() // get_local_size()


def get_backend() -> str:
    _default()
    return _state.backend


def new_group(ranks=None) -> ProcessGroup:
    """A new group of the given global ranks (collective: every rank calls, same order).

    Its group ranks follow the global ranks' order (``ranks`` is sorted).  Its collectives
    time out after ``init_process_group``'s ``timeout``."""
    world = get_world_size()
    if ranks is not None:
        if isinstance(ranks, (str, bytes)) or not hasattr(ranks, "__iter__"):
            raise ValueError(f"ranks must be None or an iterable of int ranks, got {ranks!r}")
        ranks = list(ranks)
        odd = [r for r in ranks if isinstance(r, bool) or not isinstance(r, numbers.Integral)]
        if odd:
            raise ValueError(f"ranks must be ints (global ranks), got {odd!r} in {ranks!r}")
        ranks = [int(r) for r in ranks]
    else:
        ranks = list(range(world))
    if not ranks:
        raise ValueError("ranks must not be empty")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct, got {ranks}")
    bad = [r for r in ranks if not 0 <= r < world]
    if bad:
        raise ValueError(f"ranks must be in [0, world_size={world}), got {bad}")
    return _new_subgroup(ranks, _state.backend, _state.local_world_size)
