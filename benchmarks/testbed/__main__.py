"""``python benchmarks/testbed up|down|status``: a testbed that stays up between commands."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from testbed import Testbed, leftovers, sweep, testbed_available
from testbed._core import _state_file


def _rate(text: str):
    return None if text in ("none", "unshaped", "0") else float(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/testbed",
                                 description="Emulated hosts in network namespaces.")
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--name", default="bt")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--mbit", type=_rate, default=100.0,
                    help="link bandwidth in Mbit/s, or 'none' for unshaped")
    ap.add_argument("--per-flow-mbit", type=_rate, default=None)
    args = ap.parse_args(argv)
    ok, why = testbed_available()
    if args.action == "up":
        if not ok:
            print(f"cannot make a testbed here: {why}", file=sys.stderr)
            return 1
        tb = Testbed(args.hosts, args.mbit, args.per_flow_mbit, args.name, mode="root",
                     keep=True)
        for h in tb.hosts:
            print(f"{h.name}  netns={h.netns}  addr={h.addr}  if={h.ifname}")
        print(f"run things with: ip netns exec {tb.hosts[0].netns} <command>")
        return 0
    if args.action == "down":
        found = sweep(args.name, force=True)
        print(f"removed {len(found['netns'])} namespaces, {len(found['links'])} links")
        return 0
    found = leftovers(args.name)
    state = _state_file(args.name)
    print(f"testbed {args.name!r}: {why}")
    print(json.dumps({**found, "state": json.loads(state.read_text())
                      if state.exists() else None}, indent=2))
    for ns in found["netns"]:
        q = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", "eth0"],
                           capture_output=True, text=True).stdout.strip().splitlines()
        print(f"  {ns}: {q[0] if q else '?'}" + (f" (+{len(q) - 1})" if len(q) > 1 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
