"""Accelerate: attach after ``accelerator.prepare``, which returns the DDP model.

    accelerate launch --cpu --num_processes 2 docs/examples/accelerate_attach.py
"""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import stragglerwatch

accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
model = torch.nn.Linear(16, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(TensorDataset(torch.randn(640, 16), torch.randn(640, 1)), batch_size=16)
loss_fn = torch.nn.MSELoss()

# --8<-- [start:loop]
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
watch = stragglerwatch.attach(model)            # after prepare: the DDP model
for x, y in loader:                             # or watch.wrap(loader): data wait timed exactly
    with accelerator.accumulate(model):
        accelerator.backward(loss_fn(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
# --8<-- [end:loop]
watch.close()
