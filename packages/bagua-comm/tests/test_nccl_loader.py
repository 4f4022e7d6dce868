"""The lazy libnccl loader, on a machine that may have no GPU and no NCCL."""

import subprocess
import sys

import pytest

from bagua_comm import _nccl_loader


def test_import_touches_no_cuda_library():
    code = ("import sys, bagua_comm; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('cupy', 'cupy_backends')]; "
            "maps = open('/proc/self/maps').read(); "
            "assert not bad, bad; assert 'libnccl' not in maps; assert 'libcudart' not in maps")
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
