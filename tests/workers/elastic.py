"""An elastic job (gloo, under torchrun with ``--nnodes MIN:MAX``): a small DDP model that checkpoints
every few steps and resumes from its checkpoint in every attempt, written as torchrun's elastic docs
describe, with stragglerwatch attached as the README says.

Usage: elastic.py RUN_DIR CKPT_DIR [options]. ``--slow R:WORLD:SECONDS``: rank R sleeps SECONDS in
each forward in every attempt of WORLD ranks, from its ``--from-step``th step of that attempt;
repeatable. In the first attempt, once step ``--mark-at`` is done, rank 0 writes
``CKPT_DIR/mark`` (a test waits for it to kill a node).
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("run_dir", type=Path)
    p.add_argument("ckpt", type=Path)
    p.add_argument("--steps", type=int, default=120, help="the job's steps, across attempts")
    p.add_argument("--slow", action="append", default=[], help="RANK:WORLD:SECONDS")
    p.add_argument("--from-step", type=int, default=10, help="steps into its attempt a slow rank starts")
    p.add_argument("--mark-at", type=int, default=40)
    p.add_argument("--every", type=int, default=5, help="checkpoint every this many steps")
    p.add_argument("--step-sleep", type=float, default=0.01, help="seconds of work every step on every rank")
    return p.parse_args()


class Net(nn.Module):
    """A small MLP whose forward takes ``delay`` seconds longer (a compute straggler)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
        self.delay = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.delay:
            time.sleep(self.delay)
        return self.body(x)


def main() -> None:
    args = parse()
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    delay = 0.0
    for spec in args.slow:
        r, size, seconds = spec.split(":")
        if int(r) == rank and int(size) == world:
            delay = float(seconds)
    torch.manual_seed(0)
    net = Net()
    model = DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    ckpt = args.ckpt / "ckpt.pt"
    if ckpt.exists():  # resume, as torchrun's elastic docs have every attempt do
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    watch = stragglerwatch.attach(model, optimizer=opt, run_dir=str(args.run_dir))
    gen = torch.Generator().manual_seed(rank)
    for i, step in enumerate(range(start, args.steps)):
        x, y = torch.randn(16, 32, generator=gen), torch.randn(16, 1, generator=gen)
        net.delay = delay if i >= args.from_step else 0.0
        time.sleep(args.step_sleep)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0 and step % args.every == 0:
            tmp = args.ckpt / f".ckpt.{os.getpid()}"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
            os.replace(tmp, ckpt)
        if rank == 0 and restart == 0 and step == args.mark_at:
            (args.ckpt / "mark").write_text(str(world))
    watch.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
