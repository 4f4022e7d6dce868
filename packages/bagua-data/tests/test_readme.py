"""The README's first snippet runs as written (with its loop body filled in)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_sampler_snippet_runs():
    code = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)[0]
    code = code.replace("        ...", "        seen.append(batch.dim())")
    ns = {"seen": []}
    exec(compile(code, str(README), "exec"), ns)
    assert ns["seen"] and set(ns["seen"]) == {2}
