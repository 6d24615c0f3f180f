"""A small gloo DDP job for the debug-server test, driven from outside through files.

Every rank attaches as the README says, with the debug server on (``STRAGGLERWATCH_DEBUG_SERVER_PORT``,
loopback by default), then trains ~15 ms steps until told to stop. Rank 0 looks for the signal files in
``--signal-dir`` at every step and shares what it saw with one all-reduce, so that every rank acts at
the same step: ``stall`` makes rank 1 sleep ``--stall-seconds`` once, before its next forward; ``stop``
ends the loop (as does ``--deadline-s``, so that a lost test never leaves the job running). At the end
each rank writes ``done-<rank>.json``: the steps it trained.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--signal-dir", required=True)
    parser.add_argument("--stall-seconds", type=float, default=4.0)
    parser.add_argument("--flush-interval", type=float, default=30.0)
    parser.add_argument("--deadline-s", type=float, default=150.0)
    args = parser.parse_args()
    signals = Path(args.signal_dir)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    deadline = time.monotonic() + args.deadline_s
    stalled, steps = False, 0
    with stragglerwatch.attach(model, args.run_dir, optimizer=opt, flush_interval_s=args.flush_interval):
        while True:
            flags = torch.zeros(2)
            if rank == 0:
                flags[0] = float((signals / "stall").exists() and not stalled)
                flags[1] = float((signals / "stop").exists() or time.monotonic() > deadline)
            dist.all_reduce(flags)
            if flags[1] > 0:
                break
            if flags[0] > 0:
                stalled = True
                if rank == 1:
                    time.sleep(args.stall_seconds)
            x, y = torch.randn(8, 16), torch.randn(8, 4)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)
            steps += 1
    (signals / f"done-{rank}.json").write_text(json.dumps({"steps": steps}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
