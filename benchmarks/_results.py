"""The benchmarks' side of docs/results.json, the one source of every figure the docs quote.

A benchmark whose figures a page quotes takes ``--results [PATH]`` (``add_options``): with it,
the run's figures are merged into PATH (docs/results.json when no PATH is given) under
``runs[NAME]``, NAME being ``--results-run`` or ``<benchmark>-<date>``. The entry says where
the figures come from: the benchmark's path, its command line, the date, the machine and its
load (at the start and at the end of the run), the versions, and ``--results-note`` (what the
machine was doing, e.g. "idle"). Other runs and the per-page lists are kept as they are.

    python benchmarks/e2e.py --hosts 4 --bandwidths 100 --results              # docs/results.json
    python benchmarks/micro/optim.py --suite vs-fused --results out/r.json --results-run vs-fused

Then update the pages that quote the run and ``python tests/test_doc_figures.py --update``
(tests/test_doc_figures.py fails while a page quotes a figure the file does not list).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.json"


def add_options(ap) -> None:
    """``--results [PATH]``, ``--results-run NAME`` and ``--results-note TEXT``."""
    ap.add_argument("--results", nargs="?", type=Path, const=RESULTS, default=None,
                    metavar="PATH", help="merge this run's figures into PATH (no PATH: "
                    "docs/results.json, the file the docs' figures come from)")
    ap.add_argument("--results-run", default=None, metavar="NAME",
                    help="the run's key in that file (default: <benchmark>-<date>)")
    ap.add_argument("--results-note", default="", metavar="TEXT",
                    help="what else the machine was doing, recorded with the run (e.g. 'idle')")


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def started() -> dict:
    """What a run records when it starts: call first, pass to ``record``."""
    return {"at": datetime.datetime.now(datetime.timezone.utc), "load": _load()}


def machine(start: dict | None, note: str = "") -> dict:
    out = {"cores": os.cpu_count(), "platform": platform.platform(),
           "python": platform.python_version(),
           "load_average_start": (start or {}).get("load"), "load_average_end": _load()}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        out["threads"] = torch.get_num_threads()
    if note:
        out["note"] = note
    return out


def command(script: str | Path, argv: list[str] | None) -> str:
    """``python benchmarks/<script> <argv>``: the line that re-runs it from the repository."""
    path = Path(script).resolve()
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else Path("benchmarks") / script
    args = sys.argv[1:] if argv is None else list(argv)
    return shlex.join(["python", str(rel), *args])


def rounded(obj, digits: int = 3):
    """``obj`` with every float rounded to ``digits`` decimals (the file is read by people)."""
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [rounded(v, digits) for v in obj]
    return obj


def record(benchmark: str, figures: dict, *, path: Path = RESULTS, run: str | None = None,
           cmd: str, start: dict | None = None, note: str = "") -> dict:
    """Merge ``runs[run]`` = {benchmark, command, date, machine, figures} into ``path``."""
    if not cmd.startswith("python benchmarks/"):
        raise ValueError(f"cmd must be the benchmark's command line ('python benchmarks/...'), "
                         f"got {cmd!r}")
    if not isinstance(figures, dict) or not figures:
        raise ValueError(f"figures must be a non-empty dict, got {figures!r}")
    at = (start or {}).get("at") or datetime.datetime.now(datetime.timezone.utc)
    date = at.date().isoformat()
    name = run or f"{Path(benchmark).stem}-{date}"
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("runs", {})
    entry = {"benchmark": benchmark, "command": cmd, "date": date,
             "started_utc": at.strftime("%Y-%m-%dT%H:%M:%SZ"),
             "machine": machine(start, note), "figures": figures}
    data["runs"][name] = json.loads(json.dumps(entry))    # plain JSON types only
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return data["runs"][name]


def record_from_args(args, benchmark: str, figures: dict, argv, start: dict | None) -> None:
    """``record`` when ``--results`` was given (``add_options``); says where it wrote."""
    if getattr(args, "results", None) is None:
        return
    entry = record(benchmark, figures, path=args.results, run=args.results_run,
                   cmd=command(ROOT / benchmark, argv), start=start, note=args.results_note)
    name = args.results_run or f"{Path(benchmark).stem}-{entry['date']}"
    print(f"results: runs[{name!r}] of {args.results}", flush=True)
