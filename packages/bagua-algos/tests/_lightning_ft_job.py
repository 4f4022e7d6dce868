"""Run by test_lightning_ft.py: one replica of ``BaguaStrategy(fault_tolerant=...)`` (one
process, devices=1), each replica fed its own half of the data.  Replica 0 then trains the
same model with plain Lightning (no bagua) on both halves at once (batches of 16 made of the
two replicas' batches of 8): gradient averaging over the two replicas must give the same
parameters.  Writes ``{"ft": params, "plain": params, "committed": n}`` to ``argv``'s --out.
"""

from __future__ import annotations

import argparse
import json
import warnings

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from bagua_algos.lightning import BaguaStrategy

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
N, IN, BATCH = 64, 6, 8


def halves():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, IN, generator=g)
    y = torch.sin(x @ torch.linspace(-1.0, 1.0, IN)).unsqueeze(1)
    return [(x[r::2], y[r::2]) for r in range(2)]


class Net(L.LightningModule):
    def __init__(self, loader):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(IN, 12), torch.nn.Tanh(),
                                       torch.nn.Linear(12, 1))
        self.loader = loader

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):
        return self.loader


def fit(model, strategy, callbacks=()):
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks),
                        use_distributed_sampler=False)
    trainer.fit(model)
    return trainer


def flat(model) -> list[float]:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--replica", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    data = halves()
    mine = DataLoader(TensorDataset(*data[args.replica]), batch_size=BATCH)
    strategy = BaguaStrategy("gradient_allreduce", fault_tolerant={
        "lighthouse": args.lighthouse, "replica_id": f"r{args.replica}", "min_replicas": 2})
    committed = []

    class Count(L.Callback):
        def on_train_end(self, trainer, pl_module):
            committed.append(trainer.strategy.fault_tolerant.committed_steps)

    model = Net(mine)
    init = flat(model)
    trainer = fit(model, strategy, [Count()])
    assert trainer.strategy.model is model and trainer.strategy.fault_tolerant is None
    res = {"ft": flat(model), "init": init, "committed": committed[0],
           "lr": trainer.optimizers[0].param_groups[0]["lr"]}
    if args.replica == 0:
        # the reference: plain Lightning, both halves in each batch (rows of replica 0's batch
        # then replica 1's), so the mean loss's gradient is the two replicas' average
        both = [torch.cat([a.reshape(-1, BATCH, *a.shape[1:]), b.reshape(-1, BATCH, *b.shape[1:])],
                          dim=1).reshape(-1, *a.shape[1:]) for a, b in zip(*data)]
        plain = Net(DataLoader(TensorDataset(*both), batch_size=2 * BATCH))
        trainer = fit(plain, "auto")
        res["plain"], res["plain_lr"] = flat(plain), trainer.optimizers[0].param_groups[0]["lr"]
    with open(args.out, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main()
