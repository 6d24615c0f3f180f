"""Host cost of bracketing a collective where it is issued and where it is waited on (not a pytest test).

One gloo rank per process. Each run is a separate process, plain (never imports stragglerwatch) or
instrumented (an attached model with a training step open, so that every call goes through both
brackets and the probe); runs alternate, ``--runs`` of each. Per run and per kind (a synchronous
``all_reduce`` of a small tensor, an asynchronous one waited on, a ``broadcast``): the median over
``--blocks`` blocks of ``--calls`` calls of the time per call. Prints per kind the median of the
runs and the difference: what a collective costs the training thread more.

    python benchmarks/collective_cost.py
    python benchmarks/collective_cost.py --runs 8 --calls 4000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from separate import in_turns, result
from torch import nn


def kinds(t: torch.Tensor) -> dict[str, Callable[[], None]]:
    return {
        "all_reduce (sync)": lambda: dist.all_reduce(t),
        "all_reduce (async, waited)": lambda: dist.all_reduce(t, async_op=True).wait(),
        "broadcast (sync)": lambda: dist.broadcast(t, src=0),
    }


def block(call: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    return (time.perf_counter() - t0) / n


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank, this process
    t = torch.ones(16)
    row = {}
    with tempfile.TemporaryDirectory() as tmp:
        watch = None
        if args.worker == "instrumented":
            import stragglerwatch

            model = nn.Linear(4, 4)
            watch = stragglerwatch.attach(model, os.path.join(tmp, "run"), watchdog_timeout_s=0, context_interval_s=0,
                                          control_interval_s=0, flush_interval_s=60)  # fmt: skip
            model(torch.randn(2, 4))  # a step is open: every collective is this step's communication
        for name, call in kinds(t).items():
            block(call, args.calls // 4)  # warm
            row[name] = statistics.median(block(call, args.calls) for _ in range(args.blocks))
        if watch is not None:
            watch.close()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(row), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=6, help="runs of each variant (default 6)")
    p.add_argument("--blocks", type=int, default=5, help="blocks per kind in a run (default 5)")
    p.add_argument("--calls", type=int, default=2000, help="collectives per block (default 2000)")
    p.add_argument("--worker", choices=("plain", "instrumented"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"collective_cost: torch {torch.__version__}, gloo, 1 rank, {args.runs} runs of each variant (separate "
          f"processes, alternating), {args.blocks} blocks x {args.calls} calls per kind")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "instrumented": []}
    for _, variant in in_turns(args.runs, ("plain", "instrumented")):
        cmd = [sys.executable, __file__, "--worker", variant, "--blocks", str(args.blocks), "--calls", str(args.calls)]
        runs[variant].append(result(cmd, timeout_s=600))
    for name in runs["plain"][0]:
        plain = statistics.median(r[name] for r in runs["plain"])
        inst = statistics.median(r[name] for r in runs["instrumented"])
        print(f"  {name:28s} plain {plain * 1e6:7.1f} us  instrumented {inst * 1e6:7.1f} us  added "
              f"{(inst - plain) * 1e6:+6.1f} us a call (medians of the runs)")  # fmt: skip


if __name__ == "__main__":
    main()
