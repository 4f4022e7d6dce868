"""The compressor an algorithm communicates through (``compressor=`` of ByteGrad,
LowPrecisionDecentralized and QAdam), its error-feedback state keyed by parameter, and
:class:`CompressedAllReduce` (the bucket allreduce ByteGrad and QAdam share).

One compressor serves every bucket; each bucket's calls use the bucket's name as the
compressor's ``key``.  ``bagua_comm.compressed_allreduce`` keeps a compressor's residuals under
``<key>/scatter`` (this rank's whole input) and ``<key>/gather`` (the segment this rank
reduces); compressors that keep residuals as ``state_dict()["residuals"][key]`` (as
``MinMaxUInt8`` does) have them carried across re-bucketing and checkpoints at another bucket
size, parameter by parameter.  Other compressor state is kept as is when the layout is
unchanged and reset (with a warning) when it changes.  Also LowRank's seeded initial factor
(:func:`initial_q`), which its Python path and its compiled round both draw.
"""

from __future__ import annotations

import functools
import logging
import zlib

import torch

import bagua_comm as bc
from bagua_comm._compressed import padded_numel

from .._engine.comm import Reducer
from .._engine.state import export_flat, import_flat

log = logging.getLogger(__name__)


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every parameter that requires grad, once each, in registration
    order."""
    seen, out = set(), []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def check_compressor(compressor) -> None:
    """``None`` (MinMaxUInt8) or a ``bagua_comm.compression.Compressor``."""
    from bagua_comm.compression import Compressor

    if compressor is not None and not isinstance(compressor, Compressor):
        raise ValueError(f"compressor must be None (MinMaxUInt8) or a "
                         f"bagua_comm.compression.Compressor instance, got "
                         f"{type(compressor).__name__}; subclass Compressor to write your own")


def check_no_error_feedback(compressor, owner: str, residual: str) -> None:
    """Refuse a compressor that keeps its own error feedback under ``owner``, whose
    ``residual`` already carries the quantisation error (it would be fed back twice)."""
    if getattr(compressor, "error_feedback", False):
        raise ValueError(f"compressor must not keep its own error feedback under {owner} "
                         f"({residual} already carries the quantisation error): "
                         f"build it with error_feedback=False")


def make_compressor(compressor, chunks: int, error_feedback: bool = False):
    """The compressor to use: ``compressor``, or ``MinMaxUInt8(chunks)`` when None."""
    if compressor is None:
        from bagua_comm.compression import MinMaxUInt8

        return MinMaxUInt8(chunks, error_feedback=error_feedback)
    return compressor


def alignment(compressor, peers: int) -> int:
    """Elements a bucket is padded to so that ``compressed_allreduce`` needs no padding copy:
    the multiple it pads its input to (one unit of ``padded_numel``)."""
    chunks = getattr(compressor, "chunks", None)
    if not isinstance(chunks, int) or chunks < 1 or chunks % peers:
        return peers
    return padded_numel(compressor, 1, peers)


def decode_add(compressor, payload: torch.Tensor, out: torch.Tensor,
               scratch: torch.Tensor) -> None:
    """``out += compressor.decompress(payload)``: for MinMaxUInt8 into float32 one kernel
    pass (no decoded tensor, no add op), else through ``scratch`` (``out``'s size and dtype).
    The same float32 additions either way."""
    from bagua_comm._compressed import _fused

    if _fused(compressor) and out.dtype is torch.float32 and out.is_contiguous():
        compressor._decompress_reduce(payload, out, dtype=out.dtype, op=4)
    else:
        compressor.decompress(payload, scratch)
        out.add_(scratch)


def check_chunks(compressor, peers: int, what: str) -> None:
    chunks = getattr(compressor, "chunks", None)
    if isinstance(chunks, int) and chunks % peers:
        raise ValueError(f"{what}: compressor.chunks ({chunks}) must be a multiple of the number "
                         f"of ranks exchanging compressed data ({peers}); pass compressor=None "
                         "or a compressor built with chunks a multiple of it")


class CompressorState:
    """A compressor's error-feedback residuals, exported keyed by parameter name.

    ``peers`` is the group ``compressed_allreduce`` runs in (for the gather segment's
    position); ``rank`` is this rank's place in it (-1: not a member, no residuals).
    """

    def __init__(self, compressor, peers: bc.ProcessGroup):
        self.compressor = compressor
        self.peers = peers

    def _residuals(self):
        state = self.compressor.state_dict()
        res = state.get("residuals") if isinstance(state, dict) else None
        if isinstance(res, dict) and all(isinstance(v, torch.Tensor) for v in res.values()):
            return state, res
        return state, None

    def _padded(self, bucket) -> int:
        """Elements ``compressed_allreduce`` compresses for ``bucket`` (its scatter residual):
        bagua_comm's own formula, so residuals are exported at the offsets it uses."""
        return padded_numel(self.compressor, bucket.padded_numel, self.peers.size)

    def _starts(self, buckets) -> list[int]:
        """Where this rank's gather segment starts in each bucket."""
        r = max(self.peers.rank, 0)
        return [self._padded(b) // self.peers.size * r for b in buckets]

    def export(self, buckets) -> dict:
        state, res = self._residuals()
        if res is None:
            return {"compressor": state}
        rest = {k: v for k, v in state.items() if k != "residuals"}
        return {"compressor": rest,
                "scatter": export_flat(buckets, [res.get(f"{b.name}/scatter") for b in buckets]),
                "gather": export_flat(buckets, [res.get(f"{b.name}/gather") for b in buckets],
                                      start=self._starts(buckets))}

    def share_gather(self, buckets, state: dict) -> None:
        """Collective among the peers (re-bucketing): every member gets every member's gather
        residuals (each element's is held by exactly one of them), so whoever reduces an
        element in the new layout holds its residual."""
        if (not state.get("scatter") and not state.get("gather")) or not self.peers.is_member() \
                or self.peers.size == 1:   # no residuals: the same on every peer
            return
        parts = [(b.names, b.params) for b in buckets]
        flat = []
        for names, params in parts:
            for name, p in zip(names, params):
                t = state["gather"].get(name)
                flat.append(t.reshape(-1).float() if t is not None
                            else torch.zeros(p.numel(), dtype=torch.float32, device=p.device))
        if not flat:
            return
        buf = torch.cat(flat)
        bc.allreduce_inplace(buf, bc.ReduceOp.SUM, group=self.peers)
        gathered, off = {}, 0
        for names, params in parts:
            for name, p in zip(names, params):
                piece = buf[off:off + p.numel()]
                off += p.numel()
                if piece.any():
                    gathered[name] = piece
        state["gather"] = gathered

    def load(self, buckets, state: dict, *, same_layout: bool) -> None:
        if "scatter" not in state:          # opaque compressor state
            saved = state.get("compressor") or {}
            if same_layout or not saved:
                self.compressor.load_state_dict(saved)
            else:
                log.warning("bagua: %s's state cannot follow a new bucket layout; it starts "
                            "afresh", type(self.compressor).__name__)
            return
        res = {}
        starts = self._starts(buckets)
        for i, b in enumerate(buckets):
            padded = self._padded(b)
            for tag, size, lo in (("scatter", padded, 0),
                                  ("gather", padded // self.peers.size, starts[i])):
                buf = torch.zeros(size, dtype=torch.float32, device=b.device)
                if state[tag] and import_flat([b], [buf], state[tag],
                                              "error-feedback residuals", start=[lo]):
                    res[f"{b.name}/{tag}"] = buf
        self.compressor.load_state_dict({**state.get("compressor", {}), "residuals": res})


def layout(buckets) -> list[list[str]]:
    return [list(b.names) for b in buckets]


class CompressedAllReduce:
    """Flat or hierarchical compressed allreduce of buckets through one compressor, with its
    state keyed by parameter (ByteGrad's and QAdam's)."""

    def __init__(self, group, hierarchical: bool, compressor, *, average: bool = True,
                 error_feedback: bool = False, name: str = "bagua-compressed"):
        peers = group.num_nodes if hierarchical else group.size
        check_chunks(compressor, peers, "compressor")      # before any communication
        self.reducer = Reducer(group, hierarchical, name)
        self.op = bc.ReduceOp.AVG if average else bc.ReduceOp.SUM
        self.compressor = make_compressor(compressor, self.reducer.peers.size, error_feedback)
        self.state = CompressorState(self.compressor, self.reducer.peers)
        self.buckets = []

    def alignment(self) -> int:
        return alignment(self.compressor, self.reducer.peers.size)

    def __call__(self, tensor, bucket):
        """Start the allreduce of ``tensor`` (laid out like ``bucket``) in place."""
        if tensor.numel() > bucket.numel:                   # padding: zero, not last decode
            tensor[bucket.numel:].zero_()
        return self.reducer.compressed_allreduce(tensor, self.compressor, bucket.name, self.op)

    def launchers(self, buckets, tensors, flags=None) -> tuple[list, bool]:
        """Per bucket, a no-argument callable that starts what ``self(tensor, bucket)``
        starts: flat, for a compressor bagua_comm runs compiled (MinMaxUInt8 without error
        feedback on gloo), its launcher (the checks and buffers made here, once; no Python
        per call); else a call of ``self``.  With ``flags`` (the last bucket's "got a
        gradient" flags, float32), the last bucket's compiled launcher also sums them
        exactly, uncompressed, in its own exchange where it can; the second value says
        whether it does (the same on every rank: it depends on the configuration only)."""
        from bagua_comm._compressed import _inplace_launcher

        out, carried = [], False
        for i, (t, b) in enumerate(zip(tensors, buckets)):
            fast = None
            if not self.reducer.hierarchical:
                tail = flags if i == len(buckets) - 1 else None
                if tail is not None:
                    fast = _inplace_launcher(t, self.op, self.compressor, self.reducer.group,
                                             b.numel, tail)
                    carried = fast is not None
                if fast is None:
                    fast = _inplace_launcher(t, self.op, self.compressor, self.reducer.group,
                                             b.numel)
            out.append(fast if fast is not None else functools.partial(self, t, b))
        return out, carried

    def state_dict(self) -> dict:
        return {**self.state.export(self.buckets), "layout": layout(self.buckets)}

    def load_state_dict(self, state: dict) -> None:
        self.state.load(self.buckets, state, same_layout=state.get("layout") ==
                        layout(self.buckets))

    def share(self, state: dict) -> dict:
        """Collective part of re-bucketing (see CompressorState.share_gather)."""
        self.state.share_gather(self.buckets, state)
        return state

    def close(self):
        self.reducer.close()


def reset_residuals_note(state) -> str | None:
    """What resetting the compressors saved in ``state`` loses (None: nothing)."""
    saved = state.get("compressor", {}) if isinstance(state, dict) else {}
    if isinstance(saved, dict) and (saved.get("scatter") or saved.get("gather")):
        return ("error-feedback residuals are per rank and restart at zero (for a bit-exact "
                "resume at the same world size, save optimizer.state_dict() on every rank "
                "and load each rank's own file)")
    return None


def initial_q(name: str, m: int, r: int, seed: int, draw: int, device) -> torch.Tensor:
    """A standard normal ``m x r`` factor, the same on every rank: seeded by the parameter's
    name (not its bucket), ``seed`` and ``draw`` (the step, without warm start)."""
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode()) * 7919
                                         + draw) % 2 ** 63)
    return torch.randn(m, r, generator=gen).to(device)
