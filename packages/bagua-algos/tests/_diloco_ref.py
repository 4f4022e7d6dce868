"""A single-process simulation of DiLoCo's ranks, written from docs/design.md §5 (not from the
implementation): each simulated rank has its own model and inner optimizer; the outer step is
a ``torch.optim.SGD`` per fragment on the anchor with the mean outer gradient."""

from __future__ import annotations

import copy

import torch
from _common import batch, loss_fn, make_model


def flat(model) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()


def set_flat(model, vec) -> None:
    torch.nn.utils.vector_to_parameters(vec, model.parameters())


def simulate(world: int, steps: int, *, sync_every: int, outer_lr=0.7, outer_momentum=0.9,
             nesterov=True, fragments=1, overlap=0, inner="sgd", seed=1,
             model_fn=make_model, batch_fn=batch, resume=None, skipped=(), outer_warmup=0):
    """Per step, every rank's flat parameters after that step: ``out[t][r]``.

    ``skipped``: ``(t, r)`` pairs whose inner optimizer step does not happen (a step
    torch.amp.GradScaler skips on rank ``r`` only); it still counts towards ``sync_every``.

    ``outer_warmup``: W > 0 replaces the outer SGD by the update written out by hand, the
    k-th outer step of a fragment with momentum ``μ_k = outer_momentum · min(1, k / W)``:
    ``m ← μ_k m + Δ`` (m starts at 0), ``u = Δ + μ_k m`` (Nesterov) or ``m``,
    ``θ_a ← θ_a - outer_lr · u``.

    ``resume``: start every rank after step ``resume["step"]`` (no sync in flight) from the
    model and inner optimizer state ``resume["model"]``/``["optimizer"]`` and the flat
    ``resume["anchor"]`` and ``resume["momentum"]``; ``out`` then starts at the next step."""
    models = [model_fn(seed) for _ in range(world)]
    opts = [inner_optimizer(m, inner) for m in models]
    first = 1
    if resume is not None:
        first = resume["step"] + 1
        for m, o in zip(models, opts):
            m.load_state_dict(resume["model"])
            o.load_state_dict(copy.deepcopy(resume["optimizer"]))  # Adam's step is shared
    n = flat(models[0]).numel()
    cuts = [p * n // fragments for p in range(fragments + 1)]
    base = flat(models[0]) if resume is None else resume["anchor"]
    anchors = [base[cuts[p]:cuts[p + 1]].clone() for p in range(fragments)]
    outers = [torch.optim.SGD([a], lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
              for a in anchors]
    if resume is not None and resume.get("momentum") is not None:
        for p, (a, o) in enumerate(zip(anchors, outers)):
            o.state[a]["momentum_buffer"] = resume["momentum"][cuts[p]:cuts[p + 1]].clone()
    if outer_warmup:
        outers = [_HandOuter(a, outer_lr, outer_momentum, nesterov, outer_warmup)
                  for a in anchors]
    in_flight = {}                          # fragment -> (apply at, mean delta, starts)
    out = []
    for t in range(first, steps + 1):
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            loss_fn(m, *batch_fn(t - 1, r)).backward()
            if (t, r) not in skipped:
                o.step()
        thetas = [flat(m) for m in models]
        for p in sorted(in_flight):
            apply_at, delta, starts = in_flight[p]
            if apply_at != t:
                continue
            del in_flight[p]
            anchors[p].grad = delta
            outers[p].step()
            lo, hi = cuts[p], cuts[p + 1]
            for r in range(world):
                if overlap == 0:
                    thetas[r][lo:hi] = anchors[p]
                else:                        # keep the steps made while the sync was in flight
                    thetas[r][lo:hi] = thetas[r][lo:hi] + (anchors[p] - starts[r])
        for p in range(fragments):
            if t % sync_every != (p + 1) * sync_every // fragments % sync_every:
                continue
            lo, hi = cuts[p], cuts[p + 1]
            starts = [th[lo:hi].clone() for th in thetas]
            delta = sum(anchors[p] - s for s in starts) / world
            if overlap == 0:
                anchors[p].grad = delta
                outers[p].step()
                for r in range(world):
                    thetas[r][lo:hi] = anchors[p]
            else:
                in_flight[p] = (t + overlap, delta, starts)
        for m, th in zip(models, thetas):
            set_flat(m, th)
        out.append([th.clone() for th in thetas])
    return out


class _HandOuter:
    """The outer step with a momentum warm-up, by hand (no torch optimizer)."""

    def __init__(self, anchor, lr, momentum, nesterov, warmup):
        self.anchor, self.lr, self.mu, self.nesterov, self.warmup = (anchor, lr, momentum,
                                                                     nesterov, warmup)
        self.m = torch.zeros_like(anchor)
        self.k = 0

    def step(self):
        self.k += 1
        mu = self.mu * min(1.0, self.k / self.warmup)
        d = self.anchor.grad
        self.m = mu * self.m + d
        u = d + mu * self.m if self.nesterov else self.m
        with torch.no_grad():
            self.anchor -= self.lr * u


def inner_optimizer(model, inner: str):
    if inner == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    if inner == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.05)
