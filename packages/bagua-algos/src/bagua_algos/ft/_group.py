"""The process group bagua communicates on under torchft: rebuilt at every quorum change.

torchft's :class:`~torchft.process_group.ProcessGroupGloo` is reconfigurable: the Manager
hands it the quorum's members and it makes a fresh gloo group of them.  bagua needs two gloo
groups of the same ranks (the second carries the multi-phase compressed allreduce on its
worker thread, see ``bagua_comm._backends.gloo``), so the subclass here makes both from the
store torchft gives it, and counts the reconfigurations; :func:`bagua_group` then wraps the
pair in a :class:`bagua_comm.ProcessGroup` of the quorum's size.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

import bagua_comm as bc


def reconfigurable_gloo(timeout: timedelta):
    """A torchft ProcessGroupGloo that also makes bagua's auxiliary group (torchft imported
    here, lazily)."""
    from torchft.process_group import ProcessGroupGloo

    class _BaguaGloo(ProcessGroupGloo):
        generation = 0
        members: tuple[int, int] = (0, 1)        # (rank, size) of the current quorum
        aux = None

        def _create_pg(self, store, rank, world_size):
            main = super()._create_pg(store, rank, world_size)
            self.aux = super()._create_pg(dist.PrefixStore("bagua-aux/", store), rank,
                                          world_size)
            self.members = (rank, world_size)
            self.generation += 1
            return main

        def abort(self, errored: bool = True) -> None:
            super().abort(errored)
            self.aux = None

    return _BaguaGloo(timeout=timeout)


def bagua_group(pg) -> bc.ProcessGroup:
    """A bagua group over ``pg``'s current gloo groups (one process per replica group: group
    rank = replica rank, one node per rank)."""
    rank, size = pg.members
    return bc.ProcessGroup(list(range(size)), pg.parent, "gloo", 1, pg.aux, global_rank=rank)


def release(group: bc.ProcessGroup | None) -> None:
    """Stop a replaced group's worker thread (its torch groups belong to torchft, which
    torch.distributed does not know: destroy() leaves them alone)."""
    if group is not None:
        group.destroy()
