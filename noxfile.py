"""Sessions for the bagua monorepo (same names for every package).

    nox -s tests-bagua-comm      build one package's wheel, install it alone (plus what it
                                 declares) in a fresh venv, run its own tests
    nox -t tests                 the five of them
    nox -s integration           all five installed together, top-level tests/
    nox -s lint                  ruff, cython-lint, import-linter contracts
    nox -s build-bagua-net       sdist + wheel, installed into a fresh venv and imported
    nox -t ci                    everything CI runs (README's test command)
    nox -s docs                  the documentation site (mkdocs build --strict)
    nox -s bench | demo | gpu    benchmarks (benchmarks/*/), the main job, GPU tests (gpu is off
                                 by default)
    nox -s lowest-bagua-data     the package's declared floors (``torch>=2.4`` -> ``torch==2.4``)
                                 as pip constraints, then its tests; ``nox -t lowest`` for all
                                 (not in CI: old torch on PyPI is a multi-GB CUDA build)

Arguments after ``--`` reach pytest (or the benchmark script).  Torch is always installed
first from ``BAGUA_NOX_TORCH`` (default ``torch==2.13.0``, from pip's configured index:
set ``PIP_INDEX_URL=https://download.pytorch.org/whl/cpu`` for the CPU build), so no unpinned
requirement can pull a CUDA build.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ["bagua-comm", "bagua-algos", "bagua-optim", "bagua-data", "bagua-net"]
# Siblings each package needs, installed by path before it (docs/design.md section 2).
# bagua-optim is bagua-algos' optional extra; its tests use it (QAdam with fuse_optimizer).
SIBLINGS = {"bagua-algos": ["bagua-comm", "bagua-optim"]}
TORCH = os.environ.get("BAGUA_NOX_TORCH", "torch==2.13.0")
# The NCCL wheel loads without a GPU: with it, the binding's CPU-side tests (library, version,
# unique ids, error strings, the plugin check) run in CI instead of skipping. BAGUA_NOX_NCCL=0
# leaves it out.
NCCL = os.environ.get("BAGUA_NOX_NCCL", "nvidia-nccl-cu12")
NEEDS_NCCL = {"bagua-comm", "bagua-net"}
# Extras a package's own tests install (bagua-algos tests its Lightning strategy too).
TEST_EXTRAS = {"bagua-algos": "test,lightning"}
NEEDS_TORCH = {"bagua-comm", "bagua-algos", "bagua-optim", "bagua-data"}  # torch first, pinned

nox.options.default_venv_backend = "venv"
nox.options.sessions = ["lint", *(f"tests-{p}" for p in PACKAGES), "integration"]
nox.options.reuse_existing_virtualenvs = False


def _pkg(name: str) -> str:
    return str(ROOT / "packages" / name)


def _import_name(package: str) -> str:
    return package.replace("-", "_")


def _install_torch(session: nox.Session) -> None:
    session.install(TORCH)


def _install(session: nox.Session, package: str, extras: str = "") -> None:
    """Install ``package`` from its path (non-editable) after its siblings."""
    for sib in SIBLINGS.get(package, []):
        session.install(_pkg(sib))
    session.install(f"{_pkg(package)}{extras}")


def _pytest(session: nox.Session, *paths: str, gpu: bool = False, slow: bool = False) -> None:
    args = list(session.posargs) or ["-q"]
    skip = [m for m, run in (("gpu", gpu), ("slow", slow)) if not run]
    if skip:
        args += ["-m", " and ".join(f"not {m}" for m in skip)]
    # Tests import the installed packages: src/ is never on sys.path (src layout).
    session.run("pytest", *[str(ROOT / p) for p in paths], *args,
                env={"PYTHONDONTWRITEBYTECODE": "1"})


def _build(session: nox.Session, package: str) -> Path:
    """Build ``package``'s sdist, then its wheel from that sdist; return the wheel."""
    session.install("build")
    dist = Path(session.create_tmp()) / "dist"
    if dist.exists():
        for old in dist.iterdir():
            old.unlink()
    session.run("python", "-m", "build", "--outdir", str(dist), _pkg(package), silent=True)
    wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        session.error(f"expected one wheel and one sdist in {dist}, found {wheels + sdists}")
    if package == "bagua-net" and wheels[0].name.endswith("-none-any.whl"):
        session.error("bagua-net must be a platform wheel (it carries a C library)")
    session.log(f"built {wheels[0].name} and {sdists[0].name}")
    return wheels[0]


def _check_import_alone(session: nox.Session, package: str, python: str = "python") -> None:
    """``import bagua_x`` works from site-packages and pulls in no other bagua package."""
    name = _import_name(package)
    allowed = [name, *map(_import_name, SIBLINGS.get(package, []))]
    check = (f"import sys, {name}; "
             f"others = sorted(m for m in sys.modules if m.startswith('bagua_') "
             f"and m.split('.')[0] not in {allowed!r}); "
             f"assert not others, others; "
             f"assert 'site-packages' in {name}.__file__, {name}.__file__; "
             f"print({name}.__name__, {name}.__version__, {name}.__file__)")
    session.run(python, "-c", check, external=True)


def _make_tests(package: str):
    def tests(session: nox.Session) -> None:
        wheel = _build(session, package)
        if package in NEEDS_TORCH:
            _install_torch(session)
        for sib in SIBLINGS.get(package, []):
            session.install(_pkg(sib))
        session.install(f"{wheel}[{TEST_EXTRAS.get(package, 'test')}]")
        _check_import_alone(session, package)
        if package in NEEDS_NCCL and NCCL != "0":
            session.install(NCCL)
        _pytest(session, f"packages/{package}/tests")

    tests.__doc__ = (f"{package}: build its wheel, install it alone (plus what it declares) in a "
                     "fresh venv, run its tests.")
    return tests


def _make_build(package: str):
    def build(session: nox.Session) -> None:
        wheel = _build(session, package)
        # The metadata PyPI would render (README as long description, classifiers, license).
        session.install("twine>=6")
        session.run("twine", "check", "--strict", *map(str, sorted(wheel.parent.iterdir())))
        # A fresh venv with nothing from this repo but the wheel (and its declared siblings).
        venv = Path(session.create_tmp()) / "fresh"
        session.run("python", "-m", "venv", "--clear", str(venv))
        py = str(venv / "bin" / "python")
        pip = [py, "-m", "pip", "install", "-q"]
        if package in NEEDS_TORCH:
            session.run(*pip, TORCH, external=True)
        for sib in SIBLINGS.get(package, []):
            session.run(*pip, _pkg(sib), external=True)
        session.run(*pip, str(wheel), external=True)
        _check_import_alone(session, package, py)

    build.__doc__ = (f"Build {package}'s sdist and wheel, twine-check both, install the wheel "
                     "alone in a fresh venv and import it.")
    return build


for _p in PACKAGES:
    nox.session(name=f"tests-{_p}", tags=["tests", "ci"])(_make_tests(_p))
    nox.session(name=f"build-{_p}", tags=["build"])(_make_build(_p))


def _floors(package: str) -> list[str]:
    """``name==X`` for each runtime dependency of ``package`` declared as ``name>=X``."""
    import tomllib  # Python >= 3.11; only this session needs it (nox itself runs on 3.10)

    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    pins = []
    for req in meta["project"].get("dependencies", []):
        m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)\s*", req.split(";")[0])
        if m and m.group(1) not in SIBLINGS.get(package, []):
            pins.append(f"{m.group(1)}=={m.group(2)}")
    return pins


def _make_lowest(package: str):
    def lowest(session: nox.Session) -> None:
        pins = [pin for p in [*SIBLINGS.get(package, []), package] for pin in _floors(p)]
        constraints = Path(session.create_tmp()) / "constraints-lowest.txt"
        constraints.write_text("".join(f"{pin}\n" for pin in pins))
        session.log(f"lowest versions: {', '.join(pins) or 'none declared'}")
        # The pins first, alone, so that pip cannot pick anything newer for them.
        if pins:
            session.install(*pins)
        for sib in SIBLINGS.get(package, []):
            session.install("-c", str(constraints), _pkg(sib))
        session.install("-c", str(constraints),
                        f"{_pkg(package)}[{TEST_EXTRAS.get(package, 'test')}]")
        session.run("python", "-c", "import importlib.metadata as m, sys; "
                    "[print(n, m.version(n)) for n in sys.argv[1:]]",
                    *[pin.split("==")[0] for pin in pins], silent=False)
        if package in NEEDS_NCCL and NCCL != "0":
            session.install("-c", str(constraints), NCCL)
        _pytest(session, f"packages/{package}/tests")

    lowest.__doc__ = (f"{package} against the lowest versions its pyproject declares "
                      "(each '>=X' pinned to '==X'), then its tests.")
    return lowest


for _p in PACKAGES:
    nox.session(name=f"lowest-{_p}", tags=["lowest"])(_make_lowest(_p))


@nox.session(tags=["ci"])
def integration(session: nox.Session) -> None:
    """All five packages installed together: the full-stack tests in tests/."""
    _install_torch(session)
    # rich and matplotlib so that the e2e test checks the real table and PNG.
    session.install("pytest>=8", "pytest-timeout>=2.3", "numpy", "rich", "matplotlib")
    for p in PACKAGES:
        session.install(_pkg(p))
    # lightning: examples/lightning_train.py; ft: the restart-free kill-and-heal scenario
    # (tests/test_ft.py; its longer fault scenarios are marked slow: `nox -s ft` runs them)
    session.install(f"{_pkg('bagua-algos')}[lightning,ft]")
    # accelerate: examples/accelerate_bytegrad.py (ByteGrad through DDP's comm hook)
    session.install("accelerate")
    _pytest(session, "tests")


@nox.session(default=False)
def ft(session: nox.Session) -> None:
    """Every restart-free fault-tolerance scenario on torchft, the slow ones included."""
    _install_torch(session)
    session.install("pytest>=8", "pytest-timeout>=2.3", "numpy")
    for p in PACKAGES:
        session.install(_pkg(p))
    session.install(f"{_pkg('bagua-algos')}[ft]")
    _pytest(session, "tests/test_ft.py", "tests/test_ft_heal.py", "tests/test_ft_faults.py",
            "packages/bagua-algos/tests/test_ft_api.py",
            "packages/bagua-algos/tests/test_lightning_ft.py", slow=True)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    """ruff, cython-lint, and import-linter (the dependency rules of docs/design.md section 2)."""
    session.install("ruff", "cython-lint", "import-linter")
    session.run("ruff", "check", ".")
    pyx = sorted(str(p) for p in ROOT.glob("packages/*/src/**/*.pyx"))
    pxd = sorted(str(p) for p in ROOT.glob("packages/*/src/**/*.pxd"))
    if pyx or pxd:
        session.run("cython-lint", "--max-line-length", "100", *pyx, *pxd)
    src = os.pathsep.join(str(p) for p in sorted(ROOT.glob("packages/*/src")))
    session.run("lint-imports", env={"PYTHONPATH": src})


@nox.session(tags=["ci"])
def docs(session: nox.Session) -> None:
    """The documentation site (docs/, mkdocs.yml), built with warnings as errors.

    The API pages are generated from the packages' docstrings by static analysis, so neither
    torch nor the packages need installing; only docs/requirements.txt (pinned).
    """
    session.install("-r", str(ROOT / "docs" / "requirements.txt"))
    site = Path(session.create_tmp()) / "site"
    session.run("mkdocs", "build", "--strict", "--clean", "--config-file",
                str(ROOT / "mkdocs.yml"), "--site-dir", str(site),
                env={"NO_MKDOCS_2_WARNING": "1"})
    session.log(f"site built in {site}")


# What the benchmarks need beyond the packages: the plot and the live table (each benchmark
# also finishes without them), and sklearn's digits for the accuracy studies.
BENCH_EXTRAS = ["matplotlib", "rich", "tqdm"]
STUDY_EXTRAS = ["scikit-learn"]


def _install_stack(session: nox.Session) -> None:
    _install_torch(session)
    session.install(*BENCH_EXTRAS)
    for p in PACKAGES:
        session.install(_pkg(p))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job, quick: torch DDP, its peers and bagua's algorithms on 4 emulated hosts, to a
    loss training alone misses (docs/main-job.md#results)."""
    _install_stack(session)
    session.install(f"{_pkg('bagua-algos')}[ft]")    # the ft_diloco row: torchft's own DiLoCo
    session.run("python", str(ROOT / "benchmarks" / "e2e" / "e2e.py"), "--quick",
                "--json", "out/e2e/quick.json", "--plot", "out/e2e/quick.png", *session.posargs)


# benchmarks/: one folder per story (benchmarks/README.md); every script not starting with "_" in
# these folders is an entry point.  gpu/ has its own kit (nox -s gpu, benchmarks/gpu/run.sh).
BENCH_DIRS = ["micro", "e2e", "ft", "studies"]
# Entry points without a --quick mode (the accuracy studies, autotune): nox's short arguments.
BENCH_QUICK = {
    "autotune.py": ["--bandwidths", "none", "--steps", "12"],
    "diloco_digits.py": ["--seeds", "1"],
    "qadam_digits.py": ["--seeds", "1"],
    "sparse_digits.py": ["--seeds", "1", "--epochs", "2"],
    "low_rank_vs_powersgd.py": ["--steps", "10"],
}


def bench_scripts() -> list[Path]:
    """Every benchmark entry point, folder by folder (the top-level shims are not in the list)."""
    return [p for d in BENCH_DIRS for p in sorted((ROOT / "benchmarks" / d).glob("*.py"))
            if not p.name.startswith("_")]


@nox.session
def bench(session: nox.Session) -> None:
    """Every benchmark's quick mode, folder by folder (benchmarks/README.md), each against its peer.

    The entry points are the scripts in benchmarks/{micro,e2e,ft,studies}/ not starting with "_".
    """
    _install_stack(session)
    session.install(*STUDY_EXTRAS)
    scripts = bench_scripts()
    if not scripts:
        session.error(f"no entry points in benchmarks/{{{','.join(BENCH_DIRS)}}}/")
    for script in scripts:
        quick = BENCH_QUICK.get(script.name, ["--quick"])
        session.log(f"== {script.relative_to(ROOT)} {' '.join(quick)}")
        session.run("python", str(script), *quick, *session.posargs)


@nox.session(venv_params=["--system-site-packages"], default=False)
def gpu(session: nox.Session) -> None:
    """The gpu-marked tests with BAGUA_TEST_GPU=1 (they fail instead of skipping).

    The venv sees the machine's own CUDA build of torch (system site-packages); bagua-comm is
    installed with the extra for torch's CUDA major version (``cu12`` or ``cu13``: CuPy and the
    NCCL wheel; ``BAGUA_NOX_CUDA=12|13`` overrides).  One pytest per package (each has its own
    conftest and helpers).  Without nox or a registry: ``bash benchmarks/gpu/run.sh tests``.
    """
    cuda = os.environ.get("BAGUA_NOX_CUDA") or session.run(
        "python", "-c", "try:\n import torch; print((torch.version.cuda or 'cpu').split('.')[0])\n"
        "except ImportError:\n print('no torch')",
        silent=True).strip()
    if cuda not in ("12", "13"):
        session.error(f"torch here is not a CUDA 12/13 build (torch.version.cuda major: "
                      f"{cuda!r}); set BAGUA_NOX_CUDA=12|13 to force an extra")
    session.install("pytest>=8", "pytest-timeout>=2.3", "numpy")
    session.install(f"{_pkg('bagua-comm')}[cu{cuda}]")
    for p in PACKAGES[1:]:
        session.install(_pkg(p))
    for p in PACKAGES:
        session.run("pytest", "-m", "gpu", "-p", "no:cacheprovider",
                    str(ROOT / "packages" / p / "tests"), *session.posargs,
                    env={"BAGUA_TEST_GPU": "1"}, success_codes=[0, 5])
