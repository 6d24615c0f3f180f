"""The training job of ``benchmarks/peers.py``: a small DDP job on CPU (gloo), with one injected
straggler, instrumented for one tool at a time (not a pytest test).

    python -m torch.distributed.run --standalone --nproc_per_node 4 benchmarks/peers_job.py \
        --tool none --scenario data --slow-rank 2 --from-step 100 --out OUT_DIR

Scenarios (on ``--slow-rank`` from step ``--from-step`` on, ``--delay`` seconds a step):

- ``healthy``: nothing injected;
- ``data``: the rank's DataLoader takes longer to deliver each batch (a sleep in its
  ``collate_fn``, so the wait happens inside ``DataLoader.__next__``, where every tool looks
  for data wait);
- ``compute``: the rank's forward and backward take longer (an autograd function that sleeps a
  third of the delay in forward and two thirds in backward, as a slower GPU would spread it).

A sleep, not extra work: the 4 ranks share the machine's cores, and extra arithmetic on one rank
would slow the others too.

Tools (``--tool``), each instrumented as its own documentation shows for a plain PyTorch loop:

- ``none``: the plain loop;
- ``stragglerwatch``: ``watch = stragglerwatch.attach(model, run_dir, optimizer=opt)`` and
  ``for x, y in watch.wrap(loader)``;
- ``traceml``: ``traceml.init(mode="auto")`` and ``with traceml.trace_step(model):`` around
  ``zero_grad`` ... ``optimizer.step()``; the job must then be launched by ``traceml run``;
- ``nvrx``: nvidia-resiliency-ext's straggler ``Detector``: sections ``data_loading`` (the
  batch fetch) and ``fwd`` (the forward), CPU timing only (``profile_cuda=False``), a
  ``generate_report()`` every ``--nvrx-every`` steps and ``identify_stragglers()`` on rank 0
  with its default thresholds. On a machine without CUDA its report path needs two stubs,
  applied in this process only and only for this tool: an empty stand-in for its CUPTI
  extension (``nvrx_cupti_module``, which links ``libcupti.so.12``: ``Detector.initialize``
  imports it, and with ``profile_cuda=False`` only its ``initialize``/``get_stats``/``reset``/
  ``shutdown`` are called, which return nothing to score), and ``torch.cuda.synchronize`` as a
  no-op (``generate_report`` calls it first; on CPU nothing is queued).

Every rank writes ``OUT_DIR/steps-<rank>.json``: its per-step wall times and, for ``nvrx``,
rank 0 the reports (scores and the stragglers identified at each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.data._utils.collate import default_collate

FEATURES, CLASSES, POOL = 256, 10, 4096


class Injection:
    """Whether this rank is slowed, and where; ``step`` is the training step being run."""

    def __init__(self, args: argparse.Namespace, rank: int):
        self.active = args.scenario != "healthy" and args.slow_rank == rank
        self.scenario = args.scenario
        self.delay = args.delay
        self.from_step = args.from_step
        self.step = 0

    def delay_for(self, cause: str, step: int) -> float:
        if self.active and self.scenario == cause and step >= self.from_step:
            return self.delay
        return 0.0


def _slow_backward(delay: float) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        time.sleep(delay)
        return grad

    return hook


class Net(nn.Module):
    def __init__(self, hidden: int, injection: Injection):
        super().__init__()
        self.injection = injection
        self.inp = nn.Linear(FEATURES, hidden)
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        delay = self.injection.delay_for("compute", self.injection.step)
        if delay:  # a third in the forward; two thirds in the backward, through the activation's gradient
            time.sleep(delay / 3)
            h.register_hook(_slow_backward(2 * delay / 3))
        return self.body(h)


class Samples(Dataset):
    """``n`` samples cycled from a fixed pool (the same data on every rank and run)."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.n = n
        self.x = torch.randn(POOL, FEATURES, generator=g)
        self.y = torch.randint(0, CLASSES, (POOL,), generator=g)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i % POOL], self.y[i % POOL]


class SlowCollate:
    """``default_collate``, after the data injection's sleep; batch k is the one step k uses
    (``num_workers=0``: collation runs in the training process, inside ``next()``)."""

    def __init__(self, injection: Injection):
        self.injection = injection
        self.batches = 0

    def __call__(self, samples: list) -> Any:
        delay = self.injection.delay_for("data", self.batches)
        self.batches += 1
        if delay:
            time.sleep(delay)
        return default_collate(samples)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tool", choices=("none", "stragglerwatch", "traceml", "nvrx"), default="none")
    p.add_argument("--scenario", choices=("healthy", "data", "compute"), default="healthy")
    p.add_argument("--slow-rank", type=int, default=2, help="the slowed rank (default 2)")
    p.add_argument("--from-step", type=int, default=100, help="first slowed step, from 0 (default 100)")
    p.add_argument("--delay", type=float, default=0.02, help="extra seconds a step (default 0.02)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--hidden", type=int, default=512, help="hidden width of the MLP (default 512)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per step per rank (default 64)")
    p.add_argument("--out", required=True, help="directory for steps-<rank>.json")
    p.add_argument("--run-dir", help="stragglerwatch's run dir (default OUT/stragglerwatch)")
    p.add_argument("--nvrx-every", type=int, default=50, help="nvrx: steps between reports (default 50)")
    return p.parse_args(argv)


def stub_nvrx_cuda() -> None:
    """The two stand-ins nvrx's report path needs where CUDA is absent (see the module docstring)."""
    if torch.cuda.is_available():
        return
    try:
        import nvrx_cupti_module  # noqa: F401  # type: ignore[import-not-found]
    except ImportError:
        class CuptiProfiler:  # what CuptiManager calls, with nothing profiled
            def __init__(self, **_: Any):
                pass

            def initialize(self) -> None:
                pass

            def shutdown(self) -> None:
                pass

            def start(self) -> None:
                raise RuntimeError("CUDA profiling is not available on this machine")

            stop = start

            def get_stats(self) -> dict:
                return {}

            def reset(self) -> None:
                pass

        module = types.ModuleType("nvrx_cupti_module")
        module.CuptiProfiler = CuptiProfiler  # type: ignore[attr-defined]
        sys.modules["nvrx_cupti_module"] = module
    torch.cuda.synchronize = lambda *_, **__: None  # type: ignore[assignment]


def stragglers_of(found: dict[str, Any]) -> dict[str, Any]:
    """``identify_stragglers()``'s sets as ranks (JSON)."""
    return {
        key: ({sec: sorted(s.rank for s in ids) for sec, ids in val.items()} if isinstance(val, dict)
              else sorted(s.rank for s in val))
        for key, val in found.items()
    }  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.tool == "nvrx":
        stub_nvrx_cuda()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    injection = Injection(args, rank)
    model = DDP(Net(args.hidden, injection))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    data = Samples(args.steps * args.batch_size * world)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data, world, rank, shuffle=False),
                        collate_fn=SlowCollate(injection))  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ends: list[float] = []
    reports: list[dict[str, Any]] = []

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    dist.barrier()
    t0 = time.perf_counter()
    if args.tool == "none":
        for step, (x, y) in enumerate(loader):
            injection.step = step
            train_step(x, y)
            ends.append(time.perf_counter())
    elif args.tool == "stragglerwatch":
        import stragglerwatch

        watch = stragglerwatch.attach(model, args.run_dir or str(out / "stragglerwatch"), optimizer=opt)
        for step, (x, y) in enumerate(watch.wrap(loader)):
            injection.step = step
            train_step(x, y)
            ends.append(time.perf_counter())
        watch.close()
    elif args.tool == "traceml":
        import traceml_ai as traceml

        traceml.init(mode="auto")
        for step, (x, y) in enumerate(loader):
            injection.step = step
            with traceml.trace_step(model):
                train_step(x, y)
            ends.append(time.perf_counter())
    else:
        from nvidia_resiliency_ext import straggler

        straggler.Detector.initialize(scores_to_compute=["relative_perf_scores", "individual_perf_scores"],
                                      gather_on_rank0=True)  # fmt: skip
        batches = iter(loader)
        for step in range(len(loader)):
            injection.step = step
            with straggler.Detector.detection_section("data_loading", profile_cuda=False):
                x, y = next(batches)
            opt.zero_grad(set_to_none=True)
            with straggler.Detector.detection_section("fwd", profile_cuda=False):
                output = model(x)
            loss = loss_fn(output, y)
            loss.backward()
            opt.step()
            if (step + 1) % args.nvrx_every == 0:  # a report on the last --nvrx-every steps
                report = straggler.Detector.generate_report()
                if rank == 0:
                    reports.append({
                        "step": step,
                        "section_relative": {k: dict(v) for k, v in report.section_relative_perf_scores.items()},
                        "section_individual": {k: dict(v) for k, v in report.section_individual_perf_scores.items()},
                        "gpu_relative": dict(report.gpu_relative_perf_scores),
                        "stragglers": stragglers_of(report.identify_stragglers()),
                    })  # fmt: skip
            ends.append(time.perf_counter())
        straggler.Detector.shutdown()
    steps_s = [b - a for a, b in zip([t0, *ends[:-1]], ends, strict=True)]
    record = {"rank": rank, "tool": args.tool, "scenario": args.scenario, "step_s": steps_s, "reports": reports}
    (out / f"steps-{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
