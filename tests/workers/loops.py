"""Training loops of other shapes than the example's, instrumented only as the README says.

Run under torchrun (gloo, CPU). Each flag turns on one shape real jobs have:
``--bn`` (BatchNorm: buffers DDP broadcasts at every forward), ``--sync-stats`` (a layer
that all-reduces its batch statistics in forward and backward, as SyncBatchNorm does on
GPU; DDP refuses SyncBatchNorm on CPU), ``--nested`` (the model returns a dataclass
holding a dict holding a list), ``--two-optimizers``, ``--closure``
(``optimizer.step(closure)``), ``--log-loss`` (the loop all-reduces its loss every step),
``--eval-every N`` (an evaluation pass under ``no_grad``, on rank 0 only with
``--eval-rank0``, then a barrier), ``--nccl-like`` (gloo's synchronous collectives finish in
the process-group call and return no ``Work``, as NCCL's do since torch 2.8; ``--nccl-like-after``:
installed after attach, above our taps), ``--fake-cuda``
(CUDA-event timing on the fake CUDA layer of ``tests/fake_cuda.py``),
``--scaler-skip-at N`` (GradScaler, with an inf loss at step N that makes it skip the
optimizer step). Injections: a slow rank (compute, data,
optimizer) and a stall before a step's batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fake_cuda import install as install_fake_cuda  # noqa: E402 - in tests/
from nccl_like import emulate  # noqa: E402 - beside this file
from train_ddp import _Slow as Slow  # noqa: E402 - the example's compute injection: sleeps in forward and backward


class SyncStats(torch.autograd.Function):
    """Centre the batch on the job-wide mean: an all-reduce in forward and one in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(0)
        dist.all_reduce(mean)
        return x - mean / dist.get_world_size()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        mean = grad.mean(0)
        dist.all_reduce(mean)
        return grad - mean / dist.get_world_size()


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    extras: dict[str, list[torch.Tensor]]


class Net(nn.Module):
    def __init__(self, args: argparse.Namespace, slow: Any):
        super().__init__()
        self.args, self.slow = args, slow
        self.inp = nn.Linear(64, args.hidden)
        self.bn = nn.BatchNorm1d(args.hidden) if args.bn else None
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 8))

    def forward(self, x: torch.Tensor) -> Any:
        h = self.inp(x)
        if self.bn is not None:
            h = self.bn(h)
        if self.args.sync_stats:
            h = SyncStats.apply(h)
        delay = self.slow("compute")
        if delay and self.training and torch.is_grad_enabled():
            h = Slow.apply(h, delay)
        out = self.head(h)
        if self.args.nested:
            return Output(logits=out, extras={"aux": [h.pow(2).mean()]})
        return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
    for flag in ("--bn", "--sync-stats", "--nested", "--two-optimizers", "--closure", "--log-loss", "--eval-rank0",
                 "--nccl-like", "--nccl-like-after", "--fake-cuda"):
        p.add_argument(flag, action="store_true")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--scaler-skip-at", type=int, default=-1)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--cause", choices=("compute", "data", "optimizer"), default="compute")
    p.add_argument("--delay", type=float, default=0.02)
    p.add_argument("--from-step", type=int, default=10)
    p.add_argument("--stall-rank", type=int, default=-1)
    p.add_argument("--stall-at", type=int, default=10)
    p.add_argument("--stall-seconds", type=float, default=6.0)
    p.add_argument("--watchdog-timeout", type=float, default=None)
    return p.parse_args(argv)


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    emulation = emulate() if args.nccl_like else None
    rank = dist.get_rank()
    torch.manual_seed(rank)
    step = 0

    def slow(cause: str) -> float:
        return args.delay if rank == args.slow_rank and cause == args.cause and step >= args.from_step else 0.0

    model = DDP(Net(args, slow))
    params = list(model.parameters())
    if args.two_optimizers:
        optimizers = [torch.optim.SGD(params[:2], lr=0.01), torch.optim.Adam(params[2:], lr=1e-3)]
    else:
        optimizers = [torch.optim.SGD(params, lr=0.01, momentum=0.9)]
    timing = None
    if args.fake_cuda:
        install_fake_cuda()
        timing = "cuda"
    watch = stragglerwatch.attach(model, args.run_dir, watchdog_timeout_s=args.watchdog_timeout, timing=timing)
    if args.nccl_like_after:
        emulation = emulate(above_taps=True)
    optimizers[-1].register_step_pre_hook(lambda *_: time.sleep(slow("optimizer")))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8) if args.scaler_skip_at >= 0 else None
    loss_fn = nn.CrossEntropyLoss()

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(slow("data"))
        return torch.randn(args.batch, 64), torch.randint(0, 8, (args.batch,))

    def loss_of(out: Any, y: torch.Tensor) -> torch.Tensor:
        if isinstance(out, Output):
            return loss_fn(out.logits, y) + 0.01 * out.extras["aux"][0]
        return loss_fn(out, y)

    while step < args.steps:
        if rank == args.stall_rank and step == args.stall_at:
            args.stall_rank = -1
            time.sleep(args.stall_seconds)
        x, y = batch()
        if args.closure:

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                optimizers[0].zero_grad()
                loss = loss_of(model(x), y)
                loss.backward()
                return loss

            loss = optimizers[0].step(closure)
        else:
            loss = loss_of(model(x), y)
            if scaler is not None:
                scale = float("inf") if step == args.scaler_skip_at else 1.0
                scaler.scale(loss * scale).backward()
                for opt in optimizers:
                    scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                for opt in optimizers:
                    opt.step()
            for opt in optimizers:
                opt.zero_grad()
        if args.log_loss:
            logged = loss.detach().clone()
            dist.all_reduce(logged)
            logged.item()
        step += 1
        if args.eval_every and step % args.eval_every == 0:
            # on one rank only, through the unwrapped module: DDP's forward would broadcast buffers
            evaluated = model.module if args.eval_rank0 else model
            model.eval()
            with torch.no_grad():
                if rank == 0 or not args.eval_rank0:
                    for _ in range(args.eval_batches):
                        evaluated(torch.randn(args.batch, 64))
            model.train()
            dist.barrier()
    watch.close()
    dist.barrier()
    if emulation is not None:  # the test checks the emulation took hold
        counts = {"finished": emulation.finished, "returned": emulation.returned}
        (Path(args.run_dir) / f"nccl-like-{rank}.json").write_text(json.dumps(counts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
