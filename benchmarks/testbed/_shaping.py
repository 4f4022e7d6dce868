"""The ``tc`` commands that shape one direction of an emulated link.

A link direction is one interface's egress.  Three shapes:

- unshaped: no root qdisc (the veth default, ``noqueue``);
- a link rate only: ``tbf`` at ``bandwidth_mbit``;
- per-flow caps: ``htb`` with a parent class at the link rate (or :data:`UNLIMITED_MBIT`)
  and :data:`FLOW_CLASSES` leaf classes capped at ``per_flow_mbit``.  A ``u32`` hash filter
  tells TCP flows apart by their *source port*: bits 1-8 of it pick the leaf class (bit 0 is
  skipped because Linux hands out even ports to ``connect()``), so the connections one host
  opens to one listener land in different classes.  Everything else (non-TCP, IP options)
  goes to a default class at the link rate.

The functions here only build command lines (``tc -batch`` input), so they are testable
without privileges.
"""

from __future__ import annotations

#: Stands in for "no link cap" when only per-flow caps are asked for.
UNLIMITED_MBIT = 100_000
#: Number of per-flow leaf classes (one per u32 hash bucket; u32 allows at most 256).
FLOW_CLASSES = 256
_FLOW_BASE = 0x100  # leaf classes 1:100 .. 1:1ff
_DEFAULT = 0xFFF


def validate_rates(bandwidth_mbit, per_flow_mbit) -> None:
    """Raise ``ValueError`` unless each rate is ``None`` or a positive number."""
    for name, value in (("bandwidth_mbit", bandwidth_mbit), ("per_flow_mbit", per_flow_mbit)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number of Mbit/s or None "
                             f"(unshaped), got {value!r}")


def _kbit(mbit: float) -> str:
    return f"{max(1, round(mbit * 1000))}kbit"


def _burst_bytes(mbit: float) -> int:
    # 5 ms worth of traffic, but never below a full 64 KiB GSO segment (veth does GSO).
    return max(64 * 1024 + 4096, int(mbit * 1e6 / 8 * 0.005))


def shape_commands(dev: str, bandwidth_mbit, per_flow_mbit) -> list[str]:
    """``tc -batch`` lines that give ``dev``'s egress the requested shape (idempotent)."""
    validate_rates(bandwidth_mbit, per_flow_mbit)
    # Deleting a missing root qdisc fails; the caller runs the batch with ``-force``.
    lines = [f"qdisc del dev {dev} root"]
    if bandwidth_mbit is None and per_flow_mbit is None:
        return lines
    if per_flow_mbit is None:
        burst = _burst_bytes(bandwidth_mbit)
        lines.append(f"qdisc add dev {dev} root handle 1: tbf rate {_kbit(bandwidth_mbit)} "
                     f"burst {burst} latency 50ms")
        return lines
    link = bandwidth_mbit if bandwidth_mbit is not None else UNLIMITED_MBIT
    flow = min(per_flow_mbit, link)

    # Leaves are guaranteed only a small share and borrow up to their ceiling from the
    # parent, so together they never exceed the link (htb honours a leaf's *rate* even
    # when the leaves' rates add up to more than the parent's).
    share = link / (FLOW_CLASSES + 1)

    def cls(minor: int, rate: float, ceil: float, parent: str = "1:1") -> str:
        b = _burst_bytes(ceil)
        return (f"class add dev {dev} parent {parent} classid 1:{minor:x} htb "
                f"rate {_kbit(rate)} ceil {_kbit(ceil)} burst {b} cburst {b} quantum 65536")

    lines += [
        f"qdisc add dev {dev} root handle 1: htb default {_DEFAULT:x}",
        cls(1, link, link, parent="1:"),
        cls(_DEFAULT, share, link),
    ]
    lines += [cls(_FLOW_BASE + k, min(share, flow), flow) for k in range(FLOW_CLASSES)]
    lines.append(f"filter add dev {dev} parent 1: prio 1 handle 2: protocol ip u32 "
                 f"divisor {FLOW_CLASSES}")
    lines += [f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 2:{k:x}: "
              f"match u32 0 0 flowid 1:{_FLOW_BASE + k:x}" for k in range(FLOW_CLASSES)]
    # TCP with a 20-byte IP header: the word at offset 20 is (sport << 16 | dport).
    lines.append(f"filter add dev {dev} parent 1: prio 1 protocol ip u32 ht 800:: "
                 f"match ip protocol 6 0xff match u8 0x05 0x0f at 0 "
                 f"hashkey mask 0x01fe0000 at 20 link 2:")
    return lines


def flow_class(sport: int) -> int:
    """The leaf class index a TCP packet with source port ``sport`` is capped by."""
    return (sport >> 1) & (FLOW_CLASSES - 1)
