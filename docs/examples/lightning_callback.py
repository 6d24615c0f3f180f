"""PyTorch Lightning: one callback. On CPU with gloo; ``devices`` is the number of processes.

    python docs/examples/lightning_callback.py      # or under torchrun --nproc_per_node N, devices=N
"""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

# --8<-- [start:import]
from stragglerwatch.integrations.lightning import StragglerWatch

# --8<-- [end:import]


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


loader = DataLoader(TensorDataset(torch.randn(320, 16), torch.randn(320, 1)), batch_size=16)
# --8<-- [start:trainer]
trainer = L.Trainer(
    strategy="ddp", accelerator="cpu", devices=1, max_steps=20,
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    callbacks=[StragglerWatch()],  # attach settings as keywords, e.g. StragglerWatch(watchdog_timeout_s=60)
)
trainer.fit(Regressor(), loader)
# --8<-- [end:trainer]
