"""The instrumenting example, complete: a small DDP job on CPU (gloo) watched by stragglerwatch.

    torchrun --nproc_per_node 2 docs/examples/instrument_ddp.py
    stragglerwatch analyze stragglerwatch-runs/RUN_ID     # the run dir it prints
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import stragglerwatch

dist.init_process_group("gloo")  # torchrun gives the rank, the world size and the rendezvous
torch.manual_seed(dist.get_rank())
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
loss_fn = torch.nn.MSELoss()
loader = DataLoader(TensorDataset(torch.randn(640, 32), torch.randn(640, 1)), batch_size=32)  # 20 steps

model = DistributedDataParallel(net)            # after init_process_group()
watch = stragglerwatch.attach(model, optimizer=optimizer)
for x, y in watch.wrap(loader):                 # optional: times data wait exactly
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
watch.close()                                   # or: with stragglerwatch.attach(...) as watch:

print(f"rank {dist.get_rank()}: {watch.steps} steps recorded in {watch.run_dir}")
dist.destroy_process_group()
