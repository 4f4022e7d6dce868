"""ctypes restatement of the NCCL net-plugin tables and properties (versions 6 to 12).

The layouts mirror ``csrc/net_abi.h``; :mod:`bagua_net.testing` uses them to drive the plugin
exactly as NCCL does.
"""

from __future__ import annotations

import ctypes as C

VERSIONS = (6, 7, 8, 9, 10, 11, 12)
HANDLE_SIZE = 128
PTR_HOST = 1

vp = C.c_void_p
pp = C.POINTER(C.c_void_p)
res = C.c_int
LOGGER = C.CFUNCTYPE(None, C.c_int, C.c_ulong, C.c_char_p, C.c_int, C.c_char_p, C.c_char_p)
"""The plugin always logs as ``log(level, flags, file, line, "%s", message)``."""

_COMMON = [("name", C.c_char_p), ("pciPath", C.c_char_p), ("guid", C.c_uint64),
           ("ptrSupport", C.c_int)]
_V6_TAIL = [("speed", C.c_int), ("port", C.c_int), ("latency", C.c_float),
            ("maxComms", C.c_int), ("maxRecvs", C.c_int)]
_DEVTYPE = [("netDeviceType", C.c_int), ("netDeviceVersion", C.c_int)]


class _VProps4(C.Structure):
    _fields_ = [("ndevs", C.c_int), ("devs", C.c_int * 4)]


class _VProps8(C.Structure):
    _fields_ = [("ndevs", C.c_int), ("devs", C.c_int * 8)]


def _props(name, fields):
    return type(name, (C.Structure,), {"_fields_": fields})


_V9 = [*_COMMON, ("regIsGlobal", C.c_int), ("forceFlush", C.c_int), *_V6_TAIL, *_DEVTYPE]
PROPS = {
    6: _props("Props6", _COMMON + _V6_TAIL),
    7: _props("Props7", _COMMON + _V6_TAIL + _DEVTYPE),
    8: _props("Props8", [*_COMMON, ("regIsGlobal", C.c_int), *_V6_TAIL, *_DEVTYPE]),
    9: _props("Props9", [*_V9, ("vProps", _VProps4), ("maxP2pBytes", C.c_size_t),
                         ("maxCollBytes", C.c_size_t)]),
    11: _props("Props11", [*_V9, ("vProps", _VProps4), ("maxP2pBytes", C.c_size_t),
                           ("maxCollBytes", C.c_size_t), ("maxMultiRequestSize", C.c_int)]),
    12: _props("Props12", [*_V9, ("vProps", _VProps8), ("maxP2pBytes", C.c_size_t),
                           ("maxCollBytes", C.c_size_t), ("maxMultiRequestSize", C.c_int),
                           ("railId", C.c_int16), ("planeId", C.c_int16)]),
}
PROPS[10] = PROPS[9]

_SLOTS_V6 = ["init", "devices", "getProperties", "listen", "connect", "accept", "regMr",
             "regMrDmaBuf", "deregMr", "isend", "irecv", "iflush", "test", "closeSend",
             "closeRecv", "closeListen"]
_SLOTS_V7 = [*_SLOTS_V6, "getDeviceMr", "irecvConsumed"]
_SLOTS_V9 = [*_SLOTS_V7, "makeVDevice"]
_SLOTS_V11 = [*_SLOTS_V9, "finalize", "setNetAttr"]
SLOTS = {6: _SLOTS_V6, 7: _SLOTS_V7, 8: _SLOTS_V7, 9: _SLOTS_V9, 10: _SLOTS_V9,
         11: _SLOTS_V11, 12: _SLOTS_V11}


def table_type(version: int) -> type[C.Structure]:
    """The function table of ``ncclNetPlugin_v<version>`` as a struct of raw pointers."""
    fields = [("name", C.c_char_p)] + [(s, vp) for s in SLOTS[version]]
    return type(f"NetV{version}", (C.Structure,), {"_fields_": fields})


def prototypes(version: int) -> dict[str, type]:
    """ctypes prototypes of the slots the driver calls, for one version."""
    v = version
    size = C.c_int if v < 9 else C.c_size_t
    sizes = C.POINTER(size)
    f = C.CFUNCTYPE
    if v < 10:
        init = f(res, LOGGER)
    elif v == 10:
        init = f(res, LOGGER, vp)
    else:
        init = f(res, pp, C.c_uint64, vp, LOGGER, vp)
    if v >= 11:
        listen = f(res, vp, C.c_int, vp, pp)
        connect = f(res, vp, C.c_int, vp, pp, pp)
    elif v == 10:
        listen = f(res, C.c_int, vp, pp)
        connect = f(res, C.c_int, vp, vp, pp, pp)
    else:
        listen = f(res, C.c_int, vp, pp)
        connect = f(res, C.c_int, vp, pp) if v == 6 else f(res, C.c_int, vp, pp, pp)
    accept = f(res, vp, pp) if v == 6 else f(res, vp, pp, pp)
    reg = f(res, vp, vp, C.c_int if v < 8 else C.c_size_t, C.c_int, pp)
    if v >= 10:
        isend = f(res, vp, vp, size, C.c_int, vp, vp, pp)
        irecv = f(res, vp, C.c_int, pp, sizes, C.POINTER(C.c_int), pp, pp, pp)
    else:
        isend = f(res, vp, vp, size, C.c_int, vp, pp)
        irecv = f(res, vp, C.c_int, pp, sizes, C.POINTER(C.c_int), pp, pp)
    out = {
        "init": init, "devices": f(res, C.POINTER(C.c_int)),
        "getProperties": f(res, C.c_int, C.POINTER(PROPS[v])), "listen": listen,
        "connect": connect, "accept": accept, "regMr": reg, "deregMr": f(res, vp, vp),
        "isend": isend, "irecv": irecv,
        "iflush": f(res, vp, C.c_int, pp, C.POINTER(C.c_int), pp, pp),
        "test": f(res, vp, C.POINTER(C.c_int), C.POINTER(C.c_int)),
        "closeSend": f(res, vp), "closeRecv": f(res, vp), "closeListen": f(res, vp),
    }
    if v >= 11:
        out["finalize"] = f(res, vp)
    return out
