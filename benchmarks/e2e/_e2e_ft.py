"""The main job's ``ft_diloco`` row: torchft's own DiLoCo (``torchft.local_sgd.DiLoCo``) as
the peer of our ``diloco`` row, driven on gloo as torchft runs it.

Every rank of the job is one torchft replica group of one process (its own ``TCPStore`` and
``Manager``); rank 0 also runs the ``LighthouseServer`` the replicas join (min_replicas = the
job's world size, so every sync's quorum holds every rank, as our row's allreduce does).  The
inner optimizer is the job's Adam, the outer one ``torch.optim.SGD`` with our ``DiLoCo``'s
default outer settings (outer_lr 0.7, Nesterov momentum 0.9), and ``sync_every`` is the one
our ``diloco`` row ran with.  Bytes: torchft's ``Manager.allreduce`` is wrapped to record a
ring allreduce's ``2 (n-1)/n`` of each tensor in ``bagua_comm.traffic`` (the job's
"accounted" bytes), as our rows record theirs.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist


class Unavailable(Exception):
    """torchft cannot be imported here (the row is reported unavailable, with the reason)."""


def _local_ip(peer: str) -> str:
    """This host's address on the route to ``peer`` (loopback, or the testbed's link)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))
        return s.getsockname()[0]


class _Socket:
    """``socket`` with ``gethostname()`` answering this host's address."""

    def __init__(self, ip: str):
        self.ip = ip

    def __getattr__(self, name):
        return getattr(socket, name)

    def gethostname(self) -> str:
        return self.ip


def _advertise(ip: str) -> None:
    """torchft's ProcessGroupGloo advertises its rendezvous store as ``socket.gethostname()``;
    inside the testbed's network namespaces that name does not resolve (the peers retry
    "(vm, port) cannot be retrieved" until the timeout), so it advertises ``ip`` instead."""
    import torchft.process_group as tpg

    tpg.socket = _Socket(ip)


class FtDiLoCoRow:
    """torchft's DiLoCo around ``model`` and ``inner``; :meth:`close` when the row ends."""

    def __init__(self, model: torch.nn.Module, inner: torch.optim.Optimizer, sync_every: int,
                 harness, *, timeout_s: float = 300.0):
        try:
            from torchft import Manager, ProcessGroupGloo
            from torchft.coordination import LighthouseServer
            from torchft.local_sgd import DiLoCo as TorchftDiLoCo
        except ImportError as err:      # the same environment on every rank: all skip
            raise Unavailable(f"torchft does not import ({err}); pip install torchft-nightly"
                              ) from err
        from bagua_algos import DiLoCo
        from bagua_comm import traffic

        rank, world = dist.get_rank(), dist.get_world_size()
        master = os.environ.get("MASTER_ADDR", "127.0.0.1")
        ip = _local_ip(master)
        _advertise(ip)
        self.lighthouse = None
        if rank == 0:
            self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=world,
                                               join_timeout_ms=60_000)
        port = [self.lighthouse.address().rsplit(":", 1)[1] if rank == 0 else None]
        dist.broadcast_object_list(port, src=0, group=harness)
        self.store = dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=lambda _s: None,
            state_dict=lambda: {}, min_replica_size=world, use_async_quorum=False,
            timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0,
            world_size=1, store_addr=ip, store_port=self.store.port,
            lighthouse_addr=f"http://{master}:{port[0]}", replica_id=f"e2e-rank{rank}",
            hostname=ip, init_sync=False)   # same seed everywhere: nothing to heal at step 0
        real = self.manager.allreduce

        def counted(tensor, *args, **kwargs):
            n = max(1, self.manager.num_participants())
            traffic.record("ft_allreduce",
                           2 * (n - 1) / n * tensor.numel() * tensor.element_size())
            return real(tensor, *args, **kwargs)

        self.manager.allreduce = counted
        d = DiLoCo()
        self.outer = torch.optim.SGD(model.parameters(), lr=d.outer_lr,
                                     momentum=d.outer_momentum, nesterov=d.nesterov)
        self.diloco = TorchftDiLoCo(self.manager, [model], inner, self.outer,
                                    sync_every=sync_every)
        self.diloco.__enter__()         # hooks on the inner optimizer's step
        #: inner steps completed (warm-up in), counted after torchft's hook has synced, as
        #: bagua's DiLoCo counts its own (``impl.steps``): the worker reads rows at syncs by it
        self.steps = 0
        self._counting = inner.register_step_post_hook(self._stepped)

    def _stepped(self, *_args) -> None:
        self.steps += 1

    def close(self) -> None:
        self._counting.remove()
        self.diloco.__exit__(None, None, None)
        self.manager.shutdown(wait=False)
        if self.lighthouse is not None:
            self.lighthouse.shutdown()
