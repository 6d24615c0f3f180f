"""A small DDP training job on CPU (gloo) or GPU (NCCL), watched by stragglerwatch,
with an optional injected straggler: the job ``stragglerwatch demo`` runs.

    torchrun --nproc_per_node 4 -m stragglerwatch.cli.demo_job --steps 60 \
        --slow-rank 2 --delay 0.02 --cause compute --from-step 10

(from a checkout, ``examples/train_ddp.py`` runs the same job).

Injections (on ``--slow-rank`` from ``--from-step`` on, ``--delay`` seconds a step):
- ``compute``: the rank's forward and backward take longer (a third in forward,
  two thirds in backward), as on a throttled or weaker GPU;
- ``data``: the rank's data loader takes longer to deliver each batch;
- ``optimizer``: the rank's ``optimizer.step()`` takes longer (slow host, CPU offload);
- ``other``: host work between backward and the optimizer step takes longer
  (logging, metrics, checkpoint bookkeeping).
Hangs: ``--stall-rank R --stall-at-step N --stall-seconds S`` makes rank R sleep
S seconds before step N (the others then wait in the all-reduce); ``--kill-rank R
--kill-at-step N`` SIGKILLs rank R there (torchrun then tears the job down).
The model has a BatchNorm layer by default (``--model bn``), so DDP broadcasts its buffers at
every forward, and the loop all-reduces its loss for logging every ``--log-every`` steps, as
real jobs do; ``--model mlp --log-every 0`` is the bare loop. ``--pin-cpus 0,1`` pins rank 0 to
CPU 0 and rank 1 to CPU 1 (to contend one rank's CPU on purpose, as ``tests/test_context_distributed.py``
does). The training loop itself is plain PyTorch: stragglerwatch only sees it through
``attach(model)`` and ``watch.wrap(loader)``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import time
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import stragglerwatch


class Injection:
    """Where and when the straggler is slow; ``step`` is advanced by the loop."""

    def __init__(self, args: argparse.Namespace, rank: int):
        self.active_rank = args.slow_rank == rank
        self.cause = args.cause
        self.delay = args.delay
        self.from_step = args.from_step
        self.step = 0

    def delay_for(self, cause: str) -> float:
        if self.active_rank and self.cause == cause and self.step >= self.from_step:
            return self.delay
        return 0.0


class _Slow(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, delay: float) -> torch.Tensor:
        ctx.delay = delay
        time.sleep(delay / 3)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.delay / 3)
        return grad, None


class Net(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, injection: Injection, norm: bool = True):
        super().__init__()
        self.injection = injection
        self.inp = nn.Sequential(nn.Linear(features, hidden), *([nn.BatchNorm1d(hidden)] if norm else []))
        self.body = nn.Sequential(nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        delay = self.injection.delay_for("compute")
        if delay:  # on an activation that needs a gradient, so backward is slowed too
            h = _Slow.apply(h, delay)
        return self.body(h)


class SlowLoader:
    """The loader, with the data injection's delay before each batch (re-iterable per epoch)."""

    def __init__(self, loader: DataLoader, injection: Injection):
        self.loader = loader
        self.injection = injection

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            delay = self.injection.delay_for("data")
            if delay:
                time.sleep(delay)
            yield batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60, help="optimizer steps to run (default 60)")
    p.add_argument("--batch-size", type=int, default=64, help="samples per micro-batch (default 64)")
    p.add_argument("--hidden", type=int, default=512, help="hidden width of the MLP (default 512)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step, under no_sync() (default 1)")
    p.add_argument("--model", choices=("bn", "mlp"), default="bn",
                   help="bn: an MLP with a BatchNorm layer (buffers DDP broadcasts); mlp: no buffers (default bn)")
    p.add_argument("--log-every", type=int, default=10,
                   help="all-reduce the loss for logging every N steps (default 10; 0: never)")  # fmt: skip
    p.add_argument("--slow-rank", type=int, default=-1, help="rank to slow down (default: none)")
    p.add_argument("--delay", type=float, default=0.02, help="extra seconds a step on the slow rank (default 0.02)")
    p.add_argument("--cause", choices=("compute", "data", "optimizer", "other"), default="compute",
                   help="what is slow (default compute)")  # fmt: skip
    p.add_argument("--from-step", type=int, default=0, help="first slowed step (default 0)")
    p.add_argument("--run-dir", help="run dir (default $STRAGGLERWATCH_RUN_DIR or ./stragglerwatch-runs/<id>)")
    p.add_argument("--no-wrap", action="store_true", help="do not wrap the loader (data wait = gap before forward)")
    p.add_argument("--stall-rank", type=int, default=-1, help="rank that stalls (default: none)")
    p.add_argument("--stall-at-step", type=int, default=10, help="step before which it stalls (default 10)")
    p.add_argument("--stall-seconds", type=float, default=30.0, help="how long it stalls (default 30)")
    p.add_argument("--pg-timeout", type=float, default=None,
                   help="process-group timeout in seconds: a collective waiting longer fails (default: torch's)")
    p.add_argument("--kill-rank", type=int, default=-1, help="rank to SIGKILL (default: none)")
    p.add_argument("--kill-at-step", type=int, default=10, help="step before which it is killed (default 10)")
    p.add_argument(
        "--watchdog-timeout",
        type=float,
        default=None,
        help="seconds without progress before a stall is recorded (default: adaptive; 0: off)",
    )
    p.add_argument("--bucket-timings", action="store_true", help="also time each gradient bucket (comm hook)")
    p.add_argument("--no-watch", action="store_true", help="run without stragglerwatch (for comparison)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank (default 1)")
    p.add_argument("--pin-cpus", metavar="LIST",
                   help="pin rank r to CPU LIST[r] (comma-separated, e.g. 0,1,0,0; cycled when shorter)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.pin_cpus:
        cpus = [int(c) for c in args.pin_cpus.split(",")]
        os.sched_setaffinity(0, {cpus[int(os.environ.get("RANK", 0)) % len(cpus)]})
    use_cuda = torch.cuda.is_available()
    timeout = datetime.timedelta(seconds=args.pg_timeout) if args.pg_timeout else None
    dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    injection = Injection(args, rank)
    features, classes = 256, 10
    net = Net(features, args.hidden, classes, injection, norm=args.model == "bn")
    model = DDP(net.to(device), device_ids=[device] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    n = args.batch_size * args.accum * world * 8
    data = TensorDataset(torch.randn(n, features), torch.randint(0, classes, (n,)))
    loader = DataLoader(data, batch_size=args.batch_size, sampler=DistributedSampler(data, world, rank))
    watch = (
        None
        if args.no_watch
        else stragglerwatch.attach(
            model,
            args.run_dir,
            optimizer=optimizer,
            bucket_timings=args.bucket_timings,
            watchdog_timeout_s=args.watchdog_timeout,
        )
    )
    # registered after attach(), so that stragglerwatch's own pre-hook marks the optimizer start first
    optimizer.register_step_pre_hook(lambda *_: time.sleep(injection.delay_for("optimizer")))
    batches = SlowLoader(loader, injection)
    source = watch.wrap(batches) if watch and not args.no_wrap else batches
    loss_fn = nn.CrossEntropyLoss()
    step, micro = 0, 0
    t0 = time.perf_counter()
    while step < args.steps:
        for x, y in source:
            if rank == args.stall_rank and step == args.stall_at_step and micro % args.accum == 0:
                args.stall_rank = -1  # once
                time.sleep(args.stall_seconds)
            if rank == args.kill_rank and step == args.kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            micro += 1
            last_micro = micro % args.accum == 0
            with nullcontext() if last_micro else model.no_sync():
                loss = loss_fn(model(x), y)
                loss.backward()
            if not last_micro:
                continue
            time.sleep(injection.delay_for("other"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if args.log_every and step % args.log_every == 0:
                logged = loss.detach().clone()
                dist.all_reduce(logged)
                if rank == 0 and os.environ.get("TRAIN_DDP_VERBOSE"):
                    print(f"step {step}: loss {logged.item() / world:.4f}", flush=True)
            step += 1
            injection.step = step
            if step >= args.steps:
                break
    elapsed = time.perf_counter() - t0
    if watch is not None:
        watch.close()
    dist.barrier()
    if rank == 0:
        where = f"; run dir {watch.run_dir}" if watch else ""
        print(f"trained {step} steps on {world} ranks in {elapsed:.1f} s{where}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
