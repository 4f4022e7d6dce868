"""Which failures a fault-tolerant step absorbs, and dropping what a failed one holds."""

from __future__ import annotations

import traceback

import torch.distributed as dist


def is_comm_error(err: BaseException) -> bool:
    """A failure of the group (a peer gone or silent), as opposed to a bug in the step."""
    if isinstance(err, dist.DistError):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(
        s in text for s in ("gloo", "connection", "timed out", "broken pipe", "peer"))


def forget_frames(err: BaseException | None) -> None:
    """``err`` (and its causes) without the local variables of the frames it was raised
    through: those hold the gloo groups of the collective that failed, which must go for
    their connections to close (see ``_group.close_connections``).  File and line stay."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__
