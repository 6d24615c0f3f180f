"""Host cost of our brackets on the collectives, as a user pays it (not a pytest test).

One gloo rank per process. Each run is a separate process, plain (never imports stragglerwatch) or
instrumented (the model attached with its defaults); runs alternate, ``--runs`` of each.

- Per call: a training step is opened and every call goes through the bracket where it is issued and
  the one where it is waited on. Per kind (a synchronous ``all_reduce`` of a small tensor, an
  asynchronous one waited on, a ``broadcast``): the median over ``--blocks`` blocks of ``--calls``
  calls of the time per call.
- Per step (``--per-step``, default 10 100 400): real training steps of a small model (forward, that
  many collectives, half synchronous ``all_reduce``, half ``all_gather_into_tensor`` waited on,
  backward, ``optimizer.step()``): the median step over ``--blocks`` blocks of ``--steps`` steps. The
  difference is what the job pays a step (the log thread's share of the interpreter included), and
  divided by the collectives, an upper bound of what one collective costs (the step's own hooks are
  in it too).

Prints per kind the median of the runs and the difference.

    python benchmarks/collective_cost.py
    python benchmarks/collective_cost.py --runs 8 --calls 4000 --per-step 10 100 400
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


def step_block(model: nn.Module, opt: torch.optim.Optimizer, n: int, steps: int) -> float:
    """Median-free mean seconds of ``steps`` training steps issuing ``n`` collectives each."""
    t = torch.ones(16)
    out = torch.empty(16)
    x = torch.randn(2, 4)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = model(x).sum()
        for i in range(n):
            if i % 2:
                dist.all_gather_into_tensor(out, t, async_op=True).wait()
            else:
                dist.all_reduce(t)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return (time.perf_counter() - t0) / steps


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # one rank, this process
    t = torch.ones(16)
    row = {}
    if args.worker == "instrumented":
        import stragglerwatch
    with tempfile.TemporaryDirectory() as tmp:
        watch = None
        if args.worker == "instrumented":
            model = nn.Linear(4, 4)
            watch = stragglerwatch.attach(model, os.path.join(tmp, "run"), watchdog_timeout_s=0, context_interval_s=0,
                                          control_interval_s=0, flush_interval_s=60)  # fmt: skip
            model(torch.randn(2, 4))  # a step is open: every collective is this step's communication
        for name, call in kinds(t).items():
            block(call, args.calls // 4)  # warm
            row[name] = statistics.median(block(call, args.calls) for _ in range(args.blocks))
        if watch is not None:
            watch.close()
        for n in args.per_step:
            model = nn.Linear(4, 4)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            watch = None
            if args.worker == "instrumented":
                watch = stragglerwatch.attach(model, os.path.join(tmp, f"steps{n}"), optimizer=opt)
            step_block(model, opt, n, max(5, args.steps // 5))  # warm
            row[f"step of {n} collectives"] = statistics.median(step_block(model, opt, n, args.steps)
                                                                for _ in range(args.blocks))  # fmt: skip
            if watch is not None:
                watch.close()
    dist.destroy_process_group()
    print("RESULT " + json.dumps(row), flush=True)


def brackets_alone() -> None:
    """The brackets around a no-op instead of a collective, in this process (``timeit``, best of 5)."""
    import functools
    import timeit

    from torch import nn

    from stragglerwatch.runtime.capture.probes import StepProbe
    from stragglerwatch.runtime.capture.taps import _issue_wrapper, _wait_wrapper

    probe = StepProbe(lambda marks: None)
    probe.on_forward_pre(nn.Linear(1, 1), (torch.ones(1, 1),), {})  # a step is open

    def work(*args: object) -> object:
        return object()

    def none(*args: object) -> None:
        return None

    n = 200_000
    for name, call in (("no-op alone", work), ("wait bracket", _wait_wrapper(work, [probe])),
                       ("issue returning a Work (clock read)", _issue_wrapper(work, [probe])),
                       ("issue returning None (bracket kept)", _issue_wrapper(none, [probe]))):  # fmt: skip
        best = min(timeit.repeat(functools.partial(call, None), number=n, repeat=5)) / n
        probe._cur.comm.clear()  # type: ignore[union-attr]
        print(f"  {name:38s} {best * 1e6:5.2f} us a call")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=6, help="runs of each variant (default 6)")
    p.add_argument("--blocks", type=int, default=5, help="blocks per kind in a run (default 5)")
    p.add_argument("--calls", type=int, default=2000, help="collectives per block (default 2000)")
    p.add_argument("--worker", choices=("plain", "instrumented"), help=argparse.SUPPRESS)
    p.add_argument("--per-step", type=int, nargs="*", default=[10, 100, 400],
                   help="collectives per training step, one kind each (default 10 100 400)")
    p.add_argument("--steps", type=int, default=100, help="training steps per block (default 100)")
    p.add_argument("--brackets", action="store_true", help="time only the brackets around a no-op, in this process")
    args = p.parse_args()
    if args.brackets:
        brackets_alone()
        return
    if args.worker:
        worker(args)
        return
    print(f"collective_cost: torch {torch.__version__}, gloo, 1 rank, {args.runs} runs of each variant (separate "
          f"processes, alternating), {args.blocks} blocks x {args.calls} calls per kind")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "instrumented": []}
    for _, variant in in_turns(args.runs, ("plain", "instrumented")):
        cmd = [sys.executable, __file__, "--worker", variant, "--blocks", str(args.blocks), "--calls", str(args.calls),
               "--steps", str(args.steps), "--per-step", *map(str, args.per_step)]
        runs[variant].append(result(cmd, timeout_s=600))
    for name in runs["plain"][0]:
        plain = statistics.median(r[name] for r in runs["plain"])
        inst = statistics.median(r[name] for r in runs["instrumented"])
        added = (inst - plain) * 1e6
        per = f"{added:+6.1f} us a call"
        if name.startswith("step of "):
            n = int(name.split()[2])
            per = f"{added:+7.1f} us a step, {added / n:+5.2f} us a collective"
        print(f"  {name:28s} plain {plain * 1e6:8.1f} us  instrumented {inst * 1e6:8.1f} us  added {per} "
              "(medians of the runs)")  # fmt: skip


if __name__ == "__main__":
    main()
