"""Host cost of bracketing a collective where it is issued and where it is waited on (not a pytest test).

One gloo rank in this process. Blocks of ``--calls`` collectives (a synchronous ``all_reduce`` of
a small tensor, an asynchronous one waited on, a ``broadcast``) alternate: plain blocks with nothing
of ours alive (no Watch: the taps are off the classes), instrumented blocks inside a training step
of an attached model (attached before the block, closed after it, so every instrumented call goes
through both brackets and the probe). Prints per kind the median time per call of each, and the
median of the per-block differences: what a collective costs the training thread more.

    python benchmarks/collective_cost.py
    python benchmarks/collective_cost.py --blocks 20 --calls 2000
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

import stragglerwatch


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=12, help="blocks of each (plain, instrumented) per kind")
    p.add_argument("--calls", type=int, default=1000, help="collectives per block")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank, this process
    model = nn.Linear(4, 4)
    t = torch.ones(16)
    run_dir = tempfile.mkdtemp(prefix="collective-cost-")
    print(f"collective_cost: torch {torch.__version__}, gloo, 1 rank, {args.blocks} blocks x {args.calls} calls")
    for name, call in kinds(t).items():
        block(call, args.calls // 4)  # warm
        plain, inst = [], []
        for i in range(args.blocks):
            for instrumented in ((False, True) if i % 2 == 0 else (True, False)):
                if not instrumented:
                    plain.append(block(call, args.calls))
                    continue
                watch = stragglerwatch.attach(model, run_dir, watchdog_timeout_s=0, context_interval_s=0,
                                              control_interval_s=0, flush_interval_s=60)  # fmt: skip
                model(torch.randn(2, 4))  # a step is open: every collective is this step's communication
                inst.append(block(call, args.calls))
                watch.close()
        added = statistics.median(b - a for a, b in zip(plain, inst, strict=True)) * 1e6
        print(f"  {name:28s} plain {statistics.median(plain) * 1e6:7.1f} us  instrumented "
              f"{statistics.median(inst) * 1e6:7.1f} us  added {added:+6.1f} us a call (median of blocks)")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
