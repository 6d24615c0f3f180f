"""torch.compile: graph breaks and step time with and without stragglerwatch (not a pytest test).

One rank, gloo, world size 1, ``torch.compile(DDP(model))`` with the chosen backend (default:
inductor, what users get). Each run is a separate process: a plain one never imports
stragglerwatch, an attached one attaches after compile as the docs say. Runs alternate (and
which goes first), ``--pairs`` of each. Per run: Dynamo's graph-break count and number of graphs,
the first three steps (the compile), and over ``--steps`` timed steps the mean, median and p99
step. Prints each run, then the medians and the attached/plain ratios.

    python benchmarks/compile_overhead.py
    python benchmarks/compile_overhead.py --backend aot_eager --pairs 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch._dynamo as dynamo
import torch.distributed as dist
from separate import in_turns, result, step_summary
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


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


def worker(args: argparse.Namespace) -> None:
    """One run; prints its figures as JSON. Imports stragglerwatch only when attached."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank, this process
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    ddp = DDP(make_model(args.width))
    model = torch.compile(ddp, backend=args.backend)
    with tempfile.TemporaryDirectory() as tmp:
        watch = None
        if args.worker == "attached":
            import stragglerwatch

            watch = stragglerwatch.attach(model, os.path.join(tmp, "run"), watchdog_timeout_s=0)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        t0 = time.perf_counter()
        breaks, graphs = compile_and_count(model, opt, x, y)
        row = {"breaks": breaks, "graphs": graphs, "compile_s": time.perf_counter() - t0}
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(model, opt, x, y)
            times.append(time.perf_counter() - t0)
        row.update(step_summary(times))
        if watch is not None:
            row["busy_unavailable"] = watch.stats()["busy_unavailable"]
            watch.close()
            row["recorded"] = len(stragglerwatch.load_run(os.path.join(tmp, "run")))
    dist.destroy_process_group()
    print("RESULT " + json.dumps(row), flush=True)


def run(variant: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", variant, "--backend", args.backend, "--width", str(args.width),
           "--batch", str(args.batch), "--steps", str(args.steps)]  # fmt: skip
    return result(cmd, timeout_s=1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="inductor")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--pairs", type=int, default=3, help="runs of each variant (default 3)")
    p.add_argument("--steps", type=int, default=600, help="timed steps per run (default 600)")
    p.add_argument("--worker", choices=("plain", "attached"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"torch.compile(DDP(model)), backend={args.backend}, torch {torch.__version__}, {args.pairs} "
          f"pairs of separate runs (plain never imports stragglerwatch), {args.steps} timed steps each, "
          "alternating")  # fmt: skip
    runs: dict[str, list[dict]] = {"plain": [], "attached": []}
    for _, variant in in_turns(args.pairs, ("plain", "attached")):
        row = run(variant, args)
        runs[variant].append(row)
        print(f"  {variant:8s} graph breaks {row['breaks']}, graphs {row['graphs']}, compile "
              f"{row['compile_s']:.1f} s, mean {row['mean_s'] * 1e3:.3f} ms, median "
              f"{row['median_s'] * 1e3:.3f} ms, p99 {row['p99_s'] * 1e3:.3f} ms", flush=True)  # fmt: skip
    med = {v: {k: statistics.median(r[k] for r in rows) for k in ("mean_s", "median_s", "p99_s")}
           for v, rows in runs.items()}  # fmt: skip
    a, b = med["attached"], med["plain"]
    print(f"  attached/plain (medians of the runs): mean step {a['mean_s'] / b['mean_s']:.3f} "
          f"({(a['mean_s'] - b['mean_s']) * 1e6:+.0f} us a step), median step {a['median_s'] / b['median_s']:.3f}, "
          f"p99 step {a['p99_s'] / b['p99_s']:.3f}")  # fmt: skip
    last = runs["attached"][-1]
    print(f"  steps recorded {last['recorded']} of {args.steps + 3}, busy_unavailable "
          f"{last['busy_unavailable'] or 'none'}")


if __name__ == "__main__":
    main()
