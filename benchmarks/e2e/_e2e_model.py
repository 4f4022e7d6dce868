"""The end-to-end workload: a small GPT-style transformer on generated Markov-chain text.

Nothing is downloaded.  The text comes from a fixed random Markov chain over ``vocab``
tokens in which every token has a handful of likely successors, so the loss falls from
``ln(vocab)`` towards the chain's entropy within a few dozen steps: a real learning task
whose loss tells whether an algorithm trains as well as DDP.
"""

from __future__ import annotations

import math

import torch
from torch import nn

# name: (vocab, d_model, heads, layers, ff, seq_len)
SIZES = {
    "tiny": (64, 32, 2, 1, 64, 16),          # tests: ~30k parameters
    "small": (256, 192, 4, 3, 768, 32),      # --quick: ~1.4M parameters
    "base": (256, 256, 4, 4, 1024, 32),      # default: ~3.3M parameters
}


class TinyGPT(nn.Module):
    """Decoder-only transformer (pre-norm, causal mask, learned positions)."""

    def __init__(self, vocab: int, d_model: int, heads: int, layers: int, ff: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        layer = nn.TransformerEncoderLayer(d_model, heads, ff, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(seq_len),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos[:t]
        x = self.blocks(x, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(x))


def make_model(size: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return TinyGPT(*SIZES[size])


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class MarkovText:
    """Sequences from a fixed random Markov chain (the same chain on every rank)."""

    def __init__(self, size: str, seed: int = 1234, successors: int = 4):
        vocab, *_, seq_len = SIZES[size]
        self.vocab, self.seq_len = vocab, seq_len
        g = torch.Generator().manual_seed(seed)
        logits = torch.full((vocab, vocab), -30.0)
        nxt = torch.randint(0, vocab, (vocab, successors), generator=g)
        logits.scatter_(1, nxt, torch.randn(vocab, successors, generator=g) * 1.5)
        self.probs = torch.softmax(logits, dim=1)

    def batches(self, n_batches: int, batch_size: int, seed: int) -> list[tuple]:
        """``n_batches`` of ``(inputs, targets)``, each ``[batch_size, seq_len]`` long."""
        g = torch.Generator().manual_seed(seed)
        n = n_batches * batch_size
        seq = torch.empty(n, self.seq_len + 1, dtype=torch.long)
        seq[:, 0] = torch.randint(0, self.vocab, (n,), generator=g)
        for t in range(self.seq_len):
            seq[:, t + 1] = torch.multinomial(self.probs[seq[:, t]], 1, generator=g)[:, 0]
        return [(seq[i:i + batch_size, :-1], seq[i:i + batch_size, 1:])
                for i in range(0, n, batch_size)]

    def entropy(self) -> float:
        """Mean per-token entropy of the chain (nats): the best loss reachable."""
        p = self.probs.clamp_min(1e-30)
        h = -(p * p.log()).sum(1)
        return float(h.mean())


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def initial_loss(vocab: int) -> float:
    return math.log(vocab)
