"""The binding's symbol table: every entry point resolved once at load; one an older libnccl
lacks raises a named error when the function needing it is called.

Runs against the real NCCL wheel (no GPU needed) and against stand-in libraries compiled from
``fake_nccl.c`` (an NCCL 2.27.3 and an NCCL 2.3.7 without abort, async errors or send/recv).
"""

import json
import os
import pickle
import subprocess
import sys

import pytest
from _fake_nccl import COMPILER, build

from bagua_comm import _nccl_loader

needs_cc = pytest.mark.skipif(COMPILER is None, reason="no C compiler to build the fake libnccl")


def _run(code, library):
    env = {**os.environ, "BAGUA_NCCL_LIBRARY": library}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


_TABLE = r"""
import json, bagua_comm._nccl_loader as L
n = L.load()
print(json.dumps({"symbols": n.symbols(), "version": n.version_string(),
                  "names": list(n.SYMBOLS)}))
"""


def test_every_symbol_resolves_from_the_real_wheel_at_load():
    if not _nccl_loader.nccl_available():
        pytest.skip("no libnccl (pip install nvidia-nccl-cu12 to run this)")
    lib = _nccl_loader.nccl_library_path()
    res = _run(_TABLE, lib)
    assert set(res["symbols"]) == set(res["names"])          # all looked up at load...
    assert all(res["symbols"].values()), res["symbols"]      # ...and all present in 2.2x+
    assert res["version"] == ".".join(map(str, _nccl_loader.nccl_version()))


_OLD = r"""
import json, pickle, bagua_comm._nccl_loader as L
n = L.load()
table = n.symbols()
comm = n.NcclCommunicator(1, n.get_unique_id(), 0)   # present in 2.3.7: works
out = {"table": table, "count": comm.count(), "errors": {}}
calls = {"ncclCommGetAsyncError": lambda: comm.async_error(),
         "ncclCommAbort": lambda: comm.abort(),
         "ncclSend": lambda: comm.send(0, 0, 7, 0, 0),
         "ncclRecv": lambda: comm.recv(0, 0, 7, 0, 0),
         "ncclBroadcast": lambda: comm.broadcast(0, 0, 0, 7, 0, 0)}
for name, call in calls.items():
    try:
        call()
    except n.NcclMissingSymbol as e:
        back = pickle.loads(pickle.dumps(e))
        out["errors"][name] = [str(e), e.symbol, e.version, isinstance(e, RuntimeError),
                               type(back).__name__, back.symbol, str(back) == str(e)]
comm.allreduce(0, 0, 0, 7, 0, 0)                     # present: runs
comm.destroy()
print(json.dumps(out))
"""


@needs_cc
def test_a_symbol_missing_from_an_old_nccl_raises_naming_it_and_the_version(tmp_path):
    lib = build(tmp_path, old=True)
    res = _run(_OLD, lib)
    absent = {k for k, v in res["table"].items() if not v}
    assert {"ncclCommAbort", "ncclCommGetAsyncError", "ncclSend", "ncclRecv",
            "ncclGetLastError", "ncclBroadcast"} <= absent
    assert res["table"]["ncclAllReduce"] and res["count"] == 1
    assert set(res["errors"]) == {"ncclCommGetAsyncError", "ncclCommAbort", "ncclSend",
                                  "ncclRecv", "ncclBroadcast"}
    for name, (msg, sym, version, is_rt, back_type, back_sym, same) in res["errors"].items():
        assert sym == name and version == "2.3.7" and is_rt and same
        assert back_type == "NcclMissingSymbol" and back_sym == name
        assert name in msg and "libnccl 2.3.7" in msg and lib in msg
    assert "NCCL >= 2.7" in res["errors"]["ncclSend"][0]
    assert "NCCL >= 2.4" in res["errors"]["ncclCommAbort"][0]


@needs_cc
def test_a_library_without_the_core_entry_points_is_refused(tmp_path):
    src = tmp_path / "notnccl.c"
    src.write_text("int ncclGetVersion(int *v) { *v = 22703; return 0; }\n")
    lib = tmp_path / "libnotnccl.so"
    subprocess.run([COMPILER, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    code = ("import bagua_comm._nccl as n\n"
            f"try:\n    n.load_library({str(lib)!r})\n"
            "except OSError as e:\n    print(repr(str(e)))\n"
            "assert n.library_path() is None and n.symbols() == {}\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert "is not libnccl" in out and "ncclGetUniqueId" in out and "ncclGetErrorString" in out


def test_missing_symbol_error_pickles_without_a_library():
    from bagua_comm._nccl import NcclError, NcclMissingSymbol

    err = NcclMissingSymbol("ncclCommAbort", "2.3.7", "/x/libnccl.so.2")
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, NcclError) and back.status == -1 and str(back) == str(err)
    assert "ncclCommAbort" in str(err) and "2.3.7" in str(err) and "NCCL >= 2.4" in str(err)
