"""FSDP2 (``fully_shard``): attach to the root module, after sharding. On CPU with gloo.

    torchrun --nproc_per_node 2 docs/examples/fsdp2_attach.py
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import stragglerwatch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(4))
        self.head = torch.nn.Linear(32, 1)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
model = Net()
# --8<-- [start:shard]
for block in model.layers:
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)
watch = stragglerwatch.attach(model)            # the root, after fully_shard
# --8<-- [end:shard]
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(20):
    x, y = torch.randn(8, 32), torch.randn(8, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
watch.close()
dist.destroy_process_group()
