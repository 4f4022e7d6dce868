"""python -m bagua_net: the plugin's location, its interfaces, and whether a libnccl loads it."""

import os
import subprocess
import sys

import pytest

import bagua_net
from bagua_net._check import check_nccl, find_libnccl


def _fake_libnccl(tmp_path, versions, name="libnccl.so.2"):
    """A file carrying the strings a libnccl probes with (what the check reads)."""
    blob = b"\x7fELF" + b"".join(f"ncclNetPlugin_v{v}\0".encode() for v in versions)
    blob += b"NCCL version 2.99.1+cuda12.9\0"
    path = tmp_path / name
    path.write_bytes(blob)
    return str(path)


def test_check_picks_the_newest_version_both_sides_know(tmp_path):
    res = check_nccl(_fake_libnccl(tmp_path, [12, 11, 10, 9, 8, 7, 6]))
    assert res.loads and res.chosen == 12 and res.nccl_version == "2.99.1"
    assert res.exported == [12, 11, 10, 9, 8, 7, 6]
    assert set(res.names.values()) == {"BaguaNet"}
    # an NCCL that still knows v5 but only up to v8 takes v8
    assert check_nccl(_fake_libnccl(tmp_path, [8, 7, 6, 5])).chosen == 8


def test_check_says_no_for_an_nccl_that_only_knows_old_versions(tmp_path):
    res = check_nccl(_fake_libnccl(tmp_path, [5, 4, 3]))
    assert not res.loads and res.chosen is None


def test_check_rejects_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match="nccl_path"):
        check_nccl(str(tmp_path / "nope.so"))


def test_check_against_an_installed_libnccl():
    path = find_libnccl()
    if path is None:
        pytest.skip("no libnccl installed (pip install nvidia-nccl-cu12 to check a real one)")
    res = check_nccl(path)
    assert res.probed and max(res.probed) >= 6
    assert res.loads and res.chosen == max(v for v in res.probed if v <= 12)


def _main(*args, env=None):
    return subprocess.run([sys.executable, "-m", "bagua_net", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_main_prints_the_plugin_interfaces_and_the_verdict(tmp_path):
    out = _main("--check-nccl", _fake_libnccl(tmp_path, [12, 11]))
    assert out.returncode == 0, out.stderr
    assert bagua_net.library_path() in out.stdout
    assert "lo " in out.stdout and "127.0.0.1" in out.stdout  # NCCL_SOCKET_IFNAME=lo
    assert "would load: yes, BaguaNet through ncclNetPlugin_v12" in out.stdout
    assert "init: ok, 1 device(s)" in out.stdout
    env = dict(os.environ, NCCL_SOCKET_IFNAME="=nosuchif0")
    none = _main("--check-nccl", _fake_libnccl(tmp_path, [12]), env=env)
    assert none.returncode == 1 and "init: fails" in none.stdout
    assert "no usable network interface" in none.stdout
    bad = _main("--check-nccl", _fake_libnccl(tmp_path, [4, 3], "old.so"))
    assert bad.returncode == 1 and "would load: no" in bad.stdout
