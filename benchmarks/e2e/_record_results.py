#!/usr/bin/env python3
"""Record a main-job run in docs/results.json, the one source of the figures the docs quote.

    python benchmarks/e2e.py --hosts 4 --procs-per-host 1 --bandwidths 100 --json out/e2e/full.json
    python benchmarks/e2e/_record_results.py out/e2e/full.json --run main-job-4hosts-100mbit-2026-11-25 \\
        --command "python benchmarks/e2e.py --hosts 4 ..." --machine "2-core VM, load about 4"

Writes ``runs[RUN]`` with the command, the date, the machine, and per row (``algorithm``, with
`` @<bandwidth>/<latency>`` when the run has several cells) its wall time to DDP's loss in
seconds and as a multiple of DDP's time in the same cell. Then update the pages that quote
the run and ``python tests/test_doc_figures.py --update``; tests/test_doc_figures.py checks
that every figure a page quotes is listed.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[2] / "docs" / "results.json"


def summarize(report: dict) -> dict:
    """{row: {"time_to_ddp_loss_s": s or None, "x_ddp_time": ratio or None}} of an e2e JSON."""
    runs = [r for r in report["runs"] if r.get("status") == "ok"]
    cells = {(r.get("bandwidth_mbit"), r.get("latency_ms")) for r in runs}
    out = {}
    for r in runs:
        cell = (r.get("bandwidth_mbit"), r.get("latency_ms"))
        ddp = next((d for d in runs if d["algorithm"] == "ddp"
                    and (d.get("bandwidth_mbit"), d.get("latency_ms")) == cell), None)
        t = r.get("time_to_ddp_loss_s")
        t_ddp = ddp and ddp.get("time_to_ddp_loss_s")
        name = r["algorithm"] if len(cells) == 1 else f"{r['algorithm']} @{cell[0]}/{cell[1]}"
        out[name] = {"time_to_ddp_loss_s": None if t is None else round(t, 1),
                     "x_ddp_time": round(t / t_ddp, 2) if t is not None and t_ddp else None}
    return out


def record(report: dict, run: str, command: str, machine: str, date: str,
           results: Path = RESULTS) -> dict:
    if not command.startswith("python benchmarks/"):
        raise ValueError(f"command must be the benchmark's command line, got {command!r}")
    data = json.loads(results.read_text())
    data["runs"][run] = {"command": command, "date": date, "machine": machine,
                         "rows": summarize(report)}
    results.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return data["runs"][run]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", type=Path, help="the JSON benchmarks/e2e.py wrote (--json)")
    ap.add_argument("--run", required=True, help="a name for the run, e.g. main-job-...-DATE")
    ap.add_argument("--command", required=True, help="the command line that produced it")
    ap.add_argument("--machine", required=True, help="cores, load average, versions")
    ap.add_argument("--date", default=datetime.date.today().isoformat())
    ap.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    rec = record(json.loads(a.report.read_text()), a.run, a.command, a.machine, a.date,
                 a.results)
    print(json.dumps(rec, indent=1))


if __name__ == "__main__":
    main()
