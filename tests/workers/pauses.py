"""Healthy jobs with a long pause on one rank, for the hang policy's tests (gloo, started directly).

Usage: pauses.py KIND[,KIND...] OUT_DIR [options]. Every rank trains a small DDP model with stragglerwatch
attached (the hang policy's settings from the environment). From step ``--at`` on, every ``--every`` steps,
rank 0 pauses once for each KIND in turn, outside the model's hooks, while the others wait for it in
``dist.barrier()``, as they do behind a rank-0 checkpoint:

- ``checkpoint``: rank 0 saves a model state again and again for ``--seconds`` (CPU time and writes);
- ``compile``: rank 0 compiles a function with ``torch.compile`` (a recompile, e.g. for an epoch's last
  partial batch): Python running, then the C++ compiler in child processes;
- ``native``: rank 0 computes in one call into native code that holds the GIL for about ``--seconds``
  (a regular expression that backtracks, standing in for a large pickle): no Python thread of the rank
  runs, its watchdog included.

Each rank writes ``done-<rank>`` (its actions, JSON) at the end; rank 0 writes ``paused-<kind>`` (JSON: the
step it paused after, the seconds it paused).
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch


def checkpoint(seconds: float, out: Path) -> None:
    state = {"w": torch.randn(2048, 2048)}  # 16 MB
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        torch.save(state, out / "ckpt.pt")


def compile_once() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:  # cold, about 30 s on two cores: past the policy's decision
        for i in range(8):
            x = torch.sin(x) * (i + 1) + torch.cos(x * 0.5) - x.relu()
        return x.sum()

    torch.compile(f, dynamic=False)(torch.randn(37, 13))


def native_busy(seconds: float) -> None:
    """Backtracking in the regular-expression engine (C, the GIL held throughout) for about ``seconds``:
    each character more doubles the work, so time one size and scale."""
    n, took = 18, 0.0
    while took < 0.05:
        n += 1
        t0 = time.perf_counter()
        re.match(r"(a+)+$", "a" * n + "b")
        took = time.perf_counter() - t0
    while took < seconds / 1.5:
        n, took = n + 1, took * 2
    re.match(r"(a+)+$", "a" * n + "b")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("kinds", help="checkpoint, compile, native: one or more, comma-separated")
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--at", type=int, default=6)
    p.add_argument("--every", type=int, default=3)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--watchdog", type=float, default=2.0, help="watchdog_timeout_s")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    if not set(kinds) <= {"checkpoint", "compile", "native"}:
        p.error(f"unknown kind in {args.kinds!r}")
    at = {args.at + i * args.every: kind for i, kind in enumerate(kinds)}
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, args.out / "run", optimizer=opt, flush_interval_s=0.2,
                                  watchdog_timeout_s=args.watchdog)  # fmt: skip
    for step in range(args.steps):
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step in at:
            if rank == 0:
                t0 = time.perf_counter()
                if at[step] == "checkpoint":
                    checkpoint(args.seconds, args.out)
                elif at[step] == "compile":
                    compile_once()
                else:
                    native_busy(args.seconds)
                took = time.perf_counter() - t0
                (args.out / f"paused-{at[step]}").write_text(json.dumps({"step": step, "seconds": took}))
            dist.barrier()
    watch.close()
    (args.out / f"done-{rank}").write_text(json.dumps(watch.stats()["actions"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
