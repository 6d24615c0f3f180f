"""torch.compile: attach to the compiled module, after compiling.

    torchrun --nproc_per_node 2 docs/examples/compile_attach.py

``backend="eager"`` keeps this CPU example quick (Dynamo traces, nothing is code-generated); train
with the default backend (inductor) as usual: attach after ``torch.compile`` either way.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch

dist.init_process_group("gloo")
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)

# --8<-- [start:compile]
model = torch.compile(DDP(net), backend="eager")  # or net.compile() / ddp.compile() in place
watch = stragglerwatch.attach(model)            # after torch.compile
# --8<-- [end:compile]
for _ in range(20):
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
watch.close()
dist.destroy_process_group()
