"""Tables, ratios and the plot of benchmarks/e2e.py."""

from __future__ import annotations

import re
from pathlib import Path

DECENTRALIZED_OR_ASYNC = ("decentralized", "low_precision_decentralized", "async")


def bw_label(bw) -> str:
    if bw is None:
        return "unshaped"
    return f"{bw / 1000:g} Gbit/s" if bw >= 1000 else f"{bw:g} Mbit/s"


def _ddp(runs: list[dict], bw) -> dict | None:
    for r in runs:
        if r["bandwidth_mbit"] == bw and r["algorithm"] == "ddp" and r["status"] == "ok":
            return r
    return None


def add_ratios(runs: list[dict]) -> None:
    """Add ``speedup_vs_ddp`` and ``loss_vs_ddp`` (same bandwidth, same run) to each run."""
    for r in runs:
        ddp = _ddp(runs, r["bandwidth_mbit"])
        ok = r["status"] == "ok" and ddp is not None
        r["speedup_vs_ddp"] = r["samples_per_s"] / ddp["samples_per_s"] if ok else None
        r["loss_vs_ddp"] = r["loss"] / ddp["loss"] if ok else None


def check_targets(runs: list[dict]) -> list[dict]:
    """The issue's targets, each with the measured value and whether it is met."""
    out = []

    def add(what, bw, algo, value, need, ok):
        out.append({"target": what, "bandwidth_mbit": bw, "algorithm": algo,
                    "value": value, "need": need, "met": ok})

    for r in runs:
        if r["status"] != "ok" or r["algorithm"] == "ddp":
            continue
        bw, algo, s = r["bandwidth_mbit"], r["algorithm"], r.get("speedup_vs_ddp")
        if s is None:
            continue
        if bw == 100 and algo == "bytegrad":
            add("throughput vs DDP at 100 Mbit/s", bw, algo, s, ">= 2.5", s >= 2.5)
        if bw == 100 and algo in DECENTRALIZED_OR_ASYNC:
            add("throughput vs DDP at 100 Mbit/s", bw, algo, s, ">= 1.5", s >= 1.5)
        if bw == 100 and (algo == "bytegrad" or algo in DECENTRALIZED_OR_ASYNC):
            lv = r["loss_vs_ddp"]
            add("loss after N steps vs DDP", bw, algo, lv, "within 5%", abs(lv - 1) <= 0.05)
        if bw is None and algo == "gradient_allreduce":
            add("unshaped throughput vs DDP", bw, algo, s, ">= 0.95", s >= 0.95)
    return out


_COLUMNS = [("bandwidth", "left"), ("algorithm", "left"), ("samples/s", "right"),
           ("x DDP", "right"), ("step ms", "right"), ("compute ms", "right"),
           ("comm ms", "right"), ("MB/step/rank", "right"),
           ("eval loss@N", "right"), ("eval loss@T", "right"),
           ("note", "left")]


def _rows(runs: list[dict]) -> list[list[str]]:
    rows = []
    for r in runs:
        if r["status"] != "ok":
            style = "yellow" if r["status"] == "unavailable" else "red"
            rows.append([bw_label(r["bandwidth_mbit"]), r["algorithm"], *["-"] * 8,
                         f"[{style}]{r['status']}[/]: {(r.get('reason') or '')[:70]}"])
            continue
        s = r.get("speedup_vs_ddp")
        rows.append([bw_label(r["bandwidth_mbit"]), r["algorithm"], f"{r['samples_per_s']:.1f}",
                  "-" if s is None else f"{s:.2f}", f"{r['step_s'] * 1e3:.0f}",
                  f"{r['compute_s'] * 1e3:.0f}", f"{r['comm_s'] * 1e3:.0f}",
                  f"{r['bytes_per_step'] / 1e6:.2f}", f"{r['loss']:.3f}",
                  f"{r['loss_at_wall']:.3f}", r.get("bytes_source", "")])
    return rows


def table(runs: list[dict], title: str):
    """A rich Table (or plain text where rich is not installed)."""
    try:
        from rich.table import Table
    except ImportError:
        rows = [[c for c, _ in _COLUMNS]] + [
            [re.sub(r"\[/?[a-z]*\]", "", cell) for cell in row] for row in _rows(runs)]
        widths = [max(len(row[k]) for row in rows) for k in range(len(_COLUMNS))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        return "\n".join([title, *lines])
    t = Table(title=title, title_justify="left")
    for col, just in _COLUMNS:
        t.add_column(col, justify=just)
    for row in _rows(runs):
        t.add_row(*row)
    return t


def plot(runs: list[dict], path: Path, subtitle: str = "") -> Path | None:
    """Loss against wall time per bandwidth, and throughput against bandwidth (a PNG)."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bws = []
    for r in runs:
        if r["bandwidth_mbit"] not in bws:
            bws.append(r["bandwidth_mbit"])
    algos = []
    for r in runs:
        if r["algorithm"] not in algos:
            algos.append(r["algorithm"])
    colors = {a: f"C{k}" for k, a in enumerate(algos)}
    fig, axes = plt.subplots(1, len(bws) + 1, figsize=(5 * (len(bws) + 1), 4.2), squeeze=False)
    for ax, bw in zip(axes[0], bws):
        for r in runs:
            if r["bandwidth_mbit"] != bw or r["status"] != "ok":
                continue
            curve = r["loss_curve"]
            ax.plot([c[0] for c in curve], [c[1] for c in curve], color=colors[r["algorithm"]],
                    label=r["algorithm"], lw=1.5)
        ax.axvline(runs[0].get("wall_s") or 0, color="grey", ls=":", lw=1)
        ax.set_title(f"training loss vs wall time, {bw_label(bw)}")
        ax.set_xlabel("wall time (s)")
        ax.set_ylabel("training loss (mean of ranks)")
        ax.legend(fontsize=8)
    ax = axes[0][-1]
    xs = list(range(len(bws)))
    for a in algos:
        pts = [(k, r["samples_per_s"]) for k, bw in enumerate(bws) for r in runs
               if r["bandwidth_mbit"] == bw and r["algorithm"] == a and r["status"] == "ok"]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=colors[a], label=a)
    ax.set_xticks(xs, [bw_label(b) for b in bws])
    ax.set_title("throughput vs link bandwidth")
    ax.set_ylabel("samples / s (all ranks)")
    ax.set_yscale("log")
    ax.legend(fontsize=7, loc="best")
    if subtitle:
        fig.suptitle(subtitle, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class PlainConsole:
    """The two rich.Console methods e2e.py uses, for machines without rich."""

    def print(self, *objs) -> None:
        print(*(re.sub(r"\[/?[a-z ]*\]", "", str(o)) for o in objs), flush=True)

    log = print


class PlainProgress:
    """rich.progress.Progress's methods e2e.py uses: one line per finished task."""

    def __init__(self, console):
        self.console, self.tasks = console, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def add_task(self, description, total, start=True):
        self.tasks[len(self.tasks)] = [description, total, 0]
        return len(self.tasks) - 1

    def start_task(self, task) -> None:
        pass

    def update(self, task, completed=None, description=None) -> None:
        t = self.tasks[task]
        if description:
            t[0] = description
        if completed is not None and completed >= t[1] > t[2]:
            self.console.print(f"{t[0]}: done")
        if completed is not None:
            t[2] = completed
