"""A DDP job (gloo, CPU) in which one rank does more work than its peers and nothing else differs.

From step ``--from-step`` on, rank ``--extra-rank`` multiplies a matrix ``--matmuls`` more times in
each forward (real CPU work, no sleep), the way a rank given a larger share of the compute or a
slower kernel is slow: no other process shares its CPU, its host and devices are like its peers'.
``--pin-cpus 0,1`` pins rank r to CPU LIST[r], as ``stragglerwatch/cli/demo_job.py`` does; run
each rank with ``OMP_NUM_THREADS=1``. The report must flag the rank as a compute straggler and
name no context signal: what its own extra work does to its host (more CPU time, more run-queue
waits and switches simply because it runs more) is no cause.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch


class Net(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))
        self.extra = 0  # matrix products to add to each forward
        self.register_buffer("w", torch.randn(hidden, hidden) / hidden**0.5, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.extra:
            with torch.no_grad():
                a = x
                for _ in range(self.extra):
                    a = torch.tanh(a @ self.w)
            x = x + 0.0 * a
        return self.body(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--extra-rank", type=int, default=1)
    p.add_argument("--from-step", type=int, default=50)
    p.add_argument("--matmuls", type=int, default=40)
    p.add_argument("--pin-cpus", default="")
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if args.pin_cpus:
        cpus = [int(c) for c in args.pin_cpus.split(",")]
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = Net(args.hidden)
    model = DDP(net, broadcast_buffers=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, args.run_dir, optimizer=optimizer, code_sample_hz=0)
    x, y = torch.randn(args.batch_size, args.hidden), torch.randint(0, 10, (args.batch_size,))
    loss_fn = nn.CrossEntropyLoss()
    for step in range(args.steps):
        net.extra = args.matmuls if rank == args.extra_rank and step >= args.from_step else 0
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    watch.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
