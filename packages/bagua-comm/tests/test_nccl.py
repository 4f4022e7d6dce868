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


_SCENARIOS = r"""
import json, os, tempfile, warnings
import torch, torch.distributed as dist, bagua_comm as bc, bagua_comm._nccl_loader as L

def init(backend, env=None):
    os.environ.pop("BAGUA_COMM_BACKEND", None)
    os.environ.update(env or {})
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        bc.init_process_group(backend, store=store, rank=0, world_size=1)
    t = torch.ones(2)
    bc.allreduce_inplace(t)
    out = [bc.get_backend(), " | ".join(str(x.message) for x in w if "nccl" in str(x.message)),
           t.tolist()]
    bc.destroy_process_group()
    return out

res = {"nccl": init("nccl"), "auto": init("auto"),
       "env gloo": init("auto", {"BAGUA_COMM_BACKEND": "gloo"})}
torch.cuda.is_available = lambda: True          # a GPU machine without libnccl
L.candidates = lambda: [("system", "libnccl-missing.so.2")]
res["cuda, no libnccl"] = init("auto")
print(json.dumps(res))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_backend_selection_and_fallback_to_gloo():
    import json

    res = json.loads(_run(_SCENARIOS).stdout)
    backend, warning, result = res["nccl"]  # asked for nccl on a CPU machine
    assert backend == "gloo" and result == [1.0, 1.0]
    assert "falling back to gloo" in warning and "pip install" in warning
    assert res["auto"] == ["gloo", "", [1.0, 1.0]]  # the normal CPU case: no warning
    assert res["env gloo"] == ["gloo", "", [1.0, 1.0]]
    backend, warning, _ = res["cuda, no libnccl"]
    assert backend == "gloo" and "libnccl was not found" in warning
    assert "pip install 'bagua-comm[cu12]'" in warning and "nvidia-nccl-cu12" in warning


# Libraries named like CUDA's that this process maps: with a CUDA build of torch (the lowest
# torch on PyPI), ``import torch`` maps libcudart and libnccl itself, so only what importing
# bagua_comm adds on top of torch counts.
_CUDA_LIBS = ("import re\n"
              "def cuda_libs():\n"
              "    return set(re.findall(r'[^ /]*lib(?:nccl|cudart)[^ /\\n]*', "
              "open('/proc/self/maps').read()))\n")


def test_gpu_modules_import_no_cuda_library():
    code = (_CUDA_LIBS + "import sys, torch\nbefore = cuda_libs()\n"
            "import bagua_comm._backends.nccl, bagua_comm.compression._minmax_cupy\n"
            "assert not [m for m in sys.modules if m.startswith('cupy')]\n"
            "assert cuda_libs() <= before, cuda_libs() - before\n")
    _run(code)
