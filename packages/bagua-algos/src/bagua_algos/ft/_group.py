"""The process group bagua communicates on under torchft: rebuilt at every quorum change.

torchft's :class:`~torchft.process_group.ProcessGroupGloo` is reconfigurable: the Manager
hands it the quorum's members and it makes a fresh gloo group of them.  bagua needs two gloo
groups of the same ranks (the second carries the multi-phase compressed allreduce on its
worker thread, see ``bagua_comm._backends.gloo``), so the subclass here makes both from the
store torchft gives it, and counts the reconfigurations; :func:`bagua_group` then wraps the
pair in a :class:`bagua_comm.ProcessGroup` of the quorum's size.

Before each gloo group is made, every member checks in at the quorum's store
(:func:`arrive`).  gloo's own rendezvous waits for a missing member for the whole collective
``timeout``; here a member that died (its process gone: its own rendezvous store, whose
address torchft puts in the quorum's handles, refuses connections) is noticed within a
fraction of a second, and the configure fails at once.  A member that is alive but silent
(a frozen process, a host cut off) is still waited for up to ``timeout``.
"""

from __future__ import annotations

import gc
import json
import socket
import time
import weakref
from datetime import timedelta

import torch.distributed as dist

import bagua_comm as bc

# how often a member waiting for the others at the store looks again (the first look
# after _FIRST_POLL_S, each next one twice as late up to _POLL_S: members of a quorum
# arrive within a millisecond or two of each other, and a fixed 10 ms poll cost each
# configure up to 10 ms per group), and how often it checks whether the missing ones are
# still alive (seconds)
_FIRST_POLL_S, _POLL_S, _PROBE_S = 0.0005, 0.01, 0.1


class PeerDied(RuntimeError):
    """A member of the quorum died while its group was being set up."""


def _refuses(address: str) -> bool:
    """Whether nothing listens at ``host:port`` any more (a dead process: the connection is
    refused at once).  A host that does not answer at all counts as alive (unknown)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.2):
            return False
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False


def arrive(store, rank: int, world_size: int, peers: list[str], what: str,
           timeout: timedelta) -> None:
    """Check in at ``store`` as ``rank`` and wait for every member of the quorum; raise
    :class:`PeerDied` as soon as a missing member's own store (``peers[r]``, ``host:port``)
    refuses connections, ``TimeoutError`` after ``timeout``."""
    store.set(f"bagua-arrived/{what}/{rank}", b"1")
    keys = [f"bagua-arrived/{what}/{r}" for r in range(world_size)]
    start = time.monotonic()
    probed, pause = start, _FIRST_POLL_S
    while not store.check(keys):
        now = time.monotonic()
        if now - start > timeout.total_seconds():
            raise TimeoutError(f"bagua_algos.ft: members of the new quorum did not reach the "
                               f"group's set-up within timeout={timeout}")
        if peers and now - probed > _PROBE_S:
            probed = now
            missing = [r for r in range(world_size) if not store.check([keys[r]])]
            dead = [r for r in missing if r < len(peers) and _refuses(peers[r])]
            if dead:
                raise PeerDied(f"bagua_algos.ft: peer rank(s) {dead} of the new quorum died "
                               "while its group was being set up (connection refused)")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S)


def reconfigurable_gloo(timeout: timedelta):
    """A torchft ProcessGroupGloo that also makes bagua's auxiliary group (torchft imported
    here, lazily)."""
    from torchft.process_group import ProcessGroupGloo

    class _BaguaGloo(ProcessGroupGloo):
        generation = 0
        members: tuple[int, int] = (0, 1)        # (rank, size) of the current quorum
        aux = None
        _peers: list[str] = []

        @property
        def configured(self) -> bool:
            """Whether the last configure made a group (torchft drops the old one first)."""
            return self._pg is not None

        def reconfigure(self, opts):
            # each member's own rendezvous store, in rank order: a dead member's refuses
            try:
                self._peers = [json.loads(h)["store"] for h in opts.handles]
            except (TypeError, ValueError, KeyError):
                self._peers = []
            return super().reconfigure(opts)

        def _create_pg(self, store, rank, world_size):
            arrive(store, rank, world_size, self._peers, "main", self._timeout)
            main = super()._create_pg(store, rank, world_size)
            aux_store = dist.PrefixStore("bagua-aux/", store)
            arrive(aux_store, rank, world_size, self._peers, "aux", self._timeout)
            self.aux = super()._create_pg(aux_store, rank, world_size)
            self.members = (rank, world_size)
            self.generation += 1
            return main

        def abort(self, errored: bool = True) -> None:
            super().abort(errored)
            self.aux = None

    return _BaguaGloo(timeout=timeout)


def configure_failure(pg, manager) -> BaseException | None:
    """Why the quorum just formed has no usable group (None: it has one).  torchft drops
    the old gloo group before it makes the new one; when a member dies meanwhile, it
    only records the error and leaves no group at all."""
    if not pg.configured:
        err = manager.errored()
        err = getattr(err, "original_exception", err)
        return err if err is not None else RuntimeError(
            "bagua_algos.ft: the quorum's group is not set up (closed after a failed step)")
    size, quorum = pg.members[1], manager.num_participants()
    if size != quorum:
        # the quorum id did not change, so torchft kept the old group, but the members
        # did: a restarted Lighthouse counts its quorums from 1 again
        return RuntimeError(f"bagua_algos.ft: the group has {size} members, the quorum "
                            f"{quorum} (its id was reused by a restarted Lighthouse)")
    return None


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


def close_connections(group: bc.ProcessGroup | None, pg) -> int | None:
    """Abort: close this replica's gloo connections now, so that a peer waiting in a
    collective with it fails at once ("Connection closed by peer") instead of after the
    collective timeout.  gloo's ``abort()`` leaves its sockets open (checked: the peer
    waited its full timeout); only the gloo group's destruction closes them, so every
    reference to it is dropped here (torchft's wrapper; the bagua group, which
    ``bagua_comm`` keeps in its registry after ``destroy()``) and the garbage that still
    holds it collected (:func:`collect_until_freed`).  Returns the deepest generation
    collected (None: there was no group)."""
    held = [weakref.ref(g) for g in (getattr(pg, "_pg", None), getattr(pg, "aux", None))
            if g is not None]
    release(group)
    if group is not None:
        group.torch_group = group.aux_torch_group = None
    if pg is not None:
        pg.abort(errored=False)
    return collect_until_freed(held) if held else None


def collect_until_freed(held: list) -> int:
    """Collect the young garbage (the failed step's exception, traceback, frames and
    pending works, which can hold a gloo context), and the whole heap only where a group
    in ``held`` (weak references) is still alive after that; returns the generation
    collected last.

    A full collection walks every object of the process (torch's alone some 10^5: 0.13 s
    idle, 0.5 s at load 12 on 2 cores); run after every step voted down, it delayed that
    replica's next quorum request by as much (issue 45)."""
    gc.collect(1)
    if all(ref() is None for ref in held):
        return 1
    gc.collect()
    return 2
