#!/usr/bin/env python3
"""Lightning with a bagua algorithm: ``Trainer(strategy=BaguaStrategy(algorithm=...))``.

Needs ``pip install 'bagua-algos[lightning]'``. Either launcher works:

    python examples/lightning_train.py --devices 2 --algorithm bytegrad   # Lightning launches
    torchrun --nproc_per_node=2 examples/lightning_train.py --devices 2   # torchrun launches
    python examples/lightning_train.py --devices 2 --quick                # a few steps (the test)

The model is a small classifier on generated data (nothing is downloaded). ``--algorithm``
takes any registered name; ``--strategy-name`` uses ``Trainer(strategy="bagua")`` instead
(GradientAllReduce with its defaults). Lightning's checkpoints carry the algorithm's state
(``--ckpt-dir``; ``--resume PATH`` continues from one).
"""

from __future__ import annotations

import argparse
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from bagua_algos import QAdamOptimizer
from bagua_algos.lightning import BaguaStrategy

# Keyword arguments per algorithm: flat (non-hierarchical) so that one machine shows the
# algorithm itself; on several nodes leave the defaults (hierarchical) instead.
ALGORITHM_KWARGS = {
    "gradient_allreduce": {},
    "bytegrad": {"hierarchical": False},
    "decentralized": {"hierarchical": False},
    "low_precision_decentralized": {"hierarchical": False},
    "async": {"sync_interval_ms": 50, "warmup_steps": 10},
    "qadam": {"hierarchical": False},
}


def make_data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.randn(32, 10, generator=g)
    y = torch.tanh(x @ teacher).argmax(dim=1)
    split = n * 4 // 5
    return TensorDataset(x[:split], y[:split]), TensorDataset(x[split:], y[split:])


class Classifier(L.LightningModule):
    def __init__(self, algorithm: str, lr: float):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(),
                                       torch.nn.Linear(128, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, sync_dist=True)        # reduced through bagua_comm
        return loss

    def validation_step(self, batch, _idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        if self.hparams.algorithm == "qadam":    # QAdam needs its own optimizer
            return QAdamOptimizer(self.parameters(), lr=self.hparams.lr / 20, warmup_steps=20)
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description="bagua + Lightning")
    ap.add_argument("--algorithm", choices=sorted(ALGORITHM_KWARGS), default="bytegrad")
    ap.add_argument("--strategy-name", action="store_true",
                    help='use Trainer(strategy="bagua") (gradient_allreduce)')
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ckpt-dir", default=None, help="save a checkpoint after every epoch")
    ap.add_argument("--resume", default=None, help="checkpoint to continue from")
    ap.add_argument("--quick", action="store_true", help="1 epoch on 1,024 samples")
    args = ap.parse_args(argv)
    if args.quick:
        args.epochs, args.samples = 1, 1024
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    torch.manual_seed(0)
    torch.set_num_threads(1)

    train, val = make_data(args.samples)
    strategy = ("bagua" if args.strategy_name
                else BaguaStrategy(algorithm=args.algorithm, **ALGORITHM_KWARGS[args.algorithm]))
    model = Classifier("gradient_allreduce" if args.strategy_name else args.algorithm, args.lr)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy,
                        max_epochs=args.epochs, logger=False,
                        enable_checkpointing=args.ckpt_dir is not None,
                        default_root_dir=args.ckpt_dir, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(train, batch_size=args.batch_size, shuffle=True),
                DataLoader(val, batch_size=256), ckpt_path=args.resume)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.global_rank == 0:
        print(f"{type(trainer.strategy).__name__}({trainer.strategy._algorithm!r}) on "
              f"{trainer.world_size} processes: {trainer.global_step} steps, "
              f"val loss {metrics['val_loss']:.4f}, val acc {metrics['val_acc']:.3f}")
    return metrics


if __name__ == "__main__":
    main()
