"""The main job's table as plain text within 80 columns: one block per cell (bandwidth,
latency), row names shortened with a legend, each row's mode and every unavailable row's
reason under the block, wrapped."""

from __future__ import annotations

import textwrap

from _e2e_report import cell, cell_label, cells

WIDTH = 80
NAME = 13          # the algorithm column; longer names are shortened (SHORT) with a legend
SHORT = {
    "ddp_bytegrad_hook": "ddp_bg_hook",
    "gradient_allreduce": "grad_allred",
    "decentralized": "decent",
    "decentralized_shift_one": "decent_shift1",
    "low_precision_decentralized": "lp_decent",
    "low_rank_r32_u8": "lowrank32_u8",
    "low_rank_r64_u8": "lowrank64_u8",
    "low_rank_r16": "lowrank16",
    "low_rank_r8": "lowrank8",
    "topk_1pct_u4": "topk1pct_u4",
    "diloco_stream": "dl_stream",
    "diloco_u4_m05": "dl_u4_m05",
    "diloco_u4_m05_stream": "dl_u4m05_strm",
    "diloco_u4_m05_hide": "dl_u4m05_hide",
}
COLUMNS = (("algorithm", NAME), ("MB/st", 6), ("ms/st", 6), ("loss@N", 6), ("hit", 3),
           ("to H s", 6), ("st>H", 4), ("t/DDP", 5), ("bound", 6), ("eff", 4))
LEGEND = (
    "MB/st: MB each rank sent per step (wire: on the host's interface; no testbed: counted "
    "by the communication layer).  ms/st: wall ms per step in the timed window.  loss@N: "
    "held-out loss after N steps (*: the mean over the ranks' different models).  hit: "
    "targets reached of all.  to H s / st>H: training seconds / steps to the headline "
    "target H ('-': not within the budget).  t/DDP: this row's time to H as a multiple of "
    "DDP's (< 1: sooner).  bound: the compute-only bound, DDP's steps to H x the slowest rank's "
    "compute time of a step (s; the median of the cell's rows' measurements).  eff: bound / time to H (1 = the physical limit).")


def short(name: str) -> str:
    """A name that fits the algorithm column (``SHORT``, else cut with a '~')."""
    name = SHORT.get(name, name)
    return name if len(name) <= NAME else name[:NAME - 1] + "~"


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _row(r: dict, headline: str | None, ddp: dict | None) -> list[str]:
    name = short(r["algorithm"])
    if r["status"] != "ok":
        return [name, r["status"]]
    hit = r.get("steps_to_target") or {}
    t = (r.get("time_to_target_s") or {}).get(headline)
    t_ddp = ((ddp or {}).get("time_to_target_s") or {}).get(headline)
    star = "*" if str(r.get("loss_over", "")).startswith("mean") else ""
    return [name, f"{r['bytes_per_step'] / 1e6:.2f}", f"{r['step_s'] * 1e3:.0f}",
            f"{r['loss']:.3f}{star}",
            f"{sum(v is not None for v in hit.values())}/{len(hit)}", _fmt(t, ".1f"),
            _fmt((r.get("steps_to_target") or {}).get(headline), "d"),
            _fmt(t / t_ddp if t and t_ddp else None, ".2f"), _fmt(r.get("bound_s"), ".1f" if (r.get("bound_s") or 0) >= 10 else ".2f"),
            _fmt(r.get("efficiency"), ".2f")]


def _line(cols: list[str]) -> str:
    if len(cols) == 2:     # not measured: the status, the reason is in the notes below
        return f"{cols[0]:<{NAME}}  {cols[1]}"
    out = []
    for k, (text, (_h, w)) in enumerate(zip(cols, COLUMNS)):
        out.append(text.ljust(w) if k == 0 else text.rjust(w))
    return " ".join(out).rstrip()


def _wrap(text: str, indent: str = "  ") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent + "  ")


def table(runs: list[dict], title: str, targets: list[dict] | None = None,
          headline: str | None = None, why: str = "", mode=lambda r: "") -> str:
    """Every cell's block, the targets and the legend; ``mode(run)``: the row's mode note."""
    lines = _wrap(title, "")
    if targets:
        lines += _wrap("targets (DDP's held-out loss after k steps): " + ", ".join(
            f"{t['name']} {t['loss']:.3f}" for t in targets), "")
        lines += _wrap(f"headline H = {headline}: {why}", "")
    for c in cells(runs):
        rows = [r for r in runs if cell(r) == c]
        ddp = next((r for r in rows if r["algorithm"] == "ddp" and r["status"] == "ok"), None)
        lines += ["", cell_label(c), _line([h for h, _w in COLUMNS])]
        lines += [_line(_row(r, headline, ddp)) for r in rows]
        for r in rows:
            note = (f"{r['status']}: {r.get('reason') or ''}" if r["status"] != "ok"
                    else mode(r))
            if note:
                lines += _wrap(f"{short(r['algorithm'])}: {note}")
    names = sorted({r["algorithm"] for r in runs if short(r["algorithm"]) != r["algorithm"]})
    if names:
        lines += [""] + _wrap("names: " + ", ".join(f"{short(n)} = {n}" for n in names), "")
    lines += [""] + _wrap(LEGEND, "")
    return "\n".join(lines)
