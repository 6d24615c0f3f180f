"""A loop that updates the weights by hand (no torch.optim optimizer) marks the end of each step.

    torchrun --nproc_per_node 2 docs/examples/manual_step.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import stragglerwatch

dist.init_process_group("gloo")
model = DistributedDataParallel(torch.nn.Linear(16, 1))
loss_fn = torch.nn.MSELoss()
batches = [(torch.randn(8, 16), torch.randn(8, 1)) for _ in range(20)]


def update_weights_by_hand(model, lr=0.01):
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


watch = stragglerwatch.attach(model)
watch.step()                      # once before the loop: from the first step, these calls end steps
for x, y in batches:
    loss_fn(model(x), y).backward()
    update_weights_by_hand(model)
    watch.step()
watch.close()
dist.destroy_process_group()
