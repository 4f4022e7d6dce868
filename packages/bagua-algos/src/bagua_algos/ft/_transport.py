"""The heal transport of ``FaultTolerant``: torchft's ``CheckpointTransport`` interface,
authenticated with a per-job secret, carrying tensors and plain data only.

torchft's own HTTP transport serves the full state to whoever asks and loads what it
receives with ``torch.load(weights_only=False)`` (a pickle: code runs on the joiner).  Here:

- the sender serialises the state when torchft asks it to send (a consistent snapshot) and
  refuses anything but dicts, lists, tuples, str, int, float, bool, None, tensors, dtypes
  and devices;
- a request must carry ``HMAC(secret, "request" | step | nonce | time)``: without the secret a
  peer gets nothing (403), a request seen before or older than ``_FRESH_S`` is refused;
- the answer carries ``HMAC(secret, "answer" | step | nonce | payload)``, checked before the
  payload is read, then loaded with ``torch.load(weights_only=True)``.

The payload travels in the clear (HTTP): the secret authenticates, it does not encrypt;
see docs/fault-tolerance.md for the trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import logging
import os
import secrets
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler

import torch

logger = logging.getLogger("bagua_algos.ft")

SECRET_ENV = "BAGUA_FT_SECRET"
_FRESH_S = 300.0            # a request older (or newer: clock skew) than this is refused
_PLAIN = (torch.Tensor, str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)


class SecretRefused(PermissionError):
    """The running job refused this replica's heal request: its secret is another one."""


def job_secret(secret) -> bytes:
    """The job's secret: ``secret`` (str or bytes) or the ``BAGUA_FT_SECRET`` variable."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV)
    if isinstance(secret, str):
        secret = secret.encode()
    if not isinstance(secret, bytes) or len(secret) < 16:
        raise ValueError(
            "secret must be the job's shared secret, at least 16 bytes (str or bytes), given "
            f"as FaultTolerant(secret=...) or in the {SECRET_ENV} environment variable, the "
            "same on every replica: it authenticates the heal transfer and the group, got "
            f"{'nothing' if secret is None else f'{len(secret)} bytes' if isinstance(secret, bytes) else type(secret).__name__}")
    return secret


def check_plain(obj, path: str = "state") -> None:
    """Raise TypeError naming the first value that is not a tensor or plain data."""
    if isinstance(obj, _PLAIN):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{path}: key {k!r} is a {type(k).__name__}, not str or int")
            check_plain(v, f"{path}/{k}")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            check_plain(v, f"{path}/{i}")
        return
    raise TypeError(f"{path} is a {type(obj).__module__}.{type(obj).__qualname__}: the heal "
                    "transfer carries tensors and plain data only (dict, list, tuple, str, "
                    "int, float, bool, None)")


def _mac(secret: bytes, *parts) -> str:
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for p in parts:
        h.update(p if isinstance(p, bytes) else str(p).encode())
        h.update(b"\x00")
    return h.hexdigest()


def make_transport(secret: bytes, timeout: timedelta):
    """An :class:`AuthenticatedTransport` that is a torchft ``CheckpointTransport`` (torchft
    imported here, lazily)."""
    from torchft.checkpointing.transport import CheckpointTransport

    class Transport(AuthenticatedTransport, CheckpointTransport):
        pass

    return Transport(secret, timeout)


class AuthenticatedTransport:
    """torchft's ``CheckpointTransport`` methods (see :func:`make_transport`)."""

    def __init__(self, secret: bytes, timeout: timedelta):
        self._secret = secret
        self._timeout = timeout
        self._lock = threading.Condition()
        self._staged: tuple[int, bytes] | None = None
        self._seen: dict[str, float] = {}
        from torchft.http import _IPv6HTTPServer

        self._server = _IPv6HTTPServer(("::", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="bagua_ft_heal")
        self._thread.start()

    # -- serving ------------------------------------------------------------------------------
    def _handler(self):
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):        # no line per request on stderr
                pass

            def do_GET(self):
                code, body, mac = transport._answer(self.path)
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                if mac:
                    self.send_header("X-Bagua-Mac", mac)
                self.end_headers()
                self.wfile.write(body)

        return Handler

    def _answer(self, path: str) -> tuple[int, bytes, str]:
        url = urllib.parse.urlsplit(path)
        q = urllib.parse.parse_qs(url.query)
        try:
            step = int(url.path.rsplit("/", 1)[-1])
            nonce, at, mac = q["nonce"][0], float(q["t"][0]), q["mac"][0]
        except (KeyError, ValueError, IndexError):
            return 400, b"bad request", ""
        if not hmac.compare_digest(mac, _mac(self._secret, "request", step, nonce, q["t"][0])):
            logger.warning("bagua_algos.ft: a heal request without the job's secret was refused")
            return 403, b"forbidden", ""
        now = time.time()
        with self._lock:
            self._seen = {n: t for n, t in self._seen.items() if now - t < 2 * _FRESH_S}
            if abs(now - at) > _FRESH_S or nonce in self._seen:
                return 403, b"stale or replayed request", ""
            self._seen[nonce] = now
            # the joiner may ask before this replica's quorum thread has staged the state
            # (it stages after configuring the group): wait for it, as torchft's does
            self._lock.wait_for(lambda: self._staged is not None and self._staged[0] == step,
                                timeout=self._timeout.total_seconds())
            staged = self._staged
        if staged is None or staged[0] != step:
            return 404, b"no state staged for that step", ""
        return 200, staged[1], _mac(self._secret, "answer", step, nonce, staged[1])

    # -- CheckpointTransport ------------------------------------------------------------------
    def metadata(self) -> str:
        return f"http://{socket.gethostname()}:{self._server.socket.getsockname()[1]}"

    def send_checkpoint(self, dst_ranks, step: int, state_dict, timeout: timedelta) -> None:
        check_plain(state_dict)
        buf = io.BytesIO()
        torch.save(_to_cpu(state_dict), buf)
        with self._lock:
            self._staged = (int(step), buf.getvalue())
            self._lock.notify_all()

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._staged = None

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta):
        nonce, at = secrets.token_hex(16), repr(time.time())
        query = urllib.parse.urlencode(
            {"nonce": nonce, "t": at, "mac": _mac(self._secret, "request", step, nonce, at)})
        url = f"{metadata}/checkpoint/{int(step)}?{query}"
        try:
            with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as r:
                payload, mac = r.read(), r.headers.get("X-Bagua-Mac", "")
        except urllib.error.HTTPError as err:
            if err.code == 403:
                raise SecretRefused(f"bagua_algos.ft: the replica at {metadata} refused this "
                                    f"replica's heal request: its {SECRET_ENV} (or secret=) is "
                                    "not the job's") from None
            raise
        if not hmac.compare_digest(mac, _mac(self._secret, "answer", step, nonce, payload)):
            raise PermissionError(f"bagua_algos.ft: the heal state from {metadata} is not "
                                  "authenticated by the job's secret: refused, nothing applied")
        return torch.load(io.BytesIO(payload), weights_only=True)

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()
        if wait:
            self._thread.join()


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj
