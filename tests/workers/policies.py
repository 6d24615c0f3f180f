"""Jobs for the policies' tests and benchmark (gloo, under torchrun or started directly).

Usage: policies.py MODE OUT_DIR [options]. Every rank trains a small DDP model with stragglerwatch
attached; what the test checks goes into OUT_DIR:

- ``hang``: in the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0), rank ``--culprit`` stops making
  progress at step ``--hang-step`` (a Python sleep in its data fetch: ``--stuck data``; or outside any
  phase the probe knows, ``--stuck other``); every attempt writes ``first-<restart>-<rank>`` (the time of its
  first finished step) and ``done-<restart>-<rank>`` at the end; the culprit writes ``hang-<rank>`` (when it
  stopped). ``--stuck native``: in native code holding the GIL (a libc ``sleep``), where no Python runs.
  ``--handler before|after|none``: the application's SIGTERM handler, installed before or after attach,
  writes ``ckpt-<restart>-<rank>`` and calls ``sys.exit(0)`` (once: a SIGTERM while it saves, torchrun's to the
  survivors, is ignored, as a handler under torchrun must);
- ``recover``: rank 1 pauses ``--pause`` seconds at step ``--hang-step``, then goes on;
- ``straggler``: rank ``--slow-rank`` (none: -1) sleeps ``--delay`` seconds in every forward from step
  ``--slow-from`` (``--contend``: instead, each rank pinned to a CPU of its own, busy processes pinned to its
  CPU from that step take most of it); ``--log-rank0 S``: rank 0 writes a metrics line to ``metrics.jsonl`` after
  every optimizer step, a duty of S seconds; rank 0's ``on_straggler`` action appends each verdict to
  ``verdicts.jsonl``.

Settings of the policies come from the environment (``STRAGGLERWATCH_ON_HANG`` and the others).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("mode", choices=("hang", "recover", "straggler"))
    p.add_argument("out", type=Path)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--culprit", type=int, default=1)
    p.add_argument("--hang-step", type=int, default=8)
    p.add_argument("--stuck", choices=("data", "other", "native"), default="data")
    p.add_argument("--handler", choices=("before", "after", "none"), default="none")
    p.add_argument("--pause", type=float, default=3.0)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--delay", type=float, default=0.02)
    p.add_argument("--slow-from", type=int, default=10, help="the first step of the slow rank's slowness")
    p.add_argument("--contend", action="store_true", help="slow the slow rank by CPU contention, not a sleep")
    p.add_argument("--hidden", type=int, default=64, help="the model's hidden width (more compute per step)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--log-rank0", type=float, default=0.0, help="seconds rank 0 spends logging after each step")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds each step sleeps on every rank")
    p.add_argument("--pg-timeout", type=float, default=600.0, help="the process group's collective timeout (s)")
    p.add_argument("--watchdog", type=float, default=2.0, help="watchdog_timeout_s (-1: the adaptive default)")
    p.add_argument("--victim-abort-s", type=float, default=0.0,
                   help="hang_abort_s of the ranks other than the culprit (0: the environment's): a longer bound "
                        "makes the culprit leave first, and the victims' collectives fail before they act")
    return p.parse_args()


#: A busy process: a Python loop that spins until killed, 120 s at most.
SPIN = "import time\nend = time.monotonic() + 120\nwhile time.monotonic() < end:\n    sum(range(10000))\n"


def contend(cpu: int, n: int = 4) -> list[subprocess.Popen]:
    """``n`` busy processes pinned to ``cpu``, each in a session of its own (where the kernel groups a
    session's tasks for scheduling, a CPU is shared between sessions: the rank gets a fifth of its CPU)."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN], start_new_session=True) for _ in range(n)]
    for spinner in spinners:
        os.sched_setaffinity(spinner.pid, {cpu})
    return spinners


class Slow(nn.Module):
    """Sleeps ``delay`` seconds in forward from step ``start`` on (a compute straggler)."""

    def __init__(self, start: int = 10) -> None:
        super().__init__()
        self.delay, self.calls, self.start = 0.0, 0, start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.delay and self.calls > self.start:
            time.sleep(self.delay)
        return x


def main() -> None:
    args = parse()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank = dist.get_rank()
    cpus = sorted(os.sched_getaffinity(0)) if args.contend else []
    if args.contend:  # each rank on a CPU of its own, as a real job binds its ranks
        os.sched_setaffinity(0, {cpus[rank % len(cpus)]})
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    slow = Slow(args.slow_from)
    width = args.hidden
    model = DDP(nn.Sequential(nn.Linear(32, width), nn.ReLU(), slow, nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 4)))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    saving: list[int] = []

    def checkpoint(signum: int, frame: object) -> None:
        if saving:  # torchrun's SIGTERM to the survivors, while this one saves: the first call finishes
            return
        saving.append(signum)
        torch.save(model.module.state_dict(), args.out / f"ckpt-{restart}-{rank}")
        sys.exit(0)

    if args.handler == "before":
        signal.signal(signal.SIGTERM, checkpoint)
    verdicts = args.out / "verdicts.jsonl"

    def note(verdict: dict) -> None:
        with verdicts.open("a") as f:
            f.write(json.dumps(verdict) + "\n")

    extra = {"on_straggler": ["exclude", note], "policy_interval_s": 1.0} if args.mode == "straggler" else {}
    watchdog = None if args.watchdog < 0 else args.watchdog
    if args.victim_abort_s and rank != args.culprit:
        os.environ["STRAGGLERWATCH_HANG_ABORT_S"] = str(args.victim_abort_s)
    watch = stragglerwatch.attach(model, args.out / "run", optimizer=opt, watchdog_timeout_s=watchdog,
                                  flush_interval_s=0.2, **extra)  # fmt: skip
    if args.handler == "after":
        signal.signal(signal.SIGTERM, checkpoint)
    if args.mode == "straggler" and rank == args.slow_rank and not args.contend:
        slow.delay = args.delay
    spinners: list[subprocess.Popen] = []
    metrics = (args.out / "metrics.jsonl").open("a") if args.log_rank0 and rank == 0 else None

    def fetch(step: int) -> torch.Tensor:
        stuck_here = args.mode == "hang" and restart == 0 and rank == args.culprit and step == args.hang_step
        if stuck_here:
            (args.out / f"hang-{rank}").write_text(repr(time.time()))
            if args.stuck == "native":  # libc sleep() without releasing the GIL: no Python thread runs
                ctypes.PyDLL(None).sleep(3600)
            while True:
                time.sleep(1.0)  # stopped making progress, in Python: its SIGTERM handler can run
        if args.mode == "recover" and rank == 1 and step == args.hang_step:
            time.sleep(args.pause)
        return torch.randn(args.batch, 32)

    get = watch.data(fetch) if args.stuck == "data" else fetch
    try:
        for step in range(args.steps):
            if args.contend and rank == args.slow_rank and step == args.slow_from:
                spinners = contend(cpus[rank % len(cpus)])
            x = get(step)
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if metrics is not None:  # rank 0's logging duty: a metrics line every step
                t0 = time.perf_counter()
                metrics.write(json.dumps({"step": step, "loss": loss.item(), "time": time.time()}) + "\n")
                metrics.flush()
                time.sleep(max(0.0, args.log_rank0 - (time.perf_counter() - t0)))
            if step == 0:
                (args.out / f"first-{restart}-{rank}").write_text(repr(time.time()))
            if args.step_sleep:
                time.sleep(args.step_sleep)
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait(timeout=30)
    watch.close()
    (args.out / f"done-{restart}-{rank}").write_text(json.dumps(watch.stats()["actions"]))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
