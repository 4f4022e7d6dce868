"""The NCCL binding where no GPU is needed: library, version, unique id, errors, fallback.

Tests that need libnccl skip when it is absent (``pip install nvidia-nccl-cu12`` runs them;
the wheel loads on a CPU-only machine).
"""

import os
import pickle
import subprocess
import sys

import pytest
import torch

from bagua_comm import _nccl_loader

needs_lib = pytest.mark.skipif(not _nccl_loader.nccl_available(),
                               reason="no libnccl (pip install nvidia-nccl-cu12 to run this)")


def _run(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=120, env={**os.environ, **env})


def test_nccl_error_carries_status_and_message_and_pickles():
    from bagua_comm._nccl import NcclError

    err = NcclError(5, "invalid usage: something")
    assert isinstance(err, RuntimeError)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is NcclError and back.status == 5 and back.message == err.message
    assert str(back) == "NCCL error 5: invalid usage: something"


def test_without_the_library_error_strings_fall_back_to_the_code():
    code = ("import bagua_comm._nccl as n\n"
            "assert n.library_path() is None\n"
            "print(n.error_string(3))\n"
            "try:\n    n.get_unique_id()\nexcept RuntimeError as e:\n    print(e)\n")
    out = _run(code).stdout
    assert out.splitlines()[0] == "status 3"
    assert "libnccl is not loaded" in out


@needs_lib
def test_version_and_unique_ids():
    major, minor, patch = _nccl_loader.nccl_version()
    assert (major, minor) >= (2, 18) and patch >= 0
    nccl = _nccl_loader.load()
    a, b = nccl.get_unique_id(), nccl.get_unique_id()
    assert isinstance(a, bytes) and len(a) == len(b) == 128 and a != b


@needs_lib
def test_error_strings_are_nccls_own():
    nccl = _nccl_loader.load()
    assert nccl.error_string(0) == "no error"
    assert "invalid argument" in nccl.error_string(4)
    assert "invalid usage" in nccl.error_string(5)


@needs_lib
def test_communicator_arguments_are_checked_before_nccl():
    nccl = _nccl_loader.load()
    with pytest.raises(ValueError, match="unique_id must be 128 bytes"):
        nccl.NcclCommunicator(1, b"short", 0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, nranks=2\)"):
        nccl.NcclCommunicator(2, nccl.get_unique_id(), 2)


@needs_lib
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the failure without a GPU")
def test_communicator_without_a_gpu_raises_ncclerror_with_nccls_detail():
    nccl = _nccl_loader.load()
    with pytest.raises(nccl.NcclError) as info:
        nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    err = info.value
    assert err.status != 0 and err.message and str(err).startswith(f"NCCL error {err.status}")
    assert pickle.loads(pickle.dumps(err)).status == err.status


_INIT = ("import warnings, tempfile, os, torch.distributed as dist, bagua_comm as bc\n"
         "{patch}"
         "s = dist.FileStore(os.path.join(tempfile.mkdtemp(), 's'), 1)\n"
         "with warnings.catch_warnings(record=True) as w:\n"
         "    warnings.simplefilter('always')\n"
         "    bc.init_process_group({backend!r}, store=s, rank=0, world_size=1)\n"
         "print(bc.get_backend())\n"
         "print('|'.join(str(x.message) for x in w if 'nccl' in str(x.message)))\n"
         "t = __import__('torch').ones(2); bc.allreduce_inplace(t); print(t.tolist())\n")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_nccl_requested_without_cuda_falls_back_to_gloo_with_a_warning():
    out = _run(_INIT.format(patch="", backend="nccl")).stdout.splitlines()
    assert out[0] == "gloo"
    assert "falling back to gloo" in out[1] and "pip install" in out[1]
    assert out[2] == "[1.0, 1.0]"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_auto_without_cuda_is_gloo_silently():
    out = _run(_INIT.format(patch="", backend="auto")).stdout.splitlines()
    assert out[0] == "gloo" and out[1] == ""


def test_auto_with_cuda_but_no_libnccl_warns_with_the_pip_command():
    patch = ("import torch, bagua_comm._nccl_loader as L\n"
             "torch.cuda.is_available = lambda: True\n"
             "L.candidates = lambda: [('system', 'libnccl-missing.so.2')]\n")
    out = _run(_INIT.format(patch=patch, backend="auto")).stdout.splitlines()
    assert out[0] == "gloo"
    assert "libnccl was not found" in out[1]
    assert "pip install 'bagua-comm[cu12]'" in out[1] and "nvidia-nccl-cu12" in out[1]


def test_env_override_selects_gloo():
    out = _run(_INIT.format(patch="", backend="auto"), BAGUA_COMM_BACKEND="gloo").stdout
    assert out.splitlines()[0] == "gloo"


def test_gpu_modules_import_no_cuda_library():
    code = ("import sys, bagua_comm._nccl_ops, bagua_comm._minmax_cupy\n"
            "assert not [m for m in sys.modules if m.startswith('cupy')]\n"
            "assert 'libnccl' not in open('/proc/self/maps').read()\n")
    _run(code)
