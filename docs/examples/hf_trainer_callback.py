"""Hugging Face Trainer: one callback. On CPU; under torchrun the Trainer wraps the model in DDP.

    torchrun --nproc_per_node 2 docs/examples/hf_trainer_callback.py
"""

import torch
from transformers import Trainer, TrainingArguments

# --8<-- [start:import]
from stragglerwatch.integrations.transformers import StragglerWatchCallback

# --8<-- [end:import]


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def forward(self, x, labels=None):
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 640

    def __getitem__(self, i):
        x = torch.randn(16, generator=torch.Generator().manual_seed(i))
        return {"x": x, "labels": x.sum(0, keepdim=True)}


args = TrainingArguments(
    output_dir="hf-output", max_steps=20, per_device_train_batch_size=8, use_cpu=True, report_to=[],
    save_strategy="no", logging_strategy="no", disable_tqdm=True, ddp_find_unused_parameters=False,
)
# --8<-- [start:trainer]
trainer = Trainer(model=Regressor(), args=args, train_dataset=Data(), callbacks=[StragglerWatchCallback()])
trainer.train()
# --8<-- [end:trainer]
