"""``python -m bagua_net``: where the plugin is."""

from __future__ import annotations

import sys


def main(argv=None) -> int:
    import bagua_net

    print(f"bagua-net {bagua_net.__version__}")
    print(f"plugin: {bagua_net.library_path()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
