"""Argument checks shared by the algorithms' constructors (each names the argument and the rule)."""

from __future__ import annotations

import math


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_int_at_least(name: str, value, minimum: int, why: str = "") -> None:
    """An int (not a bool) >= ``minimum``; ``why`` is said in brackets after the rule."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        note = f" ({why})" if why else ""
        raise ValueError(f"{name} must be an int >= {minimum}{note}, got {value!r}")


def check_number(name: str, value, rule: str, ok, *, finite: bool = False) -> None:
    """A real number (int or float, not a bool; ``finite``: not inf or nan) for which
    ``ok(value)`` holds, else ``ValueError`` "``name`` must be a [finite] number ``rule``"."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or (finite and not math.isfinite(value)) or not ok(value)):
        kind = "a finite number" if finite else "a number"
        raise ValueError(f"{name} must be {kind} {rule}, got {value!r}")


def check_interval(value) -> None:
    check_int_at_least("communication_interval", value, 1)


def check_bucket_size(bucket_size, name: str = "bucket_size") -> int:
    """``bucket_size`` (bytes) as an int, or ``ValueError`` naming the rule: the one check of
    ``with_bagua``, ``rebucket`` and the autotuner's cached choice."""
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int) or bucket_size <= 0:
        raise ValueError(f"{name} must be a positive integer number of bytes (e.g. "
                         f"10 * 1024 * 1024 for 10 MiB), got {bucket_size!r}")
    return bucket_size



def check_model(model, algorithm) -> None:
    """What :func:`with_bagua` can tell from the model alone, on every rank before any
    communication: complex parameters or buffers, sparse gradients under an algorithm of
    dense gradient buckets, and parameters a compressing algorithm cannot quantise.
    ``ValueError`` names them."""
    import torch

    from bagua_comm._compressed import _FLOATS  # the dtypes compressed_allreduce takes

    owner = type(algorithm).__name__
    complex_ = [name for name, t in [*model.named_parameters(), *model.named_buffers()]
                if t.is_complex()]
    if complex_:
        raise ValueError(
            f"model: {complex_[:4]}{' ...' if len(complex_) > 4 else ''} are complex tensors, "
            f"which bagua does not communicate. Keep them real with a trailing dimension of 2 "
            f"(torch.view_as_real) and take torch.view_as_complex of them in forward")
    if algorithm.dense_gradients:
        sparse = [name for name, m in model.named_modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))
                  and m.sparse and m.weight.requires_grad]
        if sparse:
            raise ValueError(
                f"model: modules {sparse} are {type(model.get_submodule(sparse[0])).__name__}"
                f"(sparse=True), whose gradients are sparse; {owner} reduces gradients in "
                f"dense buckets. Build them with sparse=False, or use an algorithm that "
                f"averages weights (Decentralized, LowPrecisionDecentralized, DiLoCo)")
    if algorithm.compresses():
        bad = [(name, p.dtype) for name, p in model.named_parameters()
               if p.requires_grad and p.dtype not in _FLOATS]
        if bad:
            names = [name for name, _ in bad]
            dtypes = sorted({str(d).removeprefix("torch.") for _, d in bad})
            raise ValueError(
                f"model: parameters {names[:4]}{' ...' if len(names) > 4 else ''} are "
                f"{', '.join(dtypes)}; {owner} quantises float32, float16 or bfloat16 tensors "
                f"only. Cast the model (model.float()) or use GradientAllReduce")


def sparse_gradient_error(name: str, algorithm) -> ValueError:
    """Parameter ``name`` got a sparse gradient, which ``algorithm``'s dense buckets cannot
    take (raised in backward, on the rank that got it)."""
    owner = type(algorithm).__name__
    how = ("make it dense (e.g. Embedding(sparse=False)), or compute it through an "
           "nn.Embedding/EmbeddingBag(sparse=True) module, whose gradients "
           f"{owner} averages sparsely"
           if algorithm.sparse_allreduce else
           "make it dense (e.g. Embedding(sparse=False))")
    return ValueError(f"parameter {name!r} got a sparse gradient; {owner} reduces gradients "
                      f"in dense buckets: {how}")


def dtype_changed_error(bucket, name_of) -> RuntimeError | None:
    """The error to raise when a bucket's parameters changed dtype or device after the
    wrap (``model.double()``, ``model.to(...)``), else None; ``name_of(p)`` names them."""
    for p in bucket.params:
        if p.dtype != bucket.dtype or p.device != bucket.device:
            return RuntimeError(
                f"parameter {name_of(p)!r} is {p.dtype} on {p.device} but was "
                f"{bucket.dtype} on {bucket.device} at with_bagua: changing parameters' "
                f"dtype or device after with_bagua (model.to(), .double(), .half()) is not "
                f"supported; cast or move the model before wrapping it")
    return None


def late_accumulation_error(name: str, n: int, expected: int) -> RuntimeError:
    """Parameter ``name`` got its ``n``-th gradient accumulation of a backward after its
    bucket had started (earlier backwards accumulated it at most ``expected`` times)."""
    return RuntimeError(
        f"parameter {name!r} received gradient accumulation {n} in "
        f"this backward after its bucket's communication had started (earlier backwards "
        f"accumulated it at most {expected} times, e.g. a block used in more reentrant-"
        f"checkpointed segments than before): its averaged gradient would be wrong. Use "
        f"torch.utils.checkpoint(..., use_reentrant=False), or use it as many times in "
        f"the first backward as in any later one; this rank's next backward waits for {n}")
