"""Jobs that meet a fault, for the fault-matrix tests. Under torchrun (gloo) or as one process.

Usage: faults.py MODE OUT_DIR [options]. Each mode trains a small model with stragglerwatch
attached (as the README says) and writes what the test checks into OUT_DIR:

- ``sigterm``: trains until SIGTERM; the application's handler (installed ``--handler
  before|after`` attach) takes 3 s to save a checkpoint, then exits; an atexit hook leaves a mark;
- ``native``: rank 1 spends 8 s in native code holding the GIL (a ctypes call) before step 10;
- ``restart``: under ``torchrun --max-restarts 1``, rank 1 fails at step 15 of the first attempt;
- ``steps``: one process, ``--steps`` quick steps with a short flush interval (killed at random
  moments by the test); ``--fsize BYTES`` limits the size of every file it writes (a disk that
  fills: writes fail with EFBIG); ``--bare`` calls attach() without keeping the handle.
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("mode", choices=("sigterm", "native", "restart", "steps"))
    p.add_argument("out", type=Path)
    p.add_argument("--handler", choices=("before", "after"), default="after")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--flush", type=float, default=1.0)
    p.add_argument("--fsize", type=int, default=0)
    p.add_argument("--bare", action="store_true")
    return p.parse_args(argv)


def train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(16, 32)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def one_process(args: argparse.Namespace) -> None:
    import resource

    if args.fsize:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize, resource.RLIM_INFINITY))
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    run = args.out / "run"
    if args.bare:
        stragglerwatch.attach(model, run, watchdog_timeout_s=0, flush_interval_s=args.flush)
    else:
        watch = stragglerwatch.attach(model, run, watchdog_timeout_s=0, flush_interval_s=args.flush)
    with (args.out / "progress").open("a", buffering=1) as progress:  # one line a step: "step time"
        for step in range(args.steps):
            train_step(model, opt)
            progress.write(f"{step} {time.time()}\n")
    if not args.bare:
        watch.close()  # its last write may fail too: the counters are read after it
        (args.out / "stats.txt").write_text(repr(watch.stats()))
    (args.out / "done").write_text("trained")


def distributed(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def checkpoint(signum: int, frame: object) -> None:
        time.sleep(3.0)  # longer than any grace period of ours
        torch.save(model.state_dict(), args.out / f"ckpt-{rank}.pt")
        sys.exit(0)

    atexit.register(lambda: (args.out / f"atexit-{rank}").write_text("ran"))
    if args.mode == "sigterm" and args.handler == "before":
        signal.signal(signal.SIGTERM, checkpoint)
    watch = stragglerwatch.attach(model, args.out / "run", watchdog_timeout_s=2)
    if args.mode == "sigterm" and args.handler == "after":
        signal.signal(signal.SIGTERM, checkpoint)
    steps = args.steps if args.mode != "sigterm" else 10**9
    for step in range(steps):
        if args.mode == "sigterm" and step == 5:
            (args.out / f"training-{rank}").write_text("yes")
        if args.mode == "native" and rank == 1 and step == 10:
            ctypes.PyDLL(None).sleep(8)  # libc sleep() without releasing the GIL: no Python thread runs
        if args.mode == "restart" and restart == 0 and rank == 1 and step == 15:
            raise RuntimeError("injected failure: the worker group restarts")
        train_step(model, opt)
    watch.close()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "steps":
        one_process(args)
    else:
        distributed(args)


if __name__ == "__main__":
    main()
