"""A PyTorch Lightning DDP run (CPU, 2 processes, gloo) that records each batch per rank and epoch.

Usage: python -m tests.integration.lightning_trainer ADDRESS JOB WORKERS EPOCHS OUT [BATCH]
Writes OUT/rank{r}.txt: one line per training step, "epoch id id id ...".
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from loaderd.client import LoaderdDataset


class Model(L.LightningModule):
    def __init__(self, address: str, job: str, workers: int, out: Path, batch: int) -> None:
        super().__init__()
        self.address, self.job, self.workers, self.out = address, job, workers, out
        self.batch = batch
        self.layer = torch.nn.Linear(3 * 8 * 8, 10)

    def train_dataloader(self) -> DataLoader[Any]:
        ds = LoaderdDataset(self.address, job=self.job, batch_size=self.batch, sampler="uniform")
        return DataLoader(ds, batch_size=None, num_workers=self.workers)

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        with open(self.out / f"rank{self.global_rank}.txt", "a") as f:
            f.write(f"{self.current_epoch} " + " ".join(map(str, batch["id"].tolist())) + "\n")
        x = batch["image"].float().flatten(1) / 255
        return torch.nn.functional.cross_entropy(self.layer(x), batch["label"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    address, job, workers, epochs, out = sys.argv[1:6]
    batch = int(sys.argv[6]) if len(sys.argv) > 6 else 20
    torch.set_num_threads(1)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=int(epochs),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Model(address, job, int(workers), Path(out), batch))


if __name__ == "__main__":
    main()
