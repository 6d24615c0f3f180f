"""A loop without a DataLoader, shaped as nanoGPT's: batches come from a function of its own, and
the next batch is fetched between a micro-batch's forward and its backward. ``watch.data`` marks
the fetch, so its time is data wait wherever it happens in the step.

    torchrun --nproc_per_node 2 docs/examples/data_marker.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import stragglerwatch

dist.init_process_group("gloo")
tokens = torch.randint(0, 64, (10_000,))  # stands in for nanoGPT's memory-mapped token file
block_size, batch_size, grad_accum_steps = 16, 8, 4


def get_batch(split):
    i = torch.randint(len(tokens) - block_size - 1, (batch_size,))
    x = torch.stack([tokens[j : j + block_size] for j in i])
    y = torch.stack([tokens[j + 1 : j + 1 + block_size] for j in i])
    return x, y


def batches():  # a stream of batches, for the with-block form at the end
    while True:
        yield get_batch("train")


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)

    def forward(self, x, y):
        logits = self.head(self.embed(x))
        return logits, F.cross_entropy(logits.flatten(0, 1), y.flatten())


model = DistributedDataParallel(TinyLM())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
stream = batches()

watch = stragglerwatch.attach(model)
get_batch = watch.data(get_batch)            # a fetch function: every call is data wait
X, Y = get_batch("train")
for _ in range(20):
    for micro_step in range(grad_accum_steps):
        model.require_backward_grad_sync = micro_step == grad_accum_steps - 1
        logits, loss = model(X, Y)
        X, Y = get_batch("train")                # between forward and backward: data, not other
        (loss / grad_accum_steps).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)

for _ in range(5):
    with watch.data():                       # or a block: x, y = next(stream)
        x, y = next(stream)
    model(x, y)[1].backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
watch.close()
dist.destroy_process_group()
