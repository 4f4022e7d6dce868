"""``torch.compile`` and bagua: what Dynamo may trace (the user's model) and what it must not
(bagua's hooks, which communicate and keep Python bookkeeping)."""

from __future__ import annotations

import sys

import torch


def eager(fn, *args):
    """``fn(*args)``, run eagerly also when ``torch.compile`` traces the caller: bagua's hooks
    communicate and keep Python bookkeeping, which stay out of the compiled graph (Dynamo
    traces the user's model only).  Dynamo is loaded whenever it traces, so nothing here
    imports it (that costs seconds at import time)."""
    if torch.compiler.is_compiling():
        return torch._dynamo.disable(fn)(*args)
    return fn(*args)


def uncompiled(module: torch.nn.Module) -> torch.nn.Module:
    """The user's model behind ``torch.compile(model)`` (an OptimizedModule keeps it as
    ``_orig_mod``): its parameter names, state_dict keys and algorithm state carry no
    ``_orig_mod.`` prefix, so checkpoints move between compiled and eager runs."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")    # loaded by torch.compile
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return module._orig_mod
    return module
