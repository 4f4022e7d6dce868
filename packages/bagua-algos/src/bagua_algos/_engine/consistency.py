"""Every rank must wrap the same model with the same configuration.

A rank that disagrees (another compressor, autotuning on one rank only, a model of another
shape) would otherwise fail deep inside a collective: gloo's size check kills the process, a
bucket allreduce of another length hangs until the timeout.  :func:`check_same_on_every_rank`
runs once in ``with_bagua``, before the first broadcast: an allgather of each rank's digest of
its description shows whether they all agree; if not, rank 0's description is broadcast, each
rank compares it with its own, and a MAX-allreduce of one flag per field tells every rank which
fields differ somewhere, so all ranks raise the same ``ValueError`` together.
"""

from __future__ import annotations

import hashlib
import os

import torch

import bagua_comm as bc

from .small import gather_small

_SIMPLE = (bool, int, float, str, type(None))


def describe(value, depth: int = 0) -> str:
    """A description of ``value`` that is equal on two ranks exactly when their settings are:
    built from types and public attributes, never from ``id()``-based default reprs."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe(v, depth + 1) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, dict):
        # keys by what they are, not their values (an optimizer's state is keyed by the
        # parameters themselves, whose values may differ between ranks)
        items = sorted((k if isinstance(k, str) else describe(k, depth + 1),
                        describe(v, depth + 1)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, torch.Tensor):
        return f"tensor({tuple(value.shape)}, {value.dtype})"
    name = f"{type(value).__module__}.{type(value).__qualname__}"
    if depth >= 3 or not hasattr(value, "__dict__"):
        return name
    attrs = {k: v for k, v in vars(value).items()
             if not k.startswith("_") and (isinstance(v, _SIMPLE + (list, tuple, dict))
                                           or hasattr(v, "__dict__"))
             and not callable(v)}
    inner = ", ".join(f"{k}={describe(v, depth + 1)}" for k, v in sorted(attrs.items()))
    return f"{name}({inner})"


def _model_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.requires_grad};".encode())
    n_params = sum(1 for _ in model.parameters())
    return f"{n_params} parameters, {sum(1 for _ in model.buffers())} buffers, " \
           f"shapes sha256 {h.hexdigest()[:12]}"


def configuration(model, optimizers, algorithm, settings: dict) -> dict[str, str]:
    """What must be equal on every rank, field by field (the field names appear in errors)."""
    out = {
        "algorithm": describe(algorithm),
        "model (parameter and buffer names, shapes, dtypes, requires_grad)": _model_digest(model),
        "optimizers": describe([f"{type(o).__module__}.{type(o).__qualname__} with "
                                f"{[len(g['params']) for g in o.param_groups]} params per group"
                                for o in optimizers]),
    }
    out.update({k: describe(v) for k, v in settings.items()})
    return out


#: bytes of a :func:`digest`: two int64 in an allgather
DIGEST_BYTES = 16


def digest(*parts) -> bytes:
    """A digest of ``parts``: tensors (dtype, shape, bytes) and plain data (``repr``), nested
    in dicts, lists and tuples.  A tensor off the CPU is not copied to the host for it (nor a
    sparse one read): the digest is then a random one, unequal to any other (its state is
    broadcast as before)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)

    def feed(x) -> bool:
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu" or x.layout != torch.strided:
                return False
            t = x.detach().contiguous().reshape(-1)
            h.update(f"T{t.dtype}{tuple(x.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().data)
        elif isinstance(x, dict):
            h.update(f"D{len(x)}".encode())
            return all(feed(k) and feed(v) for k, v in x.items())
        elif isinstance(x, (list, tuple)):
            h.update(f"L{len(x)}".encode())
            return all(feed(v) for v in x)
        else:
            h.update(f"{type(x).__name__}:{x!r};".encode())
        return True

    return h.digest() if feed(parts) else os.urandom(DIGEST_BYTES)


def digest_words(d: bytes) -> list[int]:
    """A :func:`digest` as two int64 words, for an allgather (anything else, an unknown
    digest, as two random words: unequal to every other)."""
    if len(d) != DIGEST_BYTES:
        d = os.urandom(DIGEST_BYTES)
    return [int.from_bytes(d[i:i + 8], "little", signed=True) for i in range(0, DIGEST_BYTES, 8)]


def already_equal(module: torch.nn.Module, optimizers, group: bc.ProcessGroup) -> bool:
    """Whether every rank of ``group`` already holds the same parameters, buffers and
    optimizer state (each rank's :func:`digest` sent to every peer: one round): with_bagua's
    broadcast of rank 0's would then move equal values (ranks seeded alike, the usual start), seconds on
    a slow link.  Gloo groups only, whose tensors are on the CPU; an NCCL group answers
    False without communicating (a digest of device memory would copy it to the host)."""
    if group.size == 1 or group.backend != "gloo":
        return False
    mine = digest(list(module.parameters()), list(module.buffers()),
                  [opt.state_dict() for opt in optimizers])
    words = torch.tensor(digest_words(mine), dtype=torch.int64)
    return bool((gather_small(words, group) == words).all())


def check_same_on_every_rank(config: dict[str, str], group: bc.ProcessGroup) -> None:
    """Raise the same ``ValueError`` on every rank when any rank's ``config`` differs from
    rank 0's (nothing else has been sent yet).  A 16-byte digest of each rank's ``config``
    sent to every peer (one round, :func:`gather_small`) when they agree (the usual case:
    every collective costs the group's latency rounds, ~0.3 s each at 50 ms one way on 4
    hosts); only when they do not, rank 0's
    description is broadcast and a MAX of one flag per field names what differs."""
    if group.size == 1:
        return
    whole = hashlib.sha256(repr(sorted(config.items())).encode()).digest()[:DIGEST_BYTES]
    words = torch.tensor(digest_words(whole), dtype=torch.int64)
    if bool((gather_small(words, group) == words).all()):
        return
    fields = list(config)
    reference = bc.broadcast_object(config if group.rank == 0 else None, 0, group=group)
    if list(reference) != fields:        # another bagua_algos version on rank 0
        mine = torch.ones(len(fields), dtype=torch.int32)
    else:
        mine = torch.tensor([int(reference[f] != config[f]) for f in fields], dtype=torch.int32)
    anywhere = mine.clone()
    bc.allreduce_inplace(anywhere, op=bc.ReduceOp.MAX, group=group)
    bad = [f for f, flag in zip(fields, anywhere.tolist()) if flag]
    if not bad:
        return
    lines = []
    for f in bad:
        if mine[fields.index(f)]:
            lines.append(f"  {f}: rank 0 has {reference.get(f, '<missing>')}, "
                         f"rank {group.rank} has {config[f]}")
        else:
            lines.append(f"  {f}: differs on another rank (this rank {group.rank} agrees with "
                         f"rank 0: {config[f]})")
    raise ValueError("with_bagua: every rank must pass the same model and configuration, "
                     "but they differ:\n" + "\n".join(lines)
                     + "\n(check the code path and environment variables, such as "
                       "BAGUA_AUTOTUNE, of the ranks named)")


def check_same_bucket_size(bucket_size: int, group: bc.ProcessGroup) -> None:
    """Collective: ``ValueError`` on every rank when ranks passed different ``bucket_size``
    values to ``rebucket()`` (a size that differs would hang later)."""
    if group.size == 1:
        return
    sizes = torch.tensor([bucket_size, -bucket_size], dtype=torch.int64)
    bc.allreduce_inplace(sizes, bc.ReduceOp.MAX, group=group)
    if int(sizes[0]) != -int(sizes[1]):
        raise ValueError(f"rebucket() got different bucket_size values on different "
                         f"ranks (from {-int(sizes[1])} to {int(sizes[0])}); call it "
                         "with the same value on every rank")
