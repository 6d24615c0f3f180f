"""torch.compile: graph breaks and step time with and without stragglerwatch (not a pytest test).

One process, gloo, world size 1, ``torch.compile(DDP(model))`` with the chosen backend (default:
inductor, what users get). Two identical compiled DDP models train side by side, one plain and one
attached after compile as the README says; blocks of steps alternate between them (and which goes
first). Prints Dynamo's graph-break count and number of graphs of each, the median step time of
each and the attached/plain ratio of the per-block medians.

    python benchmarks/compile_overhead.py
    python benchmarks/compile_overhead.py --backend aot_eager --blocks 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch._dynamo as dynamo
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch


class Net(nn.Module):
    """A model class of the user's own (Dynamo compiles user code, not torch.nn's own frames)."""

    def __init__(self, width: int):
        super().__init__()
        self.inp = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU())
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.inp(x) * 0.5)


def make_model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return Net(width)


def compile_and_count(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """Warm up (compiles); Dynamo's graph breaks and graphs for this model alone."""
    dynamo.utils.counters.clear()
    for _ in range(3):
        step(model, opt, x, y)
    breaks = sum(dynamo.utils.counters["graph_break"].values())
    graphs = dynamo.utils.counters["stats"]["unique_graphs"]
    return breaks, graphs


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--blocks", type=int, default=30)
    p.add_argument("--steps", type=int, default=20, help="steps per block")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank, this process
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    variants, counts = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("plain", "attached"):
            dynamo.reset()
            ddp = DDP(make_model(args.width))
            model = torch.compile(ddp, backend=args.backend)
            watch = None
            if name == "attached":
                watch = stragglerwatch.attach(model, os.path.join(tmp, "run"), watchdog_timeout_s=0)
            opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
            t0 = time.perf_counter()
            counts[name] = (*compile_and_count(model, opt, x, y), time.perf_counter() - t0)
            variants[name] = (model, opt, watch)
        per_block: dict[str, list[float]] = {n: [] for n in variants}
        for b in range(args.blocks):
            for name in list(variants)[:: 1 if b % 2 == 0 else -1]:
                model, opt, _ = variants[name]
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    step(model, opt, x, y)
                    times.append(time.perf_counter() - t0)
                per_block[name].append(statistics.median(times))
        unavailable = variants["attached"][2].stats()["busy_unavailable"]
        variants["attached"][2].close()
        recorded = len(stragglerwatch.load_run(os.path.join(tmp, "run")))
    dist.destroy_process_group()
    print(f"torch.compile(DDP(model)), backend={args.backend}, torch {torch.__version__}, "
          f"{args.blocks} blocks x {args.steps} steps, interleaved")  # fmt: skip
    for name, (breaks, graphs, secs) in counts.items():
        print(f"  {name:9s} graph breaks {breaks}, graphs {graphs}, first 3 steps (compile) {secs:.1f} s, "
              f"median step {statistics.median(per_block[name]) * 1e3:.3f} ms")  # fmt: skip
    ratios = [a / p for a, p in zip(per_block["attached"], per_block["plain"], strict=True)]
    of_medians = statistics.median(per_block["attached"]) / statistics.median(per_block["plain"])
    added_us = (statistics.median(per_block["attached"]) - statistics.median(per_block["plain"])) * 1e6
    print(f"  attached/plain: ratio of medians {of_medians:.3f} ({added_us:+.0f} us a step), "
          f"per-block ratios median {statistics.median(ratios):.3f}")  # fmt: skip
    print(f"  steps recorded {recorded}, busy_unavailable {unavailable or 'none'}")


if __name__ == "__main__":
    main()
