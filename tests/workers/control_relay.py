"""A small gloo DDP job for the control file's relay test, driven from outside through files.

Each rank's node-local directory is ``--node-base``/host<k>, the ranks split over ``--hosts`` simulated
hosts in rank order, and it attaches with ``control_interval_s=--interval``. After attach, every rank
counts the ``os.stat`` and ``open`` calls on the shared ``control.json`` (the real calls go on). Rank 0
looks for signal files in ``--signal-dir`` at every step and shares what it saw with one all-reduce:
``leave`` (holding a rank number) makes every rank note its counts so far in ``left-<rank>.json`` and
that rank close its Watch and go on training unwatched; ``stop`` ends the loop (as does
``--deadline-s``). Each rank writes ``ready-<rank>.json`` (its role) after attach and ``done-<rank>.json``
(counts, role, the settings in force) at the end.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch

COUNTS = {"stat": 0, "open": 0}


def spy_on(path: Path) -> None:
    """Count the calls on ``path`` of ``os.stat`` and ``open`` (pathlib's reads go through ``io.open``)."""
    target = os.path.abspath(path)
    real_stat, real_open = os.stat, io.open

    def stat(p: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(p, (str, os.PathLike)) and os.path.abspath(p) == target:
            COUNTS["stat"] += 1
        return real_stat(p, *args, **kwargs)

    def open_(p: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(p, (str, os.PathLike)) and os.path.abspath(p) == target:
            COUNTS["open"] += 1
        return real_open(p, *args, **kwargs)

    os.stat, io.open = stat, open_


def look(watch: stragglerwatch.Watch) -> dict[str, Any]:
    state = watch.controls.state()
    return {**COUNTS, "control_file": state["controls"]["control_file"], "settings": state["settings"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--signal-dir", required=True)
    parser.add_argument("--node-base", required=True)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--deadline-s", type=float, default=120.0)
    args = parser.parse_args()
    signals = Path(args.signal_dir)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ["STRAGGLERWATCH_NODE_DIR"] = f"{args.node_base}/host{rank * args.hosts // world}"
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, args.run_dir, optimizer=opt, control_interval_s=args.interval,
                                  context_interval_s=0)  # fmt: skip
    spy_on(Path(args.run_dir) / "control.json")
    (signals / f"ready-{rank}.json").write_text(json.dumps(look(watch)))
    deadline = time.monotonic() + args.deadline_s
    left, seen = None, {}
    while True:
        flags = torch.zeros(2)
        if rank == 0:
            flags[0] = float((signals / "stop").exists() or time.monotonic() > deadline)
            text = (signals / "leave").read_text().strip() if left is None and (signals / "leave").exists() else ""
            if text.isdigit():
                flags[1] = 1.0 + int(text)
        dist.all_reduce(flags)
        if flags[0] > 0:
            break
        if flags[1] > 0:
            left = int(flags[1]) - 1
            seen = look(watch)
            if rank == left:
                watch.close()
            (signals / f"left-{rank}.json").write_text(json.dumps(seen))
        nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
        opt.step()
        opt.zero_grad()
        time.sleep(0.01)
    (signals / f"done-{rank}.json").write_text(json.dumps(look(watch)))
    watch.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
