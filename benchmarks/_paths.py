"""Where the benchmark scripts find each other: the one place that touches ``sys.path``.

A script in a subfolder (``python benchmarks/micro/autotune.py``) starts with::

    sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
    import _paths  # noqa: E402,F401

and can then import ``testbed`` (benchmarks/testbed) and the main job's modules
(``_e2e_model``, ``_e2e_rows``, ``_e2e_report``, ``e2e``: benchmarks/e2e), which the
micro-benchmarks and studies reuse.  benchmarks/e2e goes first, benchmarks/ last (appended, not
inserted): ``import e2e`` must find the entry point, not the ``benchmarks/e2e.py`` shim.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent

_E2E = str(BENCH / "e2e")
if _E2E in sys.path:
    sys.path.remove(_E2E)
sys.path.insert(0, _E2E)
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))


def run_moved(script: str) -> None:
    """Run ``benchmarks/<script>`` as ``__main__`` (what a shim at an old path does)."""
    target = BENCH / script
    sys.argv[0] = str(target)
    runpy.run_path(str(target), run_name="__main__")
