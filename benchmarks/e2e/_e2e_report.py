"""Tables, ratios and the plot of benchmarks/e2e.py."""

from __future__ import annotations

import re
from pathlib import Path

DECENTRALIZED_OR_ASYNC = ("decentralized", "decentralized_shift_one",
                          "low_precision_decentralized", "async")
DDP_PEERS = ("ddp_fp16", "ddp_powersgd")  # what a user would pick instead of bagua
OTHER_PEERS = ("ft_diloco",)   # torchft's DiLoCo: a peer row, never counted as ours
FLOOR = ("alone",)             # _e2e_rows.ALONE (that module imports torch): never ours either


def bw_label(bw) -> str:
    if bw is None:
        return "unshaped"
    return f"{bw / 1000:g} Gbit/s" if bw >= 1000 else f"{bw:g} Mbit/s"


def cell(r: dict) -> tuple:
    """The network a run measured: ``(bandwidth_mbit, latency_ms)`` (latency 0: none)."""
    return r["bandwidth_mbit"], r.get("latency_ms") or 0


def cell_label(c: tuple) -> str:
    """``"100 Mbit/s"``, or ``"100 Mbit/s, 50 ms"`` with a one-way latency."""
    bw, lat = c
    return bw_label(bw) + (f", {lat:g} ms" if lat else "")


def cells(runs: list[dict]) -> list[tuple]:
    """The cells of ``runs``, in the order they were run."""
    out = []
    for r in runs:
        if cell(r) not in out:
            out.append(cell(r))
    return out


def _ddp(runs: list[dict], c: tuple) -> dict | None:
    for r in runs:
        if cell(r) == c and r["algorithm"] == "ddp" and r["status"] == "ok":
            return r
    return None


def time_to_loss(curve, target: float):
    """Wall time of the first held-out evaluation at or below ``target`` (None: never)."""
    for _step, t, loss in curve or []:
        if loss <= target:
            return t
    return None


def add_ratios(runs: list[dict]) -> None:
    """Add the ratios to DDP of the same cell (bandwidth and latency) and run, times as a
    multiple of DDP's (< 1: sooner): ``step_x_ddp_time`` (the time of a sample, DDP's
    throughput / this run's), ``loss_vs_ddp`` (held-out loss after N steps),
    ``ddp_loss_target`` (DDP's loss after N steps), ``time_to_ddp_loss_s`` (wall time to
    reach it; None if never within the budget) and ``tta_x_ddp_time`` (this run's time to
    DDP's loss / DDP's)."""
    for r in runs:
        ddp = _ddp(runs, cell(r))
        ok = r["status"] == "ok" and ddp is not None
        r["step_x_ddp_time"] = (ddp["samples_per_s"] / r["samples_per_s"]
                                if ok and r["samples_per_s"] else None)
        r["loss_vs_ddp"] = r["loss"] / ddp["loss"] if ok else None
        r["ddp_loss_target"] = ddp["loss"] if ok else None
        r["time_to_ddp_loss_s"] = time_to_loss(r.get("eval_curve"), ddp["loss"]) if ok else None
    for r in runs:
        ddp = _ddp(runs, cell(r))
        t, t_ddp = r["time_to_ddp_loss_s"], ddp and ddp["time_to_ddp_loss_s"]
        r["tta_x_ddp_time"] = t / t_ddp if t and t_ddp else None


def _best(runs, c, names) -> dict | None:
    """The run among ``names`` in cell ``c`` that reached DDP's loss soonest."""
    cands = [r for r in runs if cell(r) == c and r["algorithm"] in names
             and r.get("time_to_ddp_loss_s") is not None]
    return min(cands, key=lambda r: r["time_to_ddp_loss_s"]) if cands else None


def _diloco_targets(add, runs, by, c, ddp, hosts) -> None:
    """Issue 24's: the best DiLoCo row (the rule's H or a sweep row) reaches DDP's loss in
    <= 0.2x DDP's time and no later than torchft's DiLoCo; each DiLoCo row at the H the rule
    chose for its bytes sends <= 1/50 of DDP's bytes per step."""
    rows = [a for (cc, a) in by if cc == c
            and a.split("@")[0] in ("diloco", "diloco_u8", "diloco_u4")]
    best = _best(runs, c, rows)
    t_ddp = ddp.get("time_to_ddp_loss_s")
    if rows and t_ddp:
        v = best["time_to_ddp_loss_s"] / t_ddp if best else None
        add(f"DiLoCo time to DDP's loss vs DDP's, {hosts} hosts", c,
            best["algorithm"] if best else "diloco", v, "<= 0.2", v is not None and v <= 0.2)
    peer = by.get((c, "ft_diloco"))
    if rows and peer and peer.get("time_to_ddp_loss_s"):
        v = best["time_to_ddp_loss_s"] / peer["time_to_ddp_loss_s"] if best else None
        add("DiLoCo ahead of torchft's DiLoCo (our time / its)", c,
            best["algorithm"] if best else "diloco", v, "<= 1", v is not None and v <= 1)
    for (cc, a), peer_h in by.items():
        # torchft's DiLoCo at a given H (ft_diloco@H) against ours at that H (diloco@H, the
        # same float32 outer gradient and outer optimizer): one implementation against the
        # other, the plan held equal
        if cc != c or a.partition("@")[0] != "ft_diloco" or not a.partition("@")[2]:
            continue
        ours = by.get((c, "diloco@" + a.partition("@")[2]))
        if ours and ours.get("time_to_ddp_loss_s") and peer_h.get("time_to_ddp_loss_s"):
            v = ours["time_to_ddp_loss_s"] / peer_h["time_to_ddp_loss_s"]
            add(f"DiLoCo ahead of torchft's DiLoCo at the same H={peer_h.get('sync_every')} "
                "(our time / its)", c, ours["algorithm"], v, "<= 1", v <= 1)
    from _e2e_rows import OUTER_BYTES

    for name in ("diloco", "diloco_u8", "diloco_u4"):     # each at the H the rule gave it
        ours = by.get((c, name))
        if not (ours and ours.get("sync_every")):
            continue
        h = ours["sync_every"]
        if (ours.get("window_steps") or 0) >= h and ours.get("bytes_per_step") \
                and ddp.get("bytes_per_step"):
            v, how = ours["bytes_per_step"] / ddp["bytes_per_step"], "measured"
        else:
            # The window held no sync (0 bytes measured): one model-sized allreduce (DDP's
            # bytes of one step, times the outer gradient's compression) every H steps.
            v, how = OUTER_BYTES.get(name, 1.0) / h, "one allreduce per H steps"
        add(f"DiLoCo bytes per step vs DDP's at the chosen H={h} ({how})", c, name, v,
            "<= 0.02", v <= 0.02)


def _sparse_targets(add, runs, by, c, hosts) -> None:
    """Issue 27's: the best TopK/LowRank row reaches DDP's loss sooner than ByteGrad; the
    ``topk`` row sends no more bytes a step than torch's PowerSGD hook; the ``low_rank`` row
    (the hook's rank) reaches DDP's loss no later than the hook."""
    rows = [a for (cc, a) in by if cc == c and a.startswith(("topk", "low_rank"))]
    best, bg = _best(runs, c, rows), by.get((c, "bytegrad"))
    if rows and bg and bg.get("time_to_ddp_loss_s"):
        v = best["time_to_ddp_loss_s"] / bg["time_to_ddp_loss_s"] if best else None
        add(f"best TopK/LowRank sooner to DDP's loss than ByteGrad (its time / ByteGrad's), "
            f"{hosts} hosts", c, best["algorithm"] if best else "-", v, "< 1",
            v is not None and v < 1)
    hook, topk, low = by.get((c, "ddp_powersgd")), by.get((c, "topk")), by.get((c, "low_rank"))
    if hook and topk and hook.get("bytes_per_step") and topk.get("bytes_per_step") is not None:
        v = topk["bytes_per_step"] / hook["bytes_per_step"]
        add("TopK bytes per step vs the PowerSGD hook's", c, "topk", v, "<= 1", v <= 1)
    if hook and low and hook.get("time_to_ddp_loss_s"):
        t = low.get("time_to_ddp_loss_s")
        v = t / hook["time_to_ddp_loss_s"] if t else None
        add("LowRank no later to DDP's loss than the PowerSGD hook (its time / the hook's)", c,
            "low_rank", v, "<= 1", v is not None and v <= 1)


def check_targets(runs: list[dict], headline: str | None = None) -> list[dict]:
    """The targets of issue 16 (and the earlier ones), each with the measured value and
    whether it is met.  They are performance goals: a target not met is a finding of the
    run, not a failure of it.

    A time "to DDP's loss" is to ``headline`` when the run has one (the first target the
    ``alone`` row does not reach: before it, training without communicating is a contender
    and wins the shallow targets, issue 44), else to DDP's loss after N steps; each goal
    says which (``at``).  ``alone`` is the floor, never one of "our" rows."""
    if headline is not None:
        runs = [{**r, "time_to_ddp_loss_s": (r.get("time_to_target_s") or {}).get(headline)}
                for r in runs]
    at = headline or "ddp@N"
    out = []

    def add(what, c, algo, value, need, ok):
        out.append({"target": what, "bandwidth_mbit": c[0], "latency_ms": c[1],
                    "algorithm": algo, "value": value, "need": need, "met": bool(ok),
                    "at": at})

    by = {(cell(r), r["algorithm"]): r for r in runs if r["status"] == "ok"}
    bagua = sorted(r for r in {r["algorithm"] for r in runs} - {"ddp", *FLOOR, *DDP_PEERS}
                   if r.partition("@")[0] not in OTHER_PEERS)   # ft_diloco@H too
    for c in cells(runs):
        bw = c[0]
        ddp = by.get((c, "ddp"))
        if ddp is None:
            continue
        hosts = ddp["world_size"] // (ddp.get("procs_per_host") or 1)
        if bw == 100 and hosts >= 4:
            dec = [by[(c, a)] for a in ("decentralized", "decentralized_shift_one")
                   if (c, a) in by]
            if dec:
                # 1.5x DDP's throughput: a sample in <= 1/1.5 of DDP's time
                best = min(dec, key=lambda r: r["step_x_ddp_time"])
                v = best["step_x_ddp_time"]
                add(f"Decentralized time of a sample vs DDP's, {hosts} hosts", c,
                    best["algorithm"], v, "<= 0.67", v <= 1 / 1.5)
                t_dec = _best(runs, c, ("decentralized", "decentralized_shift_one"))
                if c[1] >= 50 and ddp.get("time_to_ddp_loss_s"):
                    v = (t_dec["time_to_ddp_loss_s"] / ddp["time_to_ddp_loss_s"]
                         if t_dec else None)
                    add(f"Decentralized reaches DDP's loss sooner than DDP, {hosts} hosts "
                        f"(its time / DDP's)", c, t_dec["algorithm"] if t_dec else "-", v,
                        "< 1", v is not None and v < 1)
        if bw == 100 and hosts >= 4:
            _diloco_targets(add, runs, by, c, ddp, hosts)
            _sparse_targets(add, runs, by, c, hosts)
        hier, flat = by.get((c, "bytegrad")), by.get((c, "bytegrad_flat"))
        if bw is not None and hier and flat and (ddp.get("procs_per_host") or 1) > 1:
            # 1.3x flat's throughput: a sample in <= 1/1.3 of flat's time
            v = flat["samples_per_s"] / hier["samples_per_s"]
            add("hierarchical ByteGrad vs flat ByteGrad (time of a sample)", c, "bytegrad", v,
                "<= 0.77", v <= 1 / 1.3)
        t_ddp = ddp.get("time_to_ddp_loss_s")
        ours = _best(runs, c, bagua)
        if bw is not None and t_ddp and ddp["comm_s"] >= 0.5 * ddp["step_s"]:
            v = ours["time_to_ddp_loss_s"] / t_ddp if ours else None
            add("best bagua time to DDP's loss vs DDP's time (comm >= half of DDP's step)",
                c, ours["algorithm"] if ours else "-", v, "<= 0.5", v is not None and v <= 0.5)
        peer = _best(runs, c, DDP_PEERS)
        if peer is not None:
            ok = ours is not None and ours["time_to_ddp_loss_s"] <= peer["time_to_ddp_loss_s"]
            v = (ours["time_to_ddp_loss_s"] / peer["time_to_ddp_loss_s"]) if ours else None
            add(f"no DDP-hook peer sooner than our best ({ours['algorithm'] if ours else 'none'}"
                f"'s time / {peer['algorithm']}'s)", c,
                ours["algorithm"] if ours else "-", v, "<= 1", ok)
        if c == (None, 0) and (c, "gradient_allreduce") in by:
            # >= 0.95x DDP's throughput: a sample in <= 1/0.95 of DDP's time
            s = by[(c, "gradient_allreduce")]["step_x_ddp_time"]
            add("unshaped GradientAllReduce time of a sample vs DDP's", c, "gradient_allreduce",
                s, "<= 1.05", s is not None and s <= 1 / 0.95)
    return out


def verdict(runs: list[dict], targets: list[dict]) -> list[str]:
    """Plain lines: did every run measure, which targets passed and which did not."""
    bad = [r for r in runs if r["status"] != "ok"]
    lines = [f"runs: {len(runs) - len(bad)} of {len(runs)} measured" + (
        "" if not bad else " (" + ", ".join(f"{cell_label(cell(r))} "
                                             f"{r['algorithm']}: {r['status']}" for r in bad)
        + ")")]
    met = [t for t in targets if t["met"]]
    lines.append(f"goals: {len(met)} of {len(targets)} met" + (
        "" if len(met) == len(targets) else
        " (the others are performance goals this run did not reach, listed above; the job "
        "itself ran)"))
    return lines


_COLUMNS = [("bandwidth", "left"), ("latency", "right"), ("algorithm", "left"), ("mode", "left"),
            ("MB/st/rk", "right"), ("step ms", "right"), ("compute", "right"),
            ("loss@N", "right"), ("to H s", "right"), ("steps to H", "right"),
            ("x DDP's time at H", "right"), ("bound s", "right"), ("eff", "right")]


def _mode(r: dict) -> str:
    from _e2e_rows import mode_note

    if r.get("auto_choice"):     # with_bagua(..., "auto"): what it chose
        c = r["auto_choice"]
        kw = c.get("kwargs") or {}
        if "sync_every" in kw:   # DiLoCo: no gradient buckets
            bits = ", 4-bit" if "UInt4" in str(kw.get("compressor")) else ""
            note = f"chose {c['algorithm']}, H={kw['sync_every']}{bits}"
        else:
            note = f"chose {c['algorithm']}" + (f", {c['bucket_size'] / 2**20:.0f} MiB buckets"
                                                if c.get("bucket_size") else "")
        if c.get("probe_s") is not None:     # its probe, counted in its time
            note += f"; its {c['probe_s']:.1f}s probe counted in its time"
        if c.get("compute_s") is not None:   # auto_wrap: chosen after timing its first steps
            note += f" after timing {1e3 * c['compute_s']:.0f}-ms steps"
            if c.get("measured_beside_s") is not None:    # its probe ran beside those steps
                note += (f" (at step {c.get('chosen_at_step')}, its {c['measured_beside_s']:.1f}s "
                         f"measurement beside them); its {c['setup_s']:.1f}s wrap counted in "
                         f"its time")
            else:
                note += f"; its {c['setup_s']:.1f}s probe and wrap counted in its time"
        return note

    note = mode_note(r["algorithm"], r.get("procs_per_host") or 1,
                     powersgd_rank=r.get("powersgd_rank") or 2, warmup=r.get("warmup") or 2,
                     async_interval_ms=r.get("sync_interval_ms"),
                     sync_every=r.get("sync_every"), overlap_steps=r.get("overlap_steps"))
    if r.get("window_syncs") is not None:    # the throughput window's whole sync periods
        k = r["window_syncs"]
        note += (f", {k} sync{'s' * (k != 1)} in {r['window_steps']} st" if k
                 else f", no sync in its {r['window_steps']}-step window")
    if r["algorithm"] == "async" and r.get("async_rounds_in_window") is not None:
        note += f", {r['async_rounds_in_window']} avg/{r['window_steps']} st"
    if r.get("bytes_source") == "accounted":
        note += " (acc.)"
    return note


def _lat(r: dict) -> str:
    return f"{r.get('latency_ms') or 0:g} ms"


def _rows(runs: list[dict]) -> list[list[str]]:
    """The markdown table's rows (H: the run's headline target, ``headline``)."""
    rows = []
    ddp = {cell(r): r for r in runs if r["algorithm"] == "ddp" and r["status"] == "ok"}
    for r in runs:
        if r["status"] != "ok":
            rows.append([bw_label(r["bandwidth_mbit"]), _lat(r), r["algorithm"],
                         f"{r['status']}: {r.get('reason') or ''}", *["-"] * 9])
            continue
        h = r.get("headline")
        t = (r.get("time_to_target_s") or {}).get(h)
        t_ddp = ((ddp.get(cell(r)) or {}).get("time_to_target_s") or {}).get(h)
        k = (r.get("steps_to_target") or {}).get(h)
        star = "*" if str(r.get("loss_over", "")).startswith("mean") else ""
        rows.append([bw_label(r["bandwidth_mbit"]), _lat(r), r["algorithm"], _mode(r),
                     f"{r['bytes_per_step'] / 1e6:.2f}", f"{r['step_s'] * 1e3:.0f}",
                     f"{r['compute_s'] * 1e3:.0f}", f"{r['loss']:.3f}{star}",
                     "-" if t is None else f"{t:.1f}", "-" if k is None else str(k),
                     f"{t / t_ddp:.2f}" if t and t_ddp else "-",
                     "-" if r.get("bound_s") is None else f"{r['bound_s']:.1f}",
                     "-" if r.get("efficiency") is None else f"{r['efficiency']:.2f}"])
    return rows


def markdown(runs: list[dict]) -> str:
    """The table as GitHub markdown (for benchmarks/e2e/README.md)."""
    head = [c for c, _ in _COLUMNS]
    lines = ["| " + " | ".join(head) + " |",
             "|" + "|".join("---" if j == "left" else "---:" for _, j in _COLUMNS) + "|"]
    for row in _rows(runs):
        lines.append("| " + " | ".join(re.sub(r"\[/?[a-z]*\]", "", c) for c in row) + " |")
    return "\n".join(lines)


def _style(algo: str, k: int) -> dict:
    if algo == "ddp":  # drawn last, thick and dashed, so an identical curve cannot hide it
        return {"color": "black", "ls": "--", "lw": 2.2, "zorder": 5}
    if algo in DDP_PEERS:
        return {"color": {"ddp_fp16": "0.45", "ddp_powersgd": "0.7"}[algo], "ls": "-.",
                "lw": 1.6, "zorder": 4}
    palette = ["C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9", "tab:olive", "navy",
               "maroon"]  # no grey: the DDP peers are grey
    return {"color": palette[k % len(palette)], "ls": "-", "lw": 1.4, "zorder": 3}


def ran(runs: list[dict]) -> list[str]:
    """The rows the plot draws: those measured in at least one cell, in order."""
    out = []
    for r in runs:
        if r["status"] == "ok" and r["algorithm"] not in out:
            out.append(r["algorithm"])
    return out


def plot(runs: list[dict], path: Path, subtitle: str = "", targets=None,
         headline: str | None = None) -> Path | None:
    """Per cell, held-out loss against wall time (the headline target dotted, each run's time
    to reach it marked, the compute-only bound a vertical line); then each row's efficiency
    at the headline (bound / its time; bars).  Only rows that ran are drawn."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bws, algos = cells(runs), ran(runs)
    target = next((t for t in targets or [] if t["name"] == headline), None)
    ours = [a for a in algos if a != "ddp" and a not in DDP_PEERS]   # colours only
    styles = {a: _style(a, ours.index(a) if a in ours else 0) for a in algos}
    n = len(bws)
    fig, axes = plt.subplots(1, n + 1, figsize=(4.6 * n + 6.8, 4.8), squeeze=False,
                             gridspec_kw={"width_ratios": [1] * n + [1.25]})
    handles = {}
    for ax, bw in zip(axes[0], bws):
        ddp = _ddp(runs, bw)
        tmax, lo = 0.0, float("inf")
        for r in runs:
            if cell(r) != bw or r["status"] != "ok" or not r.get("eval_curve"):
                continue
            c = r["eval_curve"]
            (line,) = ax.plot([p[1] for p in c], [p[2] for p in c], marker=".", ms=3,
                              label=r["algorithm"], **styles[r["algorithm"]])
            handles[r["algorithm"]] = line
            tmax = max(tmax, c[-1][1])
            lo = min(lo, *(p[2] for p in c))
            t = (r.get("time_to_target_s") or {}).get(headline)
            if t is not None and target is not None:
                ax.plot([t], [target["loss"]], "o", mfc="none", ms=7,
                        color=styles[r["algorithm"]]["color"], zorder=6)
        if ddp is not None and target is not None:
            ax.axhline(target["loss"], color="black", ls=":", lw=1)
            ax.annotate(f"headline: DDP's loss after {target['ddp_steps']} steps",
                        (0, target["loss"]), xycoords=("axes fraction", "data"),
                        xytext=(3, 3), textcoords="offset points", fontsize=7)
            if ddp.get("bound_s"):
                ax.axvline(ddp["bound_s"], color="green", ls="--", lw=1)
                ax.annotate(f"bound {ddp['bound_s']:.1f}s", (ddp["bound_s"], 0.02),
                            xycoords=("data", "axes fraction"), xytext=(2, 2),
                            textcoords="offset points", fontsize=7, color="green")
            wall = ddp.get("wall_s")
            if wall and wall <= tmax:
                ax.axvline(wall, color="grey", ls=":", lw=1)
                ax.annotate(f"T={wall:g}s", (wall, 1), xycoords=("data", "axes fraction"),
                            xytext=(2, -10), textcoords="offset points", fontsize=7,
                            color="grey")
        if target is not None and lo < float("inf"):
            # the part of the curves where the targets at depth lie (the first minute's
            # fall from the initial loss would flatten it): the shallowest target's loss
            # at the top, the lowest loss any row reached at the bottom
            top = max(t["loss"] for t in targets) * 1.1
            bottom = min(lo, target["loss"])
            ax.set_ylim(bottom - 0.05 * (top - bottom), top)
        ax.set_title(f"held-out loss vs wall time, {cell_label(bw)}", fontsize=9)
        ax.set_xlabel("training wall time (s); o = reaches the headline target")
        ax.set_ylabel("held-out loss (mean of the ranks' models)")
    ax = axes[0][-1]
    shown = list(algos)
    width = 0.8 / max(1, len(bws))
    for j, bw in enumerate(bws):
        vals, notes = [], []
        for a in shown:
            r = next((r for r in runs if cell(r) == bw and r["algorithm"] == a),
                     None) or {"status": "absent"}
            vals.append(r.get("efficiency") or 0.0)
            notes.append("not reached" if r["status"] == "ok" else f"did not run ({r['status']})")
        ys = [k + (j - (len(bws) - 1) / 2) * width for k in range(len(shown))]
        bars = ax.barh(ys, vals, height=width * 0.95, color=f"C{j}", alpha=0.55 + 0.45 * (
            j == 0), label=cell_label(bw))
        for b, v, note in zip(bars, vals, notes):
            ax.annotate(note if v == 0 else f"{v:.2f}",
                        (v, b.get_y() + b.get_height() / 2),
                        xytext=(2, 0), textcoords="offset points", va="center", fontsize=6)
    ax.axvline(1.0, color="black", lw=1)
    ax.set_yticks(range(len(shown)), shown, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("efficiency: compute-only bound / time to the headline (1 = the limit)")
    ax.set_title(f"how close each row gets to the physical limit ({headline})", fontsize=9)
    ax.legend(title="link", fontsize=7, title_fontsize=7, loc="upper left",
              bbox_to_anchor=(1.0, 1.0))
    order = [a for a in algos if a in handles]
    ncol = min(6, max(1, len(order)))
    fig.legend([handles[a] for a in order], order, loc="lower center", ncol=ncol,
               fontsize=7, frameon=False)
    if subtitle:
        fig.suptitle(subtitle, fontsize=9)
    # room under the axes for the legend's rows, so that it covers no x label
    legend_rows = -(-len(order) // ncol)
    fig.tight_layout(rect=(0, min(0.45, 0.03 + 0.045 * legend_rows), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class PlainConsole:
    """The two rich.Console methods e2e.py uses, for machines without rich: the same keyword
    arguments (``markup=False`` prints brackets as they are; the others have no plain form)."""

    def print(self, *objs, markup: bool = True, **_rich_only) -> None:
        strip = (lambda s: re.sub(r"\[/?[a-z ]*\]", "", s)) if markup else (lambda s: s)
        print(*(strip(str(o)) for o in objs), flush=True)

    log = print
