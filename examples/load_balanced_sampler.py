#!/usr/bin/env python3
"""The load-balanced sampler alone, on variable-length text: needs only torch and bagua-data
(``pip install bagua-data``); no process group, no other bagua package.

    python examples/load_balanced_sampler.py             # 20,000 sentences, 8 ranks
    python examples/load_balanced_sampler.py --quick     # 2,000 sentences (what the test runs)

Sentences of lognormal length are generated (nothing is downloaded). Each rank of a job would
build its sampler with its own ``rank``; here one process builds all of them to show what
each rank would get:

1. the per-step imbalance (the longest rank's tokens over the mean) with torch's
   ``DistributedSampler`` and with ``LoadBalancingDistributedSampler``;
2. ``LoadBalancingDistributedBatchSampler`` with a token budget: variable-size batches, the
   same number on every rank;
3. a short training loop on rank 0's batches (a bag-of-words classifier), with the sampler's
   ``state_dict()`` saved mid-epoch and a resumed sampler continuing with the next batch.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from bagua_data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

VOCAB = 500


class Sentences(Dataset):
    """Token-id sentences with lognormal lengths; label: is token 0 ("the") present?"""

    def __init__(self, n: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        lengths = (3.5 + 0.8 * torch.randn(n, generator=g)).exp().clamp(2, 400).long()
        self.texts = [torch.randint(1, VOCAB, (int(k),), generator=g) for k in lengths]
        for t in self.texts[::2]:                       # half the sentences contain token 0
            t[torch.randint(0, len(t), (1,), generator=g)] = 0
        self.lengths = [len(t) for t in self.texts]

    def __len__(self):
        return len(self.texts)

    def __getitem__(self, i):
        return self.texts[i], int((self.texts[i] == 0).any())


def pad_collate(batch):
    texts, labels = zip(*batch)
    return (torch.nn.utils.rnn.pad_sequence(texts, batch_first=True, padding_value=VOCAB),
            torch.tensor(labels))


def imbalance(per_rank_indices, lengths, batch_size: int) -> float:
    """Mean over steps of (max over ranks of the step's tokens) / (mean over ranks)."""
    steps = len(per_rank_indices[0]) // batch_size
    ratios = []
    for s in range(steps):
        tokens = [sum(lengths[i] for i in idx[s * batch_size:(s + 1) * batch_size])
                  for idx in per_rank_indices]
        ratios.append(max(tokens) / (sum(tokens) / len(tokens)))
    return sum(ratios) / len(ratios)


def token_budget(lengths, budget: int):
    def batch_fn(indices):
        batches, batch, total = [], [], 0
        for i in indices:
            if batch and total + lengths[i] > budget:
                batches.append(batch)
                batch, total = [], 0
            batch.append(i)
            total += lengths[i]
        return batches + [batch] if batch else batches
    return batch_fn


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=20_000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="2,000 sentences")
    args = ap.parse_args(argv)
    if args.quick:
        args.samples = 2_000

    data = Sentences(args.samples)
    lengths = data.lengths
    R, B = args.ranks, args.batch_size

    # 1. Per-step imbalance: what every rank would draw this epoch.
    torch_idx = [list(DistributedSampler(data, num_replicas=R, rank=r, seed=0))
                 for r in range(R)]
    ours = [LoadBalancingDistributedSampler(data, complexity_fn=lengths, num_replicas=R, rank=r,
                                            seed=0) for r in range(R)]
    ours_idx = [list(s) for s in ours]
    torch_imb, ours_imb = imbalance(torch_idx, lengths, B), imbalance(ours_idx, lengths, B)
    print(f"{args.samples} sentences, {R} ranks, batch {B}: per-step imbalance "
          f"DistributedSampler {torch_imb:.3f}, LoadBalancingDistributedSampler {ours_imb:.4f}")
    same = sorted(i for idx in torch_idx for i in idx) == sorted(i for idx in ours_idx for i in idx)
    assert same, "the same samples as DistributedSampler, only dealt out differently"

    # 2. Token-budget batches: the same number of batches on every rank.
    batchers = [LoadBalancingDistributedBatchSampler(s, token_budget(lengths, args.token_budget))
                for s in ours]
    counts = [len(list(b)) for b in batchers]
    print(f"token budget {args.token_budget}: batches per rank {counts}")
    assert len(set(counts)) == 1

    # 3. Train on rank 0's batches; save the sampler's position mid-epoch; resume.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.EmbeddingBag(VOCAB + 1, 16, padding_idx=VOCAB),
                                torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    batches = batchers[0]
    loader = DataLoader(data, batch_sampler=batches, collate_fn=pad_collate)
    losses, saved, half = [], None, counts[0] // 2
    for epoch in range(2):
        batches.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if epoch == 1 and step + 1 == half:
                saved = batches.state_dict(consumed=half)     # goes into your checkpoint
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")

    resumed = LoadBalancingDistributedBatchSampler(
        LoadBalancingDistributedSampler(data, complexity_fn=lengths, num_replicas=R, rank=0,
                                        seed=0), token_budget(lengths, args.token_budget))
    resumed.load_state_dict(saved)
    resumed.set_epoch(saved["epoch"])
    batches.set_epoch(1)
    rest = list(resumed)
    assert rest == list(batches)[half:], "resumed sampler continues with the next batch"
    print(f"resumed at batch {half} of epoch {saved['epoch']}: {len(rest)} batches left")
    return {"torch_imbalance": torch_imb, "imbalance": ours_imb, "losses": losses}


if __name__ == "__main__":
    main()
