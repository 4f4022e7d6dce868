"""Run by test_lightning_failure.py as one of 2 independent processes (no torchrun agent to
kill the survivor): Lightning ``Trainer.fit`` with ``BaguaStrategy(algorithm="async")`` where
rank 1 raises in ``training_step`` at step 3. Each process must exit, non-zero."""

from __future__ import annotations

import os
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from bagua_algos.lightning import BaguaStrategy

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
FAIL_AT = 3


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                                       torch.nn.Linear(12, 1))

    def training_step(self, batch, idx):
        if self.global_rank == 1 and self.global_step == FAIL_AT:
            print("raising", flush=True)        # the test's clock starts here
            raise RuntimeError(f"rank 1 fails at step {FAIL_AT} on purpose")
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(512, 6, generator=g)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


if __name__ == "__main__":
    trainer = L.Trainer(accelerator="cpu", devices=2, max_epochs=50, logger=False,
                        strategy=BaguaStrategy(algorithm="async", sync_interval_ms=2,
                                               warmup_steps=1),
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Net())
    print(f"rank {os.environ['RANK']} finished fit", flush=True)
