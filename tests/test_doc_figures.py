"""One source for every figure the documentation quotes: docs/results.json.

The benchmarks write their runs into it (``--results``, benchmarks/_results.py; the writers are
tested in tests/test_results_writers.py).

A *quoted figure* is a number in prose followed by a unit of something measured: ``x`` (a
ratio), ``ms``, ``s``, ``%``, ``MB/s``, ``GB/s``, ``Mbit/s`` or ``samples/s`` (``0.47x``,
``27.3 s``, ``1.5-2.3x``). Prose is a page's text outside fenced code blocks, inline code spans
and link targets; image alt text and tables count. The pages are README.md, docs/**/*.md and
packages/*/README.md.

docs/results.json lists, per page, every figure that page quotes, and names the runs behind the
headline figures. A page that quotes a figure not in the file fails, and so does an entry no page
quotes any more: after re-running a benchmark with ``--results``, update the page and the
per-page lists together (``python tests/test_doc_figures.py --update`` rewrites them from the
pages; the headline entries are edited by hand, with the run and the path of the figure in it).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.json"
PAGES = ([ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
         + sorted(ROOT.glob("packages/*/README.md")))
FIGURE = re.compile(r"(?<![\w.\-/])(\d+(?:[.,]\d+)*(?:\s*[-\u2013]\s*\d+(?:\.\d+)?)?)\s?"
                    r"(x|ms|s|%|MB/s|GB/s|Mbit/s|samples/s)(?![\w/])")
NUMBER_WORDS = {6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten", 11: "eleven",
                12: "twelve"}


def prose(text: str) -> str:
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)]*\)", "]", text)


def figures(page: Path) -> list[str]:
    """The quoted figures of a page, in order of first appearance, each once."""
    found = [re.sub(r"\s+", " ", m.group(0)) for m in FIGURE.finditer(prose(page.read_text()))]
    return list(dict.fromkeys(found))


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_parser():
    probe = ROOT / "docs" / "_probe_figures.md"
    try:
        probe.write_text("in **0.47x DDP's time** (27.3 s), 1.8-2.3x, 90 %\n"
                         "`--wall-seconds 5s` [a](b.md#x-2x) v0.3.0 8x8 matrix 12 samples/s\n"
                         "```\n3.09x\n```\n")
        assert figures(probe) == ["0.47x", "27.3 s", "1.8-2.3x", "90 %", "12 samples/s"]
    finally:
        probe.unlink()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_quoted_figure_is_in_results_json(page):
    listed = json.loads(RESULTS.read_text())["pages"].get(_name(page), [])
    quoted = figures(page)
    missing = [f for f in quoted if f not in listed]
    assert not missing, (f"{_name(page)} quotes figures that docs/results.json does not list: "
                         f"{missing}")
    stale = [f for f in listed if f not in quoted]
    assert not stale, f"docs/results.json lists figures {_name(page)} no longer quotes: {stale}"


def test_headline_figures_name_their_run_and_appear_where_said():
    results = json.loads(RESULTS.read_text())
    for key, h in results["headline"].items():
        run = results["runs"][h["run"]]
        assert run["command"].startswith("python benchmarks/") and run["date"], key
        for page in h["quoted_on"]:
            assert h["value"] in figures(ROOT / page), f"{page} does not quote {key}={h['value']}"


def test_bytegrad_has_one_speed_up_per_target():
    """ByteGrad's time to a DDP loss is one number per target from one run wherever the docs
    give it (the headline entries: DDP's loss after 30 steps, 2026-11-25; after 80, the target
    training alone misses, 2026-11-29); the figures of older runs and the other direction
    ("2.14x", "1.55x sooner") are gone."""
    headline = json.loads(RESULTS.read_text())["headline"]
    values = {headline[k]["value"] for k in ("bytegrad_time_to_ddp_loss",
                                             "bytegrad_time_to_headline")}
    for page in PAGES:
        text = prose(page.read_text())
        for sentence in re.split(r"(?<=[.:;])\s|\n\n", text):
            if "ByteGrad" in sentence and "DDP's time" in sentence and "in that run" not in sentence:
                said = re.findall(r"(\d+\.\d+x) DDP's time", sentence)
                assert all(s in values for s in said
                           if "ByteGrad" in sentence.split(s)[0][-80:]), (_name(page), sentence)
        for old in ("2.09x", "2.13x", "2.14x", "3.09x", "1.55x sooner"):
            assert old not in text, f"{_name(page)} still quotes ByteGrad's older {old}"


def test_ratios_against_ddp_go_one_way():
    """Times are quoted as a multiple of DDP's ("0.47x DDP's time", < 1: sooner), never the
    other way round ("2.14x sooner", "DDP's / row's")."""
    other_way = re.compile(r"\d(?:\.\d+)?x sooner|DDP's / row's|DDP's time divided by|TTA xDDP"
                           r"|speed-up over DDP")
    bad = [(_name(p), m.group(0)) for p in PAGES for m in other_way.finditer(prose(p.read_text()))]
    assert not bad, bad



def test_benchmark_readmes_put_ratios_as_times():
    """The benchmarks' own READMEs (their run-by-run history included) say a ratio as a
    multiple of a time ("0.77x flat ByteGrad's time"), never "1.3x faster" or "1.38x sooner";
    the output tables they quote from older runs are left as those runs printed them."""
    pages = sorted((ROOT / "benchmarks").rglob("README.md"))
    assert pages
    other_way = re.compile(r"\d(?:\.\d+)?x (?:sooner|faster)")
    bad = [(str(p.relative_to(ROOT)), m.group(0)) for p in pages
           for m in other_way.finditer(prose(p.read_text()))]
    assert not bad, bad


def test_the_number_of_algorithms_is_said_one_way():
    # the installed package (never src/ on sys.path: the ranks later tests spawn inherit the
    # parent's sys.path and would import bagua_comm without its compiled kernels)
    pytest.importorskip("bagua_algos")                # registers the algorithms
    from bagua_algos.algorithm import _REGISTRY

    word = NUMBER_WORDS[len(_REGISTRY)]
    said = re.compile(r"\b(\w+)\s+(?:registered\s+)?algorithms\b|\bAll (\w+) run\b", re.I)
    counts = set(NUMBER_WORDS.values())
    wrong = [(_name(p), m.group(0)) for p in PAGES for m in said.finditer(prose(p.read_text()))
             if (m.group(1) or m.group(2) or "").lower() in counts | {str(n) for n in NUMBER_WORDS}
             and (m.group(1) or m.group(2)).lower() != word]
    assert not wrong, f"the registry holds {word} algorithms: {wrong}"


def _update() -> None:
    results = json.loads(RESULTS.read_text())
    results["pages"] = {_name(p): figures(p) for p in PAGES if figures(p)}
    RESULTS.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__" and "--update" in sys.argv:
    _update()


def test_headline_matches_its_run():
    """Each headline figure is the value at ``figure`` (a path) in its run's recorded figures."""
    results = json.loads(RESULTS.read_text())
    for key, h in results["headline"].items():
        value = results["runs"][h["run"]]["figures"]
        for step in h["figure"]:
            value = value[step]
        assert h["value"] == f"{value:.2f}x", key


def test_every_run_says_where_it_comes_from():
    """A run names its benchmark (a file in the repository), the command line, the date, the
    machine and its figures: what benchmarks/_results.py writes."""
    for name, run in json.loads(RESULTS.read_text())["runs"].items():
        assert (ROOT / run["benchmark"]).is_file(), name
        assert run["command"].startswith("python benchmarks/"), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", run["date"]), name
        assert run["machine"] and run["figures"], name


def _agrees(shown: str, value: float) -> bool:
    """``shown`` (``"0.15x"``, ``"5.6"``) is ``value`` rounded to the digits it shows."""
    text = shown.strip().strip("*").rstrip("x")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(float(text) - value) <= 0.5 * 10 ** -decimals + 1e-9


def _table_rows(page: Path, header_start: str) -> list[list[str]]:
    lines = page.read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith(header_start))
    rows = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().replace("`", "") for c in line.strip("|").split("|")])
    return rows


@pytest.mark.parametrize("page", ["docs/fused-optimizer.md", "packages/bagua-optim/README.md"])
def test_fused_optimizer_tables_are_their_runs_times(page):
    """The fused-optimizer tables quote ours as a multiple of torch's (or the plain optimizer's)
    time, as recorded in docs/results.json's runs, never the inverse ("x faster")."""
    runs = json.loads(RESULTS.read_text())["runs"]
    vs = runs["fused-optimizer-vs-fused-2026-11-25"]["figures"]["vs_fused"]
    rows = _table_rows(ROOT / page, "| parameters | ours: `fuse_optimizer(...)`")
    checked = 0
    for shape, label, in_place, new in rows:
        labels = [x.strip() for x in re.sub(r"\s*\(exact[^)]*\)$", "", label).split(" / ")]
        for form, cell in (("grads in place", in_place), ("new grads", new)):
            for lab, shown in zip(labels, cell.split(" / "), strict=True):
                want = vs[f"{shape.split(' (')[0]} | {lab} | {form}"]["x_torch_time"]
                assert _agrees(shown, want), (page, shape, lab, form, shown, want)
                checked += 1
    assert checked == len(vs)
    modes = runs["fused-optimizer-modes-2026-11-21"]["figures"]["modes"]
    for model, opt, mode, plain, fused, ratio in _table_rows(
            ROOT / page, "| model | optimizer | mode | plain | fused | x plain's time |"):
        rec = modes[" | ".join(x for x in (model, opt, mode) if x)]
        assert (float(plain), float(fused)) == (rec["plain_ms"], rec["fused_ms"])
        assert _agrees(ratio.split(" (")[0], rec["x_plain_time"]), (page, model, opt, mode)
    assert not re.search(r"\d(\.\d+)?x faster|speed-up \|", prose((ROOT / page).read_text()))


def test_gpu_fused_optimizer_table_is_its_runs_times():
    rec = json.loads(RESULTS.read_text())["runs"]["gpu-optim-h200-2026-11-27"]["figures"]["rows"]
    rows = _table_rows(ROOT / "docs" / "gpu.md", "| parameters | optimizer | foreach ms |")
    assert len(rows) == len(rec)
    for (_, opt, f_ms, u_ms, o_ms, x_foreach, x_fused), r in zip(rows, rec):
        assert opt == r["optimizer"] and float(o_ms) == r["ours ms"]
        assert _agrees(x_foreach, r["x foreach"]) and _agrees(x_fused, r["x fused"]), opt
        assert _agrees(x_foreach, float(o_ms) / float(f_ms))
        assert _agrees(x_fused, float(o_ms) / float(u_ms))
