"""A Lightning 2.x strategy that trains with any bagua algorithm.

Install with ``pip install 'bagua-algos[lightning]'``. Importing this module registers
``strategy="bagua"`` with Lightning (``import bagua_algos`` alone never imports Lightning)::

    import lightning as L
    from bagua_algos.lightning import BaguaStrategy

    trainer = L.Trainer(accelerator="cpu", devices=2,
                        strategy=BaguaStrategy(algorithm="bytegrad", hierarchical=False))
    trainer.fit(model, datamodule=data)

``algorithm`` is a registry name (``gradient_allreduce``, ``bytegrad``, ``decentralized``,
``low_precision_decentralized``, ``async``, ``qadam``, or one you registered) and the extra
keyword arguments are that algorithm's constructor arguments; an :class:`~bagua_algos.Algorithm`
instance works too. ``qadam`` needs ``configure_optimizers`` to return one
:class:`~bagua_algos.QAdamOptimizer`.

What the strategy does, beside what Lightning's ``DDPStrategy`` does (launchers, devices,
distributed samplers):

- joins bagua_comm's process group after torch.distributed's (``gloo`` on CPU, ``nccl`` on
  GPU), and sends ``reduce`` (``self.log(..., sync_dist=True)``), ``all_gather``, ``barrier``
  and ``broadcast`` through it;
- creates the optimizers first, then wraps the LightningModule with
  ``with_bagua(module, optimizers, algorithm)`` instead of ``DistributedDataParallel``;
- gradient accumulation (``accumulate_grad_batches``) skips communication with
  ``BaguaModule.no_sync()``;
- checkpoints written by Lightning carry the algorithm's state inside the optimizer state
  (key ``"bagua_algos"``), restored on ``fit(ckpt_path=...)``;
- at teardown (end of ``fit`` or an exception) stops asynchronous averaging on every rank and
  removes bagua's hooks, leaving a plain LightningModule.

It runs under ``torchrun`` (one process per device, ``devices`` = ``--nproc-per-node``) and
with Lightning's own launcher (``devices=N`` in a plain ``python train.py``).

``fault_tolerant=True`` (or a dict of :class:`bagua_algos.ft.FaultTolerant`'s options) trains
restart-free on torchft instead: one process per replica (``devices=1``), each step under the
Lighthouse's quorum, a joining replica healed from a live one (docs/fault-tolerance.md).
torchft is imported only then.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import os
import socket
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch
from torch import Tensor

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
    from lightning.fabric.utilities.optimizer import _optimizers_to_device
    from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as err:      # pragma: no cover - exercised only without Lightning
    raise RuntimeError("bagua_algos.lightning needs Lightning 2.x: "
                       "pip install 'bagua-algos[lightning]' (or pip install 'lightning>=2.1')"
                       ) from err

import bagua_comm as bc

from .algorithm import Algorithm
from .algorithms.q_adam import QAdam, QAdamOptimizer
from .module import BaguaModule, with_bagua

__all__ = ["BaguaStrategy"]

log = logging.getLogger(__name__)

_REDUCE_OPS = {"mean": bc.ReduceOp.AVG, "avg": bc.ReduceOp.AVG, "sum": bc.ReduceOp.SUM,
               "max": bc.ReduceOp.MAX, "min": bc.ReduceOp.MIN, "product": bc.ReduceOp.PRODUCT}


# Lightning's own collectives (logging with sync_dist, barriers, broadcasts) run on a group of
# their own: algorithms communicate from background threads on the default group, and
# collectives issued from two threads on one group could pair up differently on each rank.
_lightning_groups: list = []          # [(default group, Lightning's group)]


def _lightning_group() -> bc.ProcessGroup:
    """This job's group for Lightning's collectives (created once: collective, every rank)."""
    default = bc.get_default_group()
    if not _lightning_groups or _lightning_groups[0][0] is not default:
        _lightning_groups[:] = [(default, bc.new_group())]
    return _lightning_groups[0][1]


def _reduce_op(reduce_op) -> bc.ReduceOp:
    if reduce_op is None:
        return bc.ReduceOp.AVG
    if isinstance(reduce_op, bc.ReduceOp):
        return reduce_op
    name = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op))
    key = name.lower().rsplit(".", 1)[-1]
    if key not in _REDUCE_OPS:
        raise ValueError(f"reduce_op must be one of {sorted(_REDUCE_OPS)} (or a "
                         f"bagua_comm.ReduceOp), got {reduce_op!r}")
    return _REDUCE_OPS[key]


_FT_OPTIONS = ("lighthouse", "replica_id", "min_replicas", "timeout", "quorum_timeout",
               "connect_timeout", "heartbeat_interval", "secret")


def _fault_tolerant_options(fault_tolerant, algorithm) -> dict | None:
    """``fault_tolerant`` checked (before any communication): None, or FaultTolerant's
    keyword arguments with the Lighthouse address and this replica's id filled in."""
    if fault_tolerant is False or fault_tolerant is None:
        return None
    if fault_tolerant is True:
        options = {}
    elif isinstance(fault_tolerant, dict):
        options = dict(fault_tolerant)
        unknown = sorted(set(options) - set(_FT_OPTIONS))
        if unknown:
            raise ValueError(f"fault_tolerant has unknown keys {unknown}; it takes "
                             f"{list(_FT_OPTIONS)}")
    else:
        raise ValueError("fault_tolerant must be a bool or a dict of bagua_algos.ft."
                         f"FaultTolerant options, got {type(fault_tolerant).__name__}")
    name = algorithm if isinstance(algorithm, str) else algorithm.name
    from .ft._replica import _UNSUPPORTED  # no torchft import
    if name in _UNSUPPORTED:
        raise ValueError(f"algorithm {name!r} cannot run with fault_tolerant: "
                         f"{_UNSUPPORTED[name]}")
    options.setdefault("lighthouse", os.environ.get("TORCHFT_LIGHTHOUSE", ""))
    if not options["lighthouse"]:
        raise ValueError("fault_tolerant needs the torchft Lighthouse's address: "
                         "fault_tolerant={'lighthouse': 'http://host:port'} or the "
                         "TORCHFT_LIGHTHOUSE environment variable")
    options.setdefault("replica_id", os.environ.get("REPLICA_GROUP_ID")
                       or socket.gethostname())
    # last: every argument error is named first, with or without torchft installed
    if importlib.util.find_spec("torchft") is None:
        raise RuntimeError("BaguaStrategy(fault_tolerant=...) needs torchft: "
                           "pip install 'bagua-algos[ft]'")
    return options


class BaguaStrategy(DDPStrategy):
    """Lightning strategy for data-parallel training with a bagua algorithm.

    Args:
        algorithm: a registered algorithm name (``"gradient_allreduce"``, ``"bytegrad"``,
            ``"decentralized"``, ``"low_precision_decentralized"``, ``"async"``, ``"qadam"``)
            or an :class:`~bagua_algos.Algorithm` instance (not :class:`~bagua_algos.QAdam`,
            which needs the optimizer Lightning creates: pass ``"qadam"``).
        do_flatten: passed to :func:`~bagua_algos.with_bagua`.
        bucket_size: passed to :func:`~bagua_algos.with_bagua` (bytes; default 10 MiB).
        fault_tolerant: ``True`` or a dict of :class:`bagua_algos.ft.FaultTolerant` options
            (``lighthouse``, ``replica_id``, ``min_replicas``, ``timeout``,
            ``quorum_timeout``, ``connect_timeout``, ``heartbeat_interval``): train
            restart-free on torchft, one process per replica (``devices=1``, each replica
            launched on its own).  ``lighthouse`` defaults to ``$TORCHFT_LIGHTHOUSE``,
            ``replica_id`` to ``$REPLICA_GROUP_ID`` or the host name.  Needs the extra
            ``bagua-algos[ft]``.
        **algorithm_kwargs: the algorithm's constructor arguments, e.g.
            ``BaguaStrategy(algorithm="bytegrad", hierarchical=False)``.

    ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
    ``precision_plugin``, ``process_group_backend``, ``timeout`` and ``start_method`` are
    Lightning's ``DDPStrategy`` arguments (``start_method="spawn"`` uses Lightning's
    multiprocessing launcher).

    Raises:
        RuntimeError: ``fault_tolerant`` without torchft installed.
        ValueError: an unknown algorithm name or arguments its constructor does not take, a
            bad ``fault_tolerant`` (at construction, before any communication); for
            ``"qadam"``, optimizers other than exactly one
            :class:`~bagua_algos.QAdamOptimizer` (at ``fit``, before wrapping).
    """

    strategy_name = "bagua"

    def __init__(self, algorithm: str | Algorithm = "gradient_allreduce", *,
                 do_flatten: bool = True, bucket_size: int | None = None,
                 fault_tolerant: bool | dict = False, accelerator=None,
                 parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None,
                 process_group_backend: str | None = None,
                 timeout: timedelta | None = default_pg_timeout,
                 start_method: str = "popen", **algorithm_kwargs: Any) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin,
                         process_group_backend=process_group_backend, timeout=timeout,
                         start_method=start_method)
        self._algorithm = self._check_algorithm(algorithm, algorithm_kwargs)
        self._ft_options = _fault_tolerant_options(fault_tolerant, self._algorithm)
        self._ft = None             # the FaultTolerant of the current fit
        self._algorithm_kwargs = dict(algorithm_kwargs)
        self._do_flatten = do_flatten
        self._bucket_size = bucket_size

    @staticmethod
    def _check_algorithm(algorithm, kwargs) -> str | Algorithm:
        if isinstance(algorithm, QAdam):
            raise ValueError("algorithm=QAdam(...) cannot be used with Lightning: the optimizer "
                             "comes from configure_optimizers. Pass algorithm='qadam' (and its "
                             "keyword arguments) and return a bagua_algos.QAdamOptimizer from "
                             "configure_optimizers")
        if isinstance(algorithm, Algorithm):
            if kwargs:
                raise ValueError(f"algorithm keyword arguments {sorted(kwargs)} are only taken "
                                 "with an algorithm name; set them on the Algorithm instance")
            return algorithm
        if not isinstance(algorithm, str):
            raise ValueError("algorithm must be a registered name such as 'bytegrad' or a "
                             f"bagua_algos.Algorithm, got {type(algorithm).__name__}")
        if algorithm == "qadam":
            try:
                inspect.signature(QAdam).bind(None, **kwargs)
            except TypeError as err:
                raise ValueError(f"bad arguments for algorithm 'qadam': {err}; its signature is "
                                 f"QAdam{inspect.signature(QAdam)} (the optimizer is the one "
                                 "configure_optimizers returns)") from err
            return algorithm
        Algorithm.init(algorithm, **kwargs)       # validates name and arguments now
        return algorithm

    # -- the algorithm --------------------------------------------------------------------------
    def _make_algorithm(self, optimizers: list[torch.optim.Optimizer]) -> Algorithm:
        if isinstance(self._algorithm, Algorithm):
            return self._algorithm
        if self._algorithm == "qadam":
            if len(optimizers) != 1 or not isinstance(optimizers[0], QAdamOptimizer):
                got = [type(o).__name__ for o in optimizers]
                raise ValueError("algorithm 'qadam' needs configure_optimizers to return exactly "
                                 f"one bagua_algos.QAdamOptimizer, got {got}; e.g. "
                                 "return QAdamOptimizer(self.parameters(), lr=1e-3, "
                                 "warmup_steps=100)")
            return QAdam(optimizers[0], **self._algorithm_kwargs)
        return Algorithm.init(self._algorithm, **self._algorithm_kwargs)

    @property
    def algorithm(self) -> Algorithm | None:
        """The algorithm of the module being trained (``None`` outside ``fit``)."""
        return self.model.algorithm if isinstance(self.model, BaguaModule) else None

    # -- process groups -------------------------------------------------------------------------
    def setup_distributed(self) -> None:
        super().setup_distributed()      # torch.distributed, as DDPStrategy does
        if not bc.is_initialized():
            backend = "nccl" if self.root_device.type == "cuda" else "gloo"
            kwargs = {} if self._timeout is None else {"timeout": self._timeout}
            bc.init_process_group(backend, local_world_size=self.num_processes, **kwargs)
        _lightning_group()

    # -- wrapping -------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        assert self.model is not None
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            # bagua hooks the optimizers, so they must exist before the model is wrapped
            self.setup_optimizers(trainer)
            self.setup_precision_plugin()
            _optimizers_to_device(self.optimizers, self.root_device)
            if self._ft_options is not None:
                self._configure_fault_tolerant(trainer)
            else:
                self.configure_bagua()
        else:
            self._broadcast_module_states()
            self.setup_precision_plugin()

    def configure_bagua(self) -> None:
        """Wrap the LightningModule with :func:`~bagua_algos.with_bagua` (after the
        optimizers exist)."""
        assert isinstance(self.model, pl.LightningModule)
        algorithm = self._make_algorithm(list(self.optimizers))
        self.model = with_bagua(self.model, list(self.optimizers), algorithm,
                                do_flatten=self._do_flatten, bucket_size=self._bucket_size)

    def _configure_fault_tolerant(self, trainer: pl.Trainer) -> None:
        from .ft import FaultTolerant
        if self.world_size != 1 or len(self.optimizers) != 1:
            raise ValueError("fault_tolerant runs one process per replica with one optimizer: "
                             f"got {self.world_size} processes (devices=1 per replica) and "
                             f"{len(self.optimizers)} optimizers")
        schedulers = [c.scheduler for c in self.lr_scheduler_configs]
        if len(schedulers) > 1:
            raise ValueError(f"fault_tolerant carries one LR scheduler, got {len(schedulers)}")
        algorithm = self._make_algorithm(list(self.optimizers))
        self._ft = FaultTolerant(self.lightning_module, self.optimizers[0], algorithm,
                                 scheduler=schedulers[0] if schedulers else None,
                                 do_flatten=self._do_flatten, bucket_size=self._bucket_size,
                                 **self._ft_options)
        self._ft._step_scheduler = False          # Lightning steps it (carried when healing)

    @property
    def fault_tolerant(self):
        """The :class:`bagua_algos.ft.FaultTolerant` of the current fit (``None`` without
        ``fault_tolerant`` or outside ``fit``)."""
        return self._ft

    def optimizer_step(self, optimizer, closure, model=None, **kwargs):
        """With ``fault_tolerant``: the step's quorum (and healing) before the closure's
        forward and backward, then the optimizer steps only if the quorum commits."""
        if self._ft is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        from .ft import Step
        model = model or self.lightning_module
        result = None
        with Step(self._ft) as step:
            self.model = self._ft.model
            result = self.precision_plugin._wrap_closure(model, optimizer, closure)
        if not step.committed:
            log.warning(f"bagua_algos.lightning: step not committed ({step.error}); "
                        "its optimizer step is skipped")
        return result

    def configure_ddp(self) -> None:      # DDPStrategy's name for the same step
        self.configure_bagua()

    def _broadcast_module_states(self) -> None:
        if not bc.is_initialized() or bc.get_world_size() == 1:
            return
        with torch.no_grad():
            for t in list(self.model.parameters()) + list(self.model.buffers()):
                buf = t.detach().contiguous()
                bc.broadcast(buf, 0, group=_lightning_group())
                if buf.data_ptr() != t.data_ptr():
                    t.copy_(buf)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator:
        """No communication in the backward passes inside (gradient accumulation)."""
        if isinstance(self.model, BaguaModule):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def on_exception(self, exception: BaseException) -> None:
        """This rank's training raised: asynchronous averaging tells the other ranks when it
        stops at teardown, so that they raise too instead of training on alone."""
        if isinstance(self.model, BaguaModule) and hasattr(self.model.impl, "mark_failed"):
            self.model.impl.mark_failed()
        super().on_exception(exception)

    def teardown(self) -> None:
        if self._ft is not None:
            ft, self._ft = self._ft, None
            ft.close()
            self.model = self.lightning_module
        if isinstance(self.model, BaguaModule):
            bagua_module = self.model
            try:
                if hasattr(bagua_module.impl, "abort"):
                    bagua_module.abort()         # asynchronous averaging: stop on every rank
            finally:
                bagua_module.detach_algorithm()
                self.model = self.lightning_module
        super().teardown()

    # -- collectives through bagua_comm ---------------------------------------------------------
    def _group(self, group) -> bc.ProcessGroup:
        return group if isinstance(group, bc.ProcessGroup) else _lightning_group()

    def _use_bagua(self, group) -> bool:
        return bc.is_initialized() and (group is None or isinstance(group, bc.ProcessGroup))

    def reduce(self, tensor: Tensor, group: Any | None = None,
               reduce_op: Any | None = "mean") -> Tensor:
        """All-reduce ``tensor`` over the ranks (default: mean) through bagua_comm; a
        non-tensor comes back unchanged. ``group`` may be a ``bagua_comm.ProcessGroup``; a
        torch.distributed group goes through Lightning's own path."""
        if not isinstance(tensor, Tensor):
            return tensor
        if not self._use_bagua(group):
            return super().reduce(tensor, group=group, reduce_op=reduce_op)
        op = _reduce_op(reduce_op)
        out = tensor.detach().clone().contiguous()
        if op == bc.ReduceOp.AVG and not out.is_floating_point():
            out = out.float()
        g = self._group(group)
        if g.size > 1:
            bc.allreduce_inplace(out, op, group=g)
        return out

    def all_gather(self, tensor: Tensor, group: Any | None = None,
                   sync_grads: bool = False) -> Tensor:
        """Gather ``tensor`` from every rank into a ``(world_size, *tensor.shape)`` tensor."""
        if sync_grads or not self._use_bagua(group):
            return super().all_gather(tensor, group=group, sync_grads=sync_grads)
        g = self._group(group)
        send = tensor.detach().contiguous()
        out = torch.empty((g.size, *send.shape), dtype=send.dtype, device=send.device)
        bc.allgather(send.reshape(-1), out.view(-1), group=g)
        return out

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if bc.is_initialized():
            bc.barrier(group=_lightning_group())
        else:
            super().barrier(*args, **kwargs)

    def broadcast(self, obj, src: int = 0):
        if bc.is_initialized():
            return bc.broadcast_object(obj, src, group=_lightning_group())
        return super().broadcast(obj, src)

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        if "bagua" not in strategy_registry:
            strategy_registry.register(
                "bagua", cls, description="bagua algorithms (bagua_algos.lightning.BaguaStrategy)")


BaguaStrategy.register_strategies(StrategyRegistry)
