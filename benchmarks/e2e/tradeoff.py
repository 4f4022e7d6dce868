"""The trade-off map: which algorithm reaches the headline target first, per bandwidth x latency.

    python benchmarks/tradeoff.py                       # 4 hosts, 10/100/300 Mbit/s x 0/5/50 ms
    python benchmarks/tradeoff.py --quick               # 2 hosts, 100 Mbit/s x 0/5 ms, tiny steps
    python benchmarks/tradeoff.py --from-json out/e2e.json [more.json]  # from e2e.py runs

Runs benchmarks/e2e.py over the grid (every row: DDP, its hooks, each bagua algorithm and
mode, and ``alone``: no communication, the floor), then per cell names the winner by time to
the e2e report's headline target (the first of DDP's losses at depth that ``alone`` does not
reach; an older report: DDP's loss after N steps), its efficiency, its margin (the runner-up's
time / the winner's), the floor's time against it and what the automatic choice (``bagua_algos.recommend``'s rule applied to the
cell's network) picks and how far that is from the cell's best.  Writes a heatmap (PNG) and a
JSON that keeps every cell with every algorithm's time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _paths  # noqa: F401  (testbed and benchmarks/e2e on sys.path)
import _results

# isort: split
from _e2e_report import cell, cell_label, cells
from _e2e_rows import AUTO_WRAP

#: The default grid.  The fastest column is 300 Mbit/s, not 1 Gbit/s: the user-space delay line
#: carries ~0.6 Gbit/s in all on 2 cores and fell behind in every 1 Gbit/s cell with latency
#: on 4 hosts (2-12% of packets > 1 ms late); at 300 Mbit/s it kept up (<= 0.23% late).
GRID = {"bandwidths": "10,100,300", "latencies": "0,5,50", "hosts": "4"}
QUICK = {"bandwidths": "100", "latencies": "0,5", "hosts": "2", "size": "tiny", "steps": "4",
         "wall-seconds": "1", "algorithms": "ddp,alone,gradient_allreduce,bytegrad,decentralized"}
AUTO_ROW = {"decentralized": "decentralized_shift_one"}  # the rule's pick -> e2e's row
HIDDEN_DILOCO = "diloco_u4_m05_hide"   # the row of recommend's DiLoCo with overlap_steps


def auto_pick(bw, lat, world: int, model_bytes: float, compute_s: float,
              total_steps: int | None = None) -> str | None:
    """The e2e row the automatic choice runs in a cell (None: bagua_algos not importable);
    ``total_steps``: DDP's steps to the deepest target, as the ``auto`` row tells ``recommend``."""
    try:
        from bagua_algos.tuning.recommend import choose
    except ImportError:
        return None
    name, kwargs, *_ = choose(bw or 100_000, lat, world, model_bytes, compute_s=compute_s,
                              total_steps=total_steps)
    if name == "diloco" and kwargs.get("overlap_steps"):
        return HIDDEN_DILOCO        # its syncs hidden behind inner steps
    return AUTO_ROW.get(name, name)


def _steps_to(run: dict, ddp_steps: int | None, headline: str | None = None,
              ddp: dict | None = None) -> float | None:
    if headline:       # steps to the headline target / DDP's steps to it
        k = (run.get("steps_to_target") or {}).get(headline)
        d = ((ddp or {}).get("steps_to_target") or {}).get(headline)
        return round(k / d, 3) if k and d else None
    target = run.get("ddp_loss_target")
    if not ddp_steps or target is None:
        return None
    step = next((s for s, _t, loss in run.get("eval_curve") or [] if loss <= target), None)
    return None if step is None else round(step / ddp_steps, 3)


def _auto_time(runs, times, c, ddp, params,
               targets=None) -> tuple[str | None, float | None]:
    """What the automatic choice picks in cell ``c`` and its time to DDP's loss: the
    ``auto`` row's own run where the cell has one (with_bagua(..., "auto"), its measurement
    and bucket size included), else the row of the rule's pick for the cell's network."""
    row = next((r for r in runs if r["algorithm"] == "auto" and r["status"] == "ok"), None)
    if row is not None:
        return (row.get("auto_choice") or {}).get("algorithm"), times.get("auto")
    # the run's length as the auto row tells recommend: DDP's steps to the deepest target
    steps = max([t["ddp_steps"] for t in targets or []] or [ddp.get("steps") or 0]) or None
    pick = auto_pick(c[0], c[1], ddp["world_size"], 4 * params, ddp["compute_s"], steps)
    # GradientAllReduce is DDP's maths bit for bit: DDP's time stands in where the cell has
    # no row of its own
    if pick not in times and pick == "gradient_allreduce":
        return pick, times.get("ddp")
    # recommend's DiLoCo sends 4 bits, with outer momentum 0.5 (diloco_u4_m05); an older
    # report's 4-bit row ran the paper's 0.9
    # (a plan hiding its syncs: the hiding row, else the blocking one stands in)
    rows = {"diloco": ("diloco_u4_m05", "diloco_u4"),
            HIDDEN_DILOCO: (HIDDEN_DILOCO, "diloco_u4_m05", "diloco_u4")}.get(pick, ())
    for row in rows:
        if row in times:
            return "diloco", times.get(row)
    return pick, times.get(pick)


def build_map(report: dict, exclude=()) -> list[dict]:
    """One entry per cell of an e2e report: every algorithm's time to the report's headline
    target (an older report without one: to DDP's loss after N steps), the winner, margins,
    the automatic choice's and the ``alone`` floor's."""
    out = []
    params = report["model"]["params"]
    headline = report.get("headline")
    for c in cells(report["runs"]):
        runs = [r for r in report["runs"] if cell(r) == c]
        times = {r["algorithm"]: ((r.get("time_to_target_s") or {}).get(headline) if headline
                                  else r.get("time_to_ddp_loss_s")) for r in runs}
        ddp_steps = next((r.get("steps") for r in runs if r["algorithm"] == "ddp"), None)
        # the automatic rows are the choice, not contenders: "auto" (recommend told the
        # step's compute and the run's length) and "auto_wrap" (with_bagua(..., "auto"))
        reached = sorted((t, a) for a, t in times.items()
                         if t is not None and a not in ("auto", AUTO_WRAP))
        ddp = next((r for r in runs if r["algorithm"] == "ddp" and r["status"] == "ok"), None)
        entry = {"bandwidth_mbit": c[0], "latency_ms": c[1], "label": cell_label(c),
                 "target": headline or "DDP's loss after N steps",
                 "efficiency": {r["algorithm"]: r.get("efficiency") for r in runs},
                 "times_s": times, "winner": None, "margin": None, "winner_x_ddp_time": None,
                 "auto": None, "auto_vs_best": None,
                 # with_bagua(..., "auto") as written: its time / the best row's
                 "auto_wrap_vs_best": None,
                 # the floor (every rank alone, no communication): its time / the winner's
                 # (None: it never reached the target; < 1 would mean not talking wins)
                 "alone_vs_best": None,
                 "delay_line": next((r.get("delay_line") for r in runs), None),
                 # steps each row took to DDP's loss / DDP's N: what recommend's
                 # STEPS_FACTOR estimates (None: never reached it)
                 "steps_factor": {r["algorithm"]: _steps_to(r, ddp_steps, headline, ddp)
                                  for r in runs}}
        if reached:
            entry["winner"] = reached[0][1]
            entry["margin"] = reached[1][0] / reached[0][0] if len(reached) > 1 else None
            if times.get("ddp"):
                # the winner's time as a multiple of DDP's (< 1: sooner)
                entry["winner_x_ddp_time"] = reached[0][0] / times["ddp"]
            if times.get("alone"):
                entry["alone_vs_best"] = times["alone"] / reached[0][0]
        if ddp is not None:
            entry["auto"], t = _auto_time(runs, times, c, ddp, params,
                                            report.get("targets"))
            if entry["auto"] in exclude:
                entry["auto"], t = None, None    # a map without the rule's pick: no score
            entry["auto_vs_best"] = t / reached[0][0] if t and reached else None
        if times.get(AUTO_WRAP) and reached:
            entry["auto_wrap_vs_best"] = times[AUTO_WRAP] / reached[0][0]
        out.append(entry)
    return out


def heatmap(entries: list[dict], path: Path, title: str = "") -> Path | None:
    """Latency (rows) x bandwidth (columns); colour = winner, text = winner, margin, auto."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bws = sorted({e["bandwidth_mbit"] for e in entries}, key=lambda b: b or 1e9)
    lats = sorted({e["latency_ms"] for e in entries})
    names = sorted({e["winner"] for e in entries if e["winner"]})
    colours = {n: f"C{k}" for k, n in enumerate(names)}
    fig, ax = plt.subplots(figsize=(2.6 * len(bws) + 1.5, 1.5 * len(lats) + 1.2))
    for e in entries:
        x, y = bws.index(e["bandwidth_mbit"]), lats.index(e["latency_ms"])
        ax.add_patch(plt.Rectangle((x - 0.5, y - 0.5), 1, 1, alpha=0.45,
                                   color=colours.get(e["winner"], "0.85")))
        text = e["winner"] or "none reached\nthe target"
        if e["winner"] and (e.get("efficiency") or {}).get(e["winner"]):
            text += f" (eff {e['efficiency'][e['winner']]:.2f})"
        if e["margin"]:
            text += f"\nby {e['margin']:.2f}x"
        if e["winner_x_ddp_time"]:
            text += f", {e['winner_x_ddp_time']:.2f}x DDP's time"
        if e["auto"]:
            vs = e["auto_vs_best"]
            text += f"\nauto: {e['auto']}" + (f" ({vs:.2f}x best)" if vs else " (never)")
        if e.get("auto_wrap_vs_best"):
            text += f"\nwith_bagua auto: {e['auto_wrap_vs_best']:.2f}x best"
        if "alone" in e["times_s"]:
            vs = e.get("alone_vs_best")
            text += "\nalone: " + (f"{vs:.2f}x best" if vs else "never")
        if e["delay_line"] and not e["delay_line"].get("kept_up", True):
            text += "\n(delay line fell behind)"
        ax.text(x, y, text, ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.5, len(bws) - 0.5)
    ax.set_ylim(len(lats) - 0.5, -0.5)
    ax.set_xticks(range(len(bws)), [cell_label((b, 0)) for b in bws])
    ax.set_yticks(range(len(lats)), [f"{lat:g} ms" for lat in lats])
    ax.set_xlabel("link bandwidth per host")
    ax.set_ylabel("one-way latency")
    target = entries[0].get("target") if entries else None
    ax.set_title(title or f"first to {target or 'DDP' + chr(39) + 's loss'}\n(margin: runner-up's "
                 f"time / winner's)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"a tiny grid: {QUICK}")
    ap.add_argument("--from-json", type=Path, nargs="+",
                    help="map existing e2e.py JSONs (their cells together); run nothing")
    ap.add_argument("--exclude", default="",
                    help="comma list of rows left out of the map (e.g. diloco,local_sgd,auto: "
                         "the map among algorithms that communicate every step)")
    ap.add_argument("--json", type=Path, default=Path("out/tradeoff/tradeoff.json"))
    ap.add_argument("--plot", type=Path, default=Path("out/tradeoff/tradeoff.png"))
    _results.add_options(ap)
    args, e2e_args = ap.parse_known_args(argv)
    start = _results.started()
    if args.from_json:
        reports = [json.loads(p.read_text()) for p in args.from_json]
        report = {**reports[0], "runs": [r for rep in reports for r in rep["runs"]]}
        if report.get("targets"):
            # one headline for the joined map: the first target 'alone' reaches in no cell of
            # any of the runs (each run's own may differ), each row's bound at it
            from _e2e_targets import add_bound, pick_headline

            report["headline"], report["headline_why"] = pick_headline(report["targets"],
                                                                       report["runs"])
            add_bound(report["runs"], report["headline"])
    else:
        import e2e

        preset = {**GRID, **(QUICK if args.quick else {})}
        given = {a.split("=")[0].lstrip("-") for a in e2e_args if a.startswith("--")}
        extra = [x for k, v in preset.items() if k not in given for x in (f"--{k}", v)]
        e2e_json = args.json.with_name(args.json.stem + "-e2e.json")
        e2e.main([*extra, *e2e_args, "--json", str(e2e_json),
                  "--plot", str(args.plot.with_name(args.plot.stem + "-e2e.png"))])
        report = json.loads(e2e_json.read_text())
    drop = {a.strip() for a in args.exclude.split(",") if a.strip()}
    report = {**report, "runs": [r for r in report["runs"] if r["algorithm"] not in drop]}
    entries = build_map(report, exclude=drop)
    png = heatmap(entries, args.plot)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"config": report.get("config"), "cells": entries,
                                     "plot": str(png) if png else None}, indent=1))
    for e in entries:
        def x(v):
            return "-" if v is None else f"{v:.2f}x"

        print(f"{e['label']:>20} ({e['target']}): winner {e['winner']} (margin "
              f"{x(e['margin'])}), auto {e['auto']} ({x(e['auto_vs_best'])} best), "
              f"with_bagua auto {x(e.get('auto_wrap_vs_best'))} best, alone "
              + (f"{x(e['alone_vs_best'])} best" if e["alone_vs_best"] else "never got there"))
    print(f"json: {args.json}; plot: {png}")
    _results.record_from_args(args, "benchmarks/e2e/tradeoff.py",
                              figures(report, entries), argv, start)
    return 0


def figures(report: dict, entries: list[dict]) -> dict:
    """What docs/results.json keeps of a map (benchmarks/_results.py): the headline target and
    per cell its winner, margin, the automatic choice and how far it is from the best, the
    floor's time against the winner, every row's time and efficiency (ratios are times:
    < 1 is sooner)."""
    keep = ("target", "winner", "margin", "auto", "auto_vs_best", "auto_wrap_vs_best",
            "alone_vs_best", "times_s",
            "efficiency", "steps_factor")
    return _results.rounded({"headline": report.get("headline"),
                             "cells": {e["label"]: {k: e.get(k) for k in keep}
                                       for e in entries}})


if __name__ == "__main__":
    sys.exit(main())
