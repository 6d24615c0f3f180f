"""What the straggler policy costs rank 0's training thread: its stalls, with the analysis on a thread of
rank 0's process (the old way) and in a child process (the policy's way now).

A second process writes a large simulated run as a job does (``GrowingRun``: one Arrow stream per rank,
``--every`` steps of every rank each ``--pace`` seconds, a 30% straggler from a quarter of the run). Rank 0's
process is played by this one: its main thread spins in a tight Python loop, as a training thread runs
Python between its kernels, and notes every gap of more than 1 ms between two turns of the loop (the
time it could not run: the GIL held by another thread, or its CPU taken). Meanwhile, in turn:

- ``none``: no policy (the machine's own noise);
- ``thread``: the analysis as the policy ran it before, on a thread of this process: every ``--interval``
  seconds ``LiveRun.update()`` (every step of every rank kept) and the rule;
- ``process``: ``StragglerPolicy`` as ``attach`` starts it: its thread reads the views the child process
  (``python -m stragglerwatch.analysis.policyfeed``, niced, a window of ``--window`` steps) writes to a
  pipe, and runs the rule and the actions.

Prints, per variant, the longest stall and the stalls' total (and share of the time), the CPU time this
process's other threads ran meanwhile (the most they can have held the GIL: free of the machine's other
load, which the stalls are not), the policy thread's longest turn (a look of the old analysis; the
handling of one view, its rule and actions, now), the looks or views,
when the straggler was first acted on, and the memory of the analysis (the old arrays; the child's peak).
With two CPUs or more (``--no-pin``: none of this), this process runs on the first (the training thread's
core, and so the old analysis thread's too) and the writer and the analysis process on the second, as on a
node with a core to spare; the stalls are then the GIL's and the first core's. Not a test: the figures
depend on the machine.

    python benchmarks/policy_gil.py [--ranks 128] [--steps 20000] [--every 2000] [--pace 3] [--interval 3] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from stragglerwatch.analysis.policy import ActRule, due
from stragglerwatch.record.events import EventFile
from stragglerwatch.record.simulate import GrowingRun, Injection, SimConfig
from stragglerwatch.runtime.actions.stragglerpolicy import StragglerPolicy
from stragglerwatch.runtime.log import Problems

STALL_S = 0.001  # a gap between two turns of the spinning loop longer than this is a stall
RULE = replace(ActRule(), after_s=0.0)


def config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(ranks=args.ranks, steps=args.steps, seed=12, step_ms=50.0,
                     injections=[Injection(args.ranks // 2, 0.3, args.steps // 4)])  # fmt: skip


def write(args: argparse.Namespace) -> None:
    """The writer process: the run grows by ``--every`` steps each ``--pace`` seconds."""
    run = GrowingRun(args.write, config(args))
    print("ready", flush=True)
    sys.stdin.readline()  # go
    for upto in range(args.every, args.steps + 1, args.every):
        t0 = time.monotonic()
        run.flush(upto)
        time.sleep(max(0.0, args.pace - (time.monotonic() - t0)))


def spin(seconds: float) -> list[float]:
    """Turn a tight loop for ``seconds``; the gaps longer than ``STALL_S`` between two turns."""
    gaps = []
    prev = time.perf_counter()
    end = prev + seconds
    while prev < end:
        for _ in range(100):  # a few microseconds of Python
            pass
        now = time.perf_counter()
        if now - prev > STALL_S:
            gaps.append(now - prev)
        prev = now
    return gaps


class OldThread:
    """The analysis as the policy thread ran it before: ``LiveRun`` in this process."""

    def __init__(self, run: Path, interval: float):
        from stragglerwatch.analysis.live import LiveRun

        self.live, self.interval = LiveRun(run), interval
        self.looks, self.told, self.stop = 0, [], threading.Event()
        self.done: set[Any] = set()
        self.turns: list[float] = []  # seconds of each look: the thread's turns with rank 0's GIL
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.interval):
            t0 = time.perf_counter()
            self.live.update()
            self.looks += 1
            for v in due(self.live.analysis.report, RULE, self.done):
                self.done.add((None, None, v["rank"], v["since_step"]))
                self.told.append(v)
            self.turns.append(time.perf_counter() - t0)

    def memory_mb(self) -> float:
        arrays = [*self.live.data.arrays.values(), *self.live.det.arrays.values()]
        return sum(a.nbytes for a in arrays) / 2**20


class TimedPolicy(StragglerPolicy):
    """The policy, its thread's work on each view timed (parsing it, the rule, the actions)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.turns: list[float] = []

    def _judge(self, view: dict[str, Any]) -> list[dict[str, Any]]:
        t0 = time.perf_counter()
        try:
            return super()._judge(view)
        finally:
            self.turns.append(time.perf_counter() - t0)


def measure(variant: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    run = tmp / f"run-{variant}"
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = args.pin and len(cpus) >= 2
    writer = subprocess.Popen([sys.executable, __file__, "--write", str(run), "--ranks", str(args.ranks),
                               "--steps", str(args.steps), "--every", str(args.every), "--pace", str(args.pace)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert writer.stdout is not None and writer.stdin is not None
    assert writer.stdout.readline().strip() == "ready"
    if pin:
        os.sched_setaffinity(writer.pid, {cpus[1]})
        os.sched_setaffinity(0, {cpus[0]})
    duration = args.steps / args.every * args.pace + args.tail
    told: list[dict[str, Any]] = []
    policy: Any = None
    if variant == "thread":
        policy = OldThread(run, args.interval)
        policy.thread.start()
    elif variant == "process":
        policy = TimedPolicy(run, RULE, [told.append], EventFile(run / "events-00000.jsonl"), args.ranks,
                             interval_s=args.interval, problems=Problems(), window_steps=args.window)  # fmt: skip
        policy.start()
        end = time.monotonic() + 30
        while pin and policy.feed.proc is None and time.monotonic() < end:
            time.sleep(0.01)
        if pin and policy.feed.proc is not None:
            os.sched_setaffinity(policy.feed.proc.pid, {cpus[1]})
    writer.stdin.write("go\n")
    writer.stdin.flush()
    cpu0, main0 = time.process_time(), time.thread_time()
    gaps = spin(duration)
    # the CPU time this process's other threads ran meanwhile: the most they can have held the GIL
    others = (time.process_time() - cpu0) - (time.thread_time() - main0)
    out: dict[str, Any] = {"variant": variant, "seconds": duration, "longest_ms": max(gaps, default=0.0) * 1e3,
                           "stalls": len(gaps), "stalled_s": sum(gaps), "others_cpu_s": others}  # fmt: skip
    if variant == "thread":
        policy.stop.set()
        policy.thread.join(timeout=120)
        told = policy.told
        out.update(looks=policy.looks, memory=f"{policy.memory_mb():.0f} MB of arrays")
    elif variant == "process":
        feed = policy.feed
        policy.stop()
        last = feed.last or {}
        out.update(looks=policy.views, memory=f"child's peak RSS {last.get('max_rss_mb')} MB, {last.get('cells')} "
                   f"cells, a look {last.get('took_s')} s")  # fmt: skip
    if variant != "none":
        out["acted"] = [(v["rank"], v["since_step"]) for v in told]
        out["turn_ms"] = max(policy.turns, default=0.0) * 1e3
    writer.wait(timeout=600)
    if pin:
        os.sched_setaffinity(0, set(cpus))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=128)
    p.add_argument("--steps", type=int, default=20000)
    p.add_argument("--every", type=int, default=2000, help="steps the writer adds at a time")
    p.add_argument("--pace", type=float, default=3.0, help="seconds between two additions")
    p.add_argument("--interval", type=float, default=3.0, help="policy_interval_s")
    p.add_argument("--window", type=int, default=2000, help="straggler_window_steps")
    p.add_argument("--tail", type=float, default=10.0, help="seconds measured after the last addition")
    p.add_argument("--variant", action="append", choices=("none", "thread", "process"))
    p.add_argument("--no-pin", dest="pin", action="store_false", help="leave every process on every CPU")
    p.add_argument("--rounds", type=int, default=1, help="the variants measured this many times, in turn")
    p.add_argument("--write", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.write:
        write(args)
        return
    print(f"{args.ranks} ranks x {args.steps} steps of 50 ms, {args.every} more every {args.pace:g} s; the policy "
          f"every {args.interval:g} s; stalls: gaps > {STALL_S * 1e3:g} ms of a spinning main thread")  # fmt: skip
    results: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.rounds):  # the variants in turn, so that the machine's other load falls on each alike
            for variant in args.variant or ["none", "thread", "process"]:
                r = measure(variant, args, Path(tmp) / str(k))
                results.setdefault(variant, []).append(r)
                extra = "" if variant == "none" else (f"; {r['looks']} looks, the thread's longest turn "
                                                      f"{r['turn_ms']:.1f} ms; acted on (rank, first step) "
                                                      f"{r['acted']}; {r['memory']}")  # fmt: skip
                print(f"{variant:<8} longest stall {r['longest_ms']:7.1f} ms; {r['stalls']:5d} stalls, "
                      f"{r['stalled_s']:6.2f} s in all ({r['stalled_s'] / r['seconds']:.1%} of {r['seconds']:.0f} s); "
                      f"its other threads ran {r['others_cpu_s']:.2f} CPU-s{extra}", flush=True)  # fmt: skip
    if args.rounds > 1:
        for variant, rs in results.items():
            longest = statistics.median(r["longest_ms"] for r in rs)
            share = statistics.median(r["stalled_s"] / r["seconds"] for r in rs)
            others = statistics.median(r["others_cpu_s"] for r in rs)
            turn = f", the thread's longest turn {statistics.median(r['turn_ms'] for r in rs):.1f} ms" if (
                variant != "none") else ""  # fmt: skip
            print(f"median of {len(rs)}: {variant:<8} longest stall {longest:7.1f} ms, stalled {share:.1%} of the "
                  f"time, other threads {others:.2f} CPU-s{turn}")  # fmt: skip


if __name__ == "__main__":
    main()
