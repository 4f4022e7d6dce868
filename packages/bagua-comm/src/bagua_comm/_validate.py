"""Argument checks shared by the primitives: they run before any communication starts.

Every failure is a ValueError (bad argument) or RuntimeError (not initialised) that names the
argument and the rule, raised on the calling rank only; nothing has been sent yet, so no peer
is left waiting and the group stays usable.
"""

from __future__ import annotations

import operator

import torch

from .ops import ReduceOp, as_op
from .process_group import ProcessGroup, _state, get_default_group

_NCCL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8,
                torch.uint8, torch.int32, torch.int64)
# What every backend carries (bool too on gloo, for model buffers: data movement only).
_DTYPES = frozenset(_NCCL_DTYPES + (torch.bool,))
_DTYPE_RULE = ("bagua_comm carries float32, float16, bfloat16, float64, int8, uint8, int32 and "
               "int64 tensors")
_BITWISE = (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


def group(group) -> ProcessGroup:
    if group is None:
        g = _state.default  # the default group: always a member, never destroyed
        return g if g is not None else get_default_group()  # (which raises)
    g = group
    if not isinstance(g, ProcessGroup):
        raise ValueError(f"group must be a bagua_comm.ProcessGroup or None, got {type(g).__name__}")
    if g._destroyed:
        raise RuntimeError(f"group {g.ranks} was destroyed (group.destroy() or "
                           "destroy_process_group()): make a new one with new_group()")
    if not g.is_member():
        raise ValueError(f"this rank is not a member of group {g.ranks}")
    return g


def tensor(name: str, t, g: ProcessGroup) -> None:
    """A contiguous torch tensor on a device the group can use."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first)")
    if t.dtype not in _DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}: {_DTYPE_RULE}; cast it first "
                         "(e.g. .to(torch.int32) or .float())")
    if t.is_cpu:
        return
    if t.device.type != "cuda":
        raise ValueError(f"{name} is on {t.device}: bagua_comm takes CPU tensors (gloo) or CUDA "
                         "tensors (nccl)")
    if g.backend != "nccl":
        raise ValueError(f"{name} is on {t.device}, but the group's backend is {g.backend!r}, "
                         "which needs CPU tensors (init_process_group(backend='nccl') for GPUs)")
    if t.dtype not in _NCCL_DTYPES:
        raise ValueError(f"{name} has dtype {t.dtype}, which NCCL does not carry; use one of "
                         "float32, float16, bfloat16, float64, int8, uint8, int32, int64")
    dev = g.backend_for(t).device
    if t.device.index != dev:
        raise ValueError(f"{name} is on {t.device}, but this rank's NCCL communicator uses "
                         f"cuda:{dev}")


def pair(send, recv, g: ProcessGroup, *, ratio_recv=1, ratio_send=1) -> None:
    """send and recv: valid tensors, same dtype and device, recv.numel * ratio_recv ==
    send.numel * ratio_send."""
    tensor("send", send, g)
    tensor("recv", recv, g)
    if send.dtype != recv.dtype:
        raise ValueError(f"send and recv must have the same dtype, got {send.dtype} and {recv.dtype}")
    if send.device != recv.device:
        raise ValueError(f"send and recv must be on the same device, got {send.device} and "
                         f"{recv.device}")
    if send.numel() * ratio_send != recv.numel() * ratio_recv:
        if ratio_send == ratio_recv:
            rule = "the same numel as send"
        elif ratio_send > 1:
            rule = f"{ratio_send} x send.numel() (group size x send)"
        else:
            rule = f"send.numel() / {ratio_recv} (send split over the group)"
        raise ValueError(f"size mismatch: recv.numel() ({recv.numel()}) must be {rule}; "
                         f"send.numel() is {send.numel()}")


def rank(name: str, r, g: ProcessGroup, *, not_self=False) -> int:
    try:
        if isinstance(r, bool):
            raise TypeError
        r = operator.index(r)
    except TypeError:
        raise ValueError(f"{name} must be an int rank in [0, {g.size}) of the group, "
                         f"got {r!r}") from None
    if not 0 <= r < g.size:
        raise ValueError(f"{name} must be a rank in [0, {g.size}) of the group, got {r!r}")
    if not_self and r == g.rank:
        raise ValueError(f"{name} must be another rank than this one ({g.rank})")
    return r


def op(o, dtype: torch.dtype) -> ReduceOp:
    o = as_op(o)
    if o is ReduceOp.AVG and not dtype.is_floating_point:
        raise ValueError(f"op=ReduceOp.AVG needs a floating-point tensor, got {dtype}")
    if o in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"op=ReduceOp.{o.name} needs an integer tensor, got {dtype}")
    return o


def divisible(name: str, t, g: ProcessGroup) -> None:
    if t.numel() % g.size:
        raise ValueError(f"{name}.numel() ({t.numel()}) must be divisible by the group "
                         f"size ({g.size})")


def count(t, c, g: ProcessGroup) -> int:
    if isinstance(c, bool) or not isinstance(c, int) or c < 0 or c * g.size > t.numel():
        raise ValueError(f"count must be an int >= 0 with count * group size ({g.size}) <= "
                         f"tensor.numel() ({t.numel()}), got {c!r}")
    return c


def counts_displs(name, counts, displs, buf, g: ProcessGroup) -> tuple[list[int], list[int]]:
    try:
        counts = [_int(c) for c in counts]
        displs = [_int(d) for d in displs]
    except TypeError as err:
        raise ValueError(f"{name}_counts and {name}_displs must be sequences of ints (got "
                         f"{counts!r} and {displs!r}); element counts are never fractional"
                         ) from err
    if len(counts) != g.size or len(displs) != g.size:
        raise ValueError(f"{name}_counts and {name}_displs need one entry per rank ({g.size}), "
                         f"got {len(counts)} and {len(displs)}")
    for c, d in zip(counts, displs):
        if c < 0 or d < 0 or d + c > buf.numel():
            raise ValueError(f"{name}_counts/{name}_displs reach outside {name} "
                             f"(numel {buf.numel()}): count {c} at offset {d}")
    return counts, displs


def _int(v) -> int:
    if isinstance(v, bool):
        raise TypeError("bool is not a count")
    return operator.index(v)


def self_count(send_counts, recv_counts, g: ProcessGroup) -> None:
    me = g.rank
    if send_counts[me] != recv_counts[me]:
        raise ValueError(f"send_counts[{me}] ({send_counts[me]}) must equal recv_counts[{me}] "
                         f"({recv_counts[me]}): what this rank sends itself is what it receives "
                         "from itself")
