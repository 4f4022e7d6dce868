"""``python -m bagua_net``: where the plugin is, the interfaces it would use, and whether a
libnccl would load it (``--check-nccl [PATH]``; exit status 1 when it would not)."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    import bagua_net
    from bagua_net._check import check_nccl, find_libnccl

    parser = argparse.ArgumentParser(prog="python -m bagua_net", description=__doc__)
    parser.add_argument("--check-nccl", nargs="?", const="", metavar="PATH",
                        help="libnccl to check (default: the nvidia-nccl wheel's or torch's)")
    args = parser.parse_args(argv)

    path = bagua_net.library_path()
    print(f"bagua-net {bagua_net.__version__}")
    print(f"plugin: {path}")
    print(f"enable: export NCCL_NET_PLUGIN={path}")
    ifname = os.environ.get("NCCL_SOCKET_IFNAME")
    found = bagua_net.interfaces()
    print(f"interfaces (NCCL_SOCKET_IFNAME={ifname if ifname else '(unset)'}):")
    for name, addr, speed in found:
        print(f"  {name:<12} {addr:<40} {speed} Mb/s")
    if not found:
        print("  none: the plugin's init() would fail; set NCCL_SOCKET_IFNAME")
    print(f"streams per connection: {os.environ.get('BAGUA_NET_NSTREAMS', '8 (default)')}, "
          f"min chunk: {os.environ.get('BAGUA_NET_MIN_CHUNKSIZE', '1 MiB (default)')}")
    if args.check_nccl is None:
        return 0
    nccl = args.check_nccl or find_libnccl()
    if not nccl:
        print("libnccl: none found; pass its path (pip install nvidia-nccl-cu12)")
        return 1
    try:
        res = check_nccl(nccl)
    except ValueError as err:
        print(f"libnccl: {err}")
        return 1
    print(f"libnccl: {res.nccl_path} (NCCL {res.nccl_version or 'version unknown'})")
    print(f"  probes ncclNetPlugin_v{{{','.join(map(str, res.probed))}}}; "
          f"plugin exports v{{{','.join(map(str, res.exported))}}}")
    if res.loads:
        print(f"  would load: yes, BaguaNet through ncclNetPlugin_v{res.chosen}")
        return _check_init(res.chosen)
    if not res.probed:
        print("  would load: no (the file names no ncclNetPlugin_v<N> symbol: not a libnccl?)")
        return 1
    print("  would load: no (no interface version in common)" if res.chosen is None else
          f"  would load: no (table v{res.chosen} is named {res.names.get(res.chosen)!r})")
    return 1


def _check_init(version: int) -> int:
    """Call the table's init() and devices() as NCCL would next (NCCL falls back to its own
    transports when init fails, e.g. when no interface matches)."""
    from bagua_net.testing import Plugin, PluginError

    plugin = Plugin(version)
    try:
        plugin.init()
        ndev = plugin.devices()
    except PluginError as err:
        warn = [line for line in plugin.log if line.startswith("WARN")]
        print(f"  init: fails ({warn[-1] if warn else err}); NCCL would fall back to its own")
        return 1
    print(f"  init: ok, {ndev} device(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
