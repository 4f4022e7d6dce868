"""The lazy libnccl loader, on a machine that may have no GPU and no NCCL."""

import subprocess
import sys

import pytest

from bagua_comm import _nccl_loader

# Libraries named like CUDA's that this process maps: with a CUDA build of torch (the lowest
# torch on PyPI), ``import torch`` maps libcudart and libnccl itself, so only what importing
# bagua_comm adds on top of torch counts.
_CUDA_LIBS = ("import re\n"
              "def cuda_libs():\n"
              "    return set(re.findall(r'[^ /]*lib(?:nccl|cudart)[^ /\\n]*', "
              "open('/proc/self/maps').read()))\n")


def test_import_touches_no_cuda_library():
    code = (_CUDA_LIBS + "import sys, torch\nbefore = cuda_libs()\nimport bagua_comm\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')]\n"
            "assert not bad, bad\nassert cuda_libs() <= before, cuda_libs() - before\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_explicit_bad_library_path_is_an_error_that_names_it(monkeypatch, tmp_path):
    fake = tmp_path / "libnccl.so.2"
    fake.write_bytes(b"not a library")
    code = ("import bagua_comm._nccl_loader as L\n"
            "try:\n    L.load()\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**__import__("os").environ, "BAGUA_NCCL_LIBRARY": str(fake)},
                         check=True).stdout
    assert "BAGUA_NCCL_LIBRARY" in out and str(fake) in out


def test_search_order_starts_with_the_environment(monkeypatch):
    monkeypatch.setenv("BAGUA_NCCL_LIBRARY", "/opt/x/libnccl.so.2")
    cands = _nccl_loader.candidates()
    assert cands[0] == ("BAGUA_NCCL_LIBRARY", "/opt/x/libnccl.so.2")
    assert cands[-1] == ("system", "libnccl.so.2")


def test_missing_library_message_names_the_pip_command():
    code = ("import bagua_comm._nccl_loader as L\n"
            "L.candidates = lambda: [('system', 'libnccl-does-not-exist.so')]\n"
            "assert not L.nccl_available()\n"
            "try:\n    L.load()\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "pip install" in out and "nvidia-nccl-cu12" in out


def test_version_when_the_wheel_is_installed():
    if not _nccl_loader.nccl_available():
        pytest.skip("no libnccl here (pip install nvidia-nccl-cu12 to run this)")
    major, minor, _patch = _nccl_loader.nccl_version()
    assert major == 2 and minor >= 18
    from bagua_comm import _nccl

    assert _nccl.library_path() == _nccl_loader.nccl_library_path()


def _tree(root, *files):
    """Fake site-packages: empty files at the given relative paths; returns nvidia/ root."""
    for rel in files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    return str(root / "nvidia")


def test_wheel_search_covers_the_cu12_and_cu13_layouts(tmp_path):
    # nvidia-nccl-cu12 and nvidia-nccl-cu13 2.32 both ship nvidia/nccl/lib/libnccl.so.2
    # (checked against the real wheels); other CUDA 13 wheels use nvidia/cu13/lib.
    cu12 = _tree(tmp_path / "a", "nvidia/nccl/lib/libnccl.so.2",
                 "nvidia_nccl_cu12-2.27.3.dist-info/METADATA")
    cu13 = _tree(tmp_path / "b", "nvidia/nccl/lib/libnccl.so.2",
                 "nvidia_nccl_cu13-2.32.3.dist-info/METADATA")
    split = _tree(tmp_path / "c", "nvidia/cu13/lib/libnccl.so.2", "nvidia/cu12/lib/libnccl.so.2")
    lib = "nccl/lib/libnccl.so.2"
    roots = [cu12, cu13, split]
    # torch built for CUDA 13: the cu13 wheels first, then unknown, then cu12; stable within.
    assert _nccl_loader._from_wheels(roots, "13") == [
        f"{cu13}/{lib}", f"{split}/cu13/lib/libnccl.so.2", f"{cu12}/{lib}",
        f"{split}/cu12/lib/libnccl.so.2"]
    assert _nccl_loader._from_wheels(roots, "12") == [
        f"{cu12}/{lib}", f"{split}/cu12/lib/libnccl.so.2", f"{cu13}/{lib}",
        f"{split}/cu13/lib/libnccl.so.2"]
    # CPU torch: site-packages order, each root's layouts in WHEEL_LAYOUTS order.
    assert _nccl_loader._from_wheels(roots, "") == [
        f"{cu12}/{lib}", f"{cu13}/{lib}", f"{split}/cu13/lib/libnccl.so.2",
        f"{split}/cu12/lib/libnccl.so.2"]
    assert _nccl_loader._from_wheels([str(tmp_path / "none")], "13") == []


def test_candidates_order_env_process_wheels_system(monkeypatch):
    monkeypatch.setenv("BAGUA_NCCL_LIBRARY", "/env/libnccl.so.2")
    monkeypatch.setattr(_nccl_loader, "_mapped_in_process", lambda: "/proc/libnccl.so.2")
    monkeypatch.setattr(_nccl_loader, "_from_wheels", lambda: ["/w1/libnccl.so.2"])
    assert _nccl_loader.candidates() == [
        ("BAGUA_NCCL_LIBRARY", "/env/libnccl.so.2"), ("process", "/proc/libnccl.so.2"),
        ("wheel", "/w1/libnccl.so.2"), ("system", "libnccl.so.2")]


def test_install_hint_names_both_cuda_extras():
    assert "bagua-comm[cu12]" in _nccl_loader.INSTALL_HINT
    assert "bagua-comm[cu13]" in _nccl_loader.INSTALL_HINT
    assert "nvidia-nccl-cu13" in _nccl_loader.INSTALL_HINT
