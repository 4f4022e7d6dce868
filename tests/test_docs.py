"""The documentation site: every page in mkdocs.yml's nav exists, and every figure a page embeds
is in the repository and is a real image (a page that shows a broken picture fails CI, not the
reader)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# ![alt](path "title") and <img src="path">
_MD_IMAGE = re.compile(r"!\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_IMAGE = re.compile(r"<img\s[^>]*src=[\"']([^\"']+)[\"']", re.IGNORECASE)
_MAGIC = {".png": b"\x89PNG\r\n\x1a\n", ".svg": b"<", ".jpg": b"\xff\xd8", ".jpeg": b"\xff\xd8"}


def images(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.S)      # code blocks show syntax, not images
    return _MD_IMAGE.findall(text) + _HTML_IMAGE.findall(text)


def test_parser_finds_both_syntaxes():
    page = "a ![loss](img/a.png) b <img alt='x' src=\"img/b.svg\"> ```![no](c.png)```"
    tmp = DOCS / "_probe_not_a_page.md"
    try:
        tmp.write_text(page)
        assert images(tmp) == ["img/a.png", "img/b.svg"]
    finally:
        tmp.unlink()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_embedded_figure_exists(page):
    for ref in images(page):
        assert not re.match(r"[a-z]+://", ref), f"{page.name}: {ref} is remote; commit the figure"
        path = (page.parent / ref.split("#")[0]).resolve()
        assert path.is_file(), f"{page.relative_to(ROOT)} embeds {ref}, which does not exist"
        magic = _MAGIC.get(path.suffix.lower())
        assert magic is not None, f"{ref}: use .png, .svg or .jpg"
        head = path.read_bytes()[:16].lstrip()
        assert head.startswith(magic), f"{ref} is not a {path.suffix} file"


def test_every_committed_figure_is_shown():
    shown = {(page.parent / ref).resolve() for page in PAGES for ref in images(page)}
    orphans = [p.relative_to(ROOT) for p in sorted((DOCS / "img").glob("*"))
               if p.resolve() not in shown]
    assert not orphans, f"figures no page embeds: {orphans}"


def test_the_site_has_figures():
    assert sum(len(images(p)) for p in PAGES) >= 3, "the docs site should show its benchmarks"


def test_nav_pages_exist():
    nav = re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M)
    assert nav, "no pages found in mkdocs.yml's nav"
    missing = [p for p in nav if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml nav names missing pages: {missing}"


# The repository's own front pages (not on the site): every relative link and picture resolves.
FRONT = [ROOT / "README.md", *sorted((ROOT / "benchmarks").glob("**/README.md"))]
_MD_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@pytest.mark.parametrize("page", FRONT, ids=lambda p: str(p.relative_to(ROOT)))
def test_front_page_links_resolve(page):
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    for ref in _MD_LINK.findall(text):
        if re.match(r"[a-z]+:", ref) or ref.startswith("#"):
            continue
        path = (page.parent / ref.split("#")[0]).resolve()
        assert path.exists(), f"{page.relative_to(ROOT)} links {ref}, which does not exist"


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_first_screen_says_what_it_measured_and_shows_it(page):
    """The first screen (30 lines) of README and of the docs home: what it is, one measured
    sentence against DDP, a picture of the main job, then the two commands."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()[:30]
    at = {what: next((i for i, line in enumerate(lines) if re.search(pattern, line)), None)
          for what, pattern in (("measured", r"\d\.\d+x DDP's time"),
                                ("picture", r"!\[[^\]]+\]\((docs/)?img/main-job[\w.-]*\.png\)"),
                                ("demo", r"python3 -m nox -s demo"),
                                ("ci", r"python3 -m nox -t ci"))}
    assert None not in at.values(), f"{page}'s first 30 lines lack {at}"
    assert at["measured"] < at["picture"] < at["demo"] < at["ci"], at


@pytest.mark.parametrize("readme", sorted(ROOT.glob("packages/*/README.md")),
                         ids=lambda p: p.parent.name)
def test_package_readme_says_which_torch_to_install_first(readme):
    """``pip install ./packages/X`` into an environment without torch resolves PyPI's default
    (CUDA) torch: every README of a package that depends on torch says how to get either build
    first; one that does not says so."""
    text = readme.read_text(encoding="utf-8")
    pyproject = (readme.parent / "pyproject.toml").read_text(encoding="utf-8")
    deps = re.search(r"^dependencies\s*=\s*\[(.*?)\]", pyproject, flags=re.M | re.S)
    if deps and '"torch' in deps.group(1):
        assert "--index-url https://download.pytorch.org/whl/cpu" in text, readme
        assert "`pip install torch`" in text, readme
    else:
        assert "needs no torch" in text, readme


def test_no_reference_to_a_design_file_outside_the_repository():
    """The contract is docs/design.md, in the nav; nothing points at a file users cannot see."""
    assert "design.md" in (ROOT / "mkdocs.yml").read_text()
    files = [p for p in ROOT.rglob("*") if p.is_file() and ".git" not in p.parts
             and p.suffix in {".md", ".py", ".pyx", ".toml", ".yml", ".cfg", ""}
             and "site" not in p.parts and p.name != Path(__file__).name]
    offenders = [str(p.relative_to(ROOT)) for p in files
                 if re.search(r"DESIGN(\.md| §| defaults| contract)", p.read_text(errors="ignore"))]
    assert not offenders, offenders
