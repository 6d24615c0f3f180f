"""The log thread's CPU per step, by collectives per step (not a pytest test).

The training thread only appends marks; the step log thread turns each step's marks into a record
(``timing.anatomy``: carving the step into phases, naming the gaps) and writes it. That work grows
with the intervals a step holds, and FSDP issues hundreds of collectives a step. The thread holds
the interpreter lock while it runs Python, so its CPU is taken from the training thread's.

For each count of collectives: one gloo rank in this process, a model whose forward issues that
many synchronous ``all_reduce`` calls of a small tensor, attached with the default settings; the
log thread's own CPU clock (``pthread_getcpuclockid``) read before the timed steps and after a
flush that wrote them, divided by the steps. Beside it, the same marks (a step's, kept) replayed
into a writer of its own with no training thread running (the thread's own work: in the job, a
training thread that releases the interpreter lock at every collective makes the log thread take
it back many times a flush), and ``anatomy`` alone on synthetic marks of that many collectives,
called directly (the pure function, without the write).

Then the copy of PyTorch's record of the collectives (``runtime/capture/collectives.py``, multi-rank
jobs only, on the same thread): one read of the Flight Recorder ring holding that many entries, its
time (the interpreter lock is held throughout: the training thread waits that long) and, paced as it
is, its share of the wall clock.

    python benchmarks/logthread_cost.py
    python benchmarks/logthread_cost.py --collectives 2 100 400 1000 --steps 500
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import threading
import time
import timeit
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import stragglerwatch
from stragglerwatch.runtime.capture.collectives import ALIGNED_S, BUDGET, MAX_READ_S, CollectiveLog
from stragglerwatch.runtime.capture.timing import StepMarks, anatomy
from stragglerwatch.runtime.output.writer import EventLogWriter

TARGET_US = 100.0


class Chatty(nn.Module):
    """A linear layer whose forward issues ``n`` collectives (as FSDP's all-gathers would)."""

    def __init__(self, n: int):
        super().__init__()
        self.n = n
        self.lin = nn.Linear(16, 16)
        self.flag = torch.zeros(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.n):
            dist.all_reduce(self.flag)
        return self.lin(x)


def thread_cpu(name_prefix: str) -> float:
    """CPU seconds of the live thread whose name starts with ``name_prefix``."""
    for t in threading.enumerate():
        if t.name.startswith(name_prefix) and t.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
    raise RuntimeError(f"no thread named {name_prefix}*")


def log_thread_per_step(n: int, steps: int, tmp: str) -> tuple[float, StepMarks | None]:
    """The log thread's CPU per step of an attached job, and the marks of one of its steps."""
    model = Chatty(n)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    watch = stragglerwatch.attach(model, os.path.join(tmp, f"run-{n}"), optimizer=opt)
    kept: list[StepMarks] = []
    submit = watch._writer.submit

    def keep(marks: StepMarks) -> None:  # measurement only: one step's marks kept for the replay
        if len(kept) < 10:
            kept.append(marks)
        submit(marks)

    watch._probe._sink = keep
    try:
        for _ in range(5):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        watch.flush()
        before, written = thread_cpu("stragglerwatch-log-"), watch.stats()["steps_written"]
        for _ in range(steps):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        watch.flush()
        cpu, done = thread_cpu("stragglerwatch-log-") - before, watch.stats()["steps_written"] - written
    finally:
        watch.close()
    return cpu / max(1, done), (kept[-1] if kept else None)


def writer_alone(marks: StepMarks, steps: int, tmp: str) -> float:
    """The log thread's CPU per step for the same marks replayed into a writer of its own, with no
    training thread running: its own work, without contention for the interpreter lock."""
    folder = Path(tmp) / f"alone-{len(marks.comm)}"
    folder.mkdir(exist_ok=True)
    writer = EventLogWriter(folder / "rank-00000.arrows", 0, 0.0, flush_interval_s=3600)
    try:
        writer.request_flush()
        before = thread_cpu("stragglerwatch-log-")
        for _ in range(steps):
            writer.submit(copy.copy(marks))
        writer.request_flush()
        cpu, done = thread_cpu("stragglerwatch-log-") - before, writer.steps_written
    finally:
        writer.close()
    return cpu / max(1, done)


def synthetic_marks(n: int) -> StepMarks:
    """A step of one forward and one backward with ``n`` collectives inside them, an optimizer step."""
    m = StepMarks(1, 0.0, 0.0)
    m.fwd_start, m.fwd_end, m.bwd_start, m.bwd_end = [0.001], [0.4], [0.4], [0.9]
    m.comm = [(0.001 + i * 0.89 / n, 0.001 + i * 0.89 / n + 0.3 / n) for i in range(n)]
    m.sync = [(0.88, 0.9)]
    m.opt = [[0.9, 0.95]]
    m.end = 1.0
    return m


def anatomy_alone(n: int, calls: int = 300) -> float:
    m = synthetic_marks(n)
    timer = timeit.Timer(lambda: anatomy(m, 0, 0.0), timer=time.thread_time)
    return min(timer.repeat(number=calls, repeat=7)) / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--collectives", type=int, nargs="+", default=[2, 100, 400], help="per step (default 2 100 400)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per count (default 300)")
    p.add_argument("--repeats", type=int, default=3, help="runs per count; the median is printed (default 3)")
    p.add_argument("--ring", type=int, nargs="*", default=[100, 400, 2000],
                   help="entries in PyTorch's ring for the read timings (default 100 400 2000)")
    args = p.parse_args()
    torch.set_num_threads(1)
    print(f"log thread CPU per step, 1 gloo rank, default settings, {args.steps} steps, median of {args.repeats} "
          f"runs (target: {TARGET_US:.0f} us at 400 collectives)")  # fmt: skip
    print("| collectives a step | log thread CPU a step, in the job | the same marks, writer alone | "
          "anatomy alone (synthetic marks) |")  # fmt: skip
    print("|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            ring_reads(args.ring, tmp)  # first: PyTorch's ring holds this process's collectives, and only grows
            for n in args.collectives:
                runs = [log_thread_per_step(n, args.steps, tmp) for _ in range(args.repeats)]
                cpu, marks = statistics.median(c for c, _ in runs), runs[-1][1]
                alone = [writer_alone(marks, args.steps, tmp) for _ in range(args.repeats)] if marks else []
                print(f"| {n} | {cpu * 1e6:.0f} us | {statistics.median(alone) * 1e6 if alone else float('nan'):.0f} "
                      f"us | {anatomy_alone(n) * 1e6:.0f} us |", flush=True)  # fmt: skip
        finally:
            dist.destroy_process_group()


def ring_reads(fills: list[int], tmp: str) -> None:
    """One read of PyTorch's ring at each fill (entries it holds), median of 5, and what pacing makes of it."""
    print(f"reading PyTorch's record of the collectives (a ring of {os.environ.get('TORCH_FR_BUFFER_SIZE', 2000)} "
          f"entries; reads paced at {BUDGET:.0%} of the wall clock, then every {ALIGNED_S:.0f} s once one exceeds "
          f"{MAX_READ_S * 1e3:.0f} ms)")  # fmt: skip
    print("| entries in the ring | one read (interpreter lock held) | per entry | share of the wall clock, paced |")
    print("|---|---|---|---|")
    t = torch.ones(4)
    done = 0
    for n in fills:
        for _ in range(max(0, n - done - 5)):  # the 5 reads below add none; the setup's own few are counted
            dist.all_reduce(t)
        done = max(done, n)
        times = []
        for _ in range(5):
            log = CollectiveLog(Path(tmp) / "collectives.jsonl", threading.get_ident, budget=1.0)
            t0 = time.perf_counter()
            log.read()
            times.append(time.perf_counter() - t0)
        read = statistics.median(times)
        share = BUDGET if read <= MAX_READ_S else read / ALIGNED_S
        print(f"| {log.rows} | {read * 1e3:.1f} ms | {read / max(1, log.rows) * 1e6:.1f} us | "
              f"{share:.3%} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
