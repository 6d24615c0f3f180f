"""A DDP job (gloo, CPU) of variable-length batches through a real MLP, one rank doing more MLP work per token
from a step on: what wrote ``tests/data/varlen-mlp-4ranks`` (4 ranks, 300 steps, rank 2 from step 120).

Each step every rank draws 8 sequence lengths (log-normal around 200 tokens) and runs the tokens through an
embedding, an MLP (64 -> 256 -> 64) and a head. From ``--from-step`` on, ``--slow-rank`` also runs every
token through a second MLP of half that width: 50% more MLP work per token, as a rank with a slower core or
a mis-sized kernel would do. Its time follows its tokens, so only a work-adjusted comparison can tell it.

    python -m torch.distributed.run --nproc_per_node 4 tests/workers/varlen_mlp.py --run-dir DIR
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch

VOCAB, HIDDEN = 64, 64


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
        self.extra = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.slow = False

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        x = x + self.mlp(x)
        # every rank uses ``extra`` (DDP needs each parameter's gradient); the slow rank on every token
        x = x + self.extra(x) if self.slow else x + 0.0 * self.extra(x[:1])
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--from-step", type=int, default=120)
    p.add_argument("--slow-rank", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, args.run_dir, optimizer=optimizer, code_sample_hz=0)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(args.steps):
        rng = np.random.default_rng([step, rank])
        tokens = int(np.maximum(8, rng.lognormal(np.log(200), 0.6, 8)).astype(int).sum())
        with watch.data():
            ids, target = torch.randint(0, VOCAB, (tokens,)), torch.randint(0, VOCAB, (tokens,))
        net.slow = rank == args.slow_rank and step >= args.from_step
        loss_fn(model(ids), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    watch.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
