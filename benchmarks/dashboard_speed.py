"""Time a user waits for the dashboard on a large live run (not a pytest test).

1. ``end-to-end`` (a live run): a simulated run of 1,024 ranks is written as a job writes it (from a
   process of its own), one Arrow stream per rank, ``--first`` steps and then a flush of ``--flush-steps`` more steps to
   every rank at a time, up to ``--steps`` (2,000 to 10,000 by default). The dashboard's run-dir
   source follows it on its own thread, polling every ``--poll`` s. For every flush the path a
   user waits for is timed: from the flush on disk until the source holds the updated analysis,
   then until the page's content (figures and table) is made ahead for it, on its own thread as
   in the app, then that content serialised to the JSON Dash sends. Prints the median and worst per
   1,000 steps, and how soon a flush shows: the page asks every refresh period, at a time of its own,
   and gets the content at its first ask after the source's update (or once made, if it is being
   made then), averaged over when in its period the page asks. Each flush comes at a random point of
   the source's polling period, as a job's does. ``--no-ahead``: the content made when the page asks
   (as before the app made it ahead). Before the source starts, times what a flush would cost a
   source that re-read and re-analysed the whole run. When the run stops growing, checks that the source settles on the
   report ``analyze`` gives, and prints the memory of the followed run's arrays per record. With ``--window``,
   the source follows the last ``--window`` steps only: every 1,000 steps it prints the bytes its arrays
   hold and the process's resident memory, which stay flat however long the run grows.
2. ``render`` only: the refresh callback's work on a prepared snapshot of ``--steps`` steps.
3. ``small``: how soon the live page names a small straggler. A quiet run (256 ranks, 0.5% of jitter per
   step, 100 ms steps) whose rank 17's compute becomes 5% slower at step 600 (its busy time 3.5%) is
   written ``--flush-steps`` at a
   time and followed as above; prints the flush at which the source's report first names the rank and
   the wall time from that flush on disk, beside the step at which ``analyze`` on the whole run flags
   it: the batch that proves it is the one holding that step.

    python benchmarks/dashboard_speed.py [--ranks 1024 --first 2000 --steps 10000 --flush-steps 10] [--tokens 4096]
        [--window 2048]
"""

from __future__ import annotations

import argparse
import inspect
import json
import multiprocessing
import random
import resource
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
import plotly.io as pio
from plotly.utils import PlotlyJSONEncoder

from stragglerwatch._memory import for_analysis
from stragglerwatch.analysis.detect import detect, to_matrix
from stragglerwatch.analysis.live import LiveRun
from stragglerwatch.analysis.report import Analysis, RankFigures, analyze_run, build_report
from stragglerwatch.presentation.dashboard import Snapshot
from stragglerwatch.presentation.dashboard.app import create_app, render
from stragglerwatch.presentation.dashboard.prerender import Prerender
from stragglerwatch.presentation.dashboard.sources import RunDirSource
from stragglerwatch.record.simulate import GrowingRun, Injection, SimConfig, to_frame

POLL_S = inspect.signature(RunDirSource).parameters["interval_s"].default  # the dashboard's default
REFRESH_S = inspect.signature(create_app).parameters["refresh_ms"].default / 1000  # the page's default period
FIGURES = ("heatmap", "breakdown", "band", "context", "events", "work", "imbalance")


def to_json(out: dict) -> int:
    """The JSON Dash sends for one refresh (every figure, the table and the rank picker); its size in bytes."""
    payload = [pio.to_json(out[k], validate=False) for k in FIGURES]
    rest = {k: v for k, v in out.items() if k not in FIGURES}
    payload.append(json.dumps(rest, cls=PlotlyJSONEncoder))
    return sum(len(x) for x in payload)


def held(live: LiveRun) -> tuple[int, int]:
    """The bytes of the rows a followed run's arrays hold (read, detection, work-adjusted) and of the last."""
    kept = sum(a[: rows.n].nbytes for rows in (live.data, live.det) for a in rows.arrays.values())
    work = live.work
    adjusted = sum(a[: work.adjusted.n].nbytes for a in work.adjusted.arrays.values()) if work is not None else 0
    return kept + adjusted, adjusted


def holds(snapshot: Snapshot, upto: int) -> bool:
    """Whether a snapshot's analysis holds every rank's steps up to ``upto`` (exclusive)."""
    mat = snapshot.analysis.matrix
    return (mat is not None and len(mat.steps) > 0 and int(mat.steps[-1]) == upto - 1
            and bool(np.isfinite(mat.values["step_s"][-1]).all()))  # fmt: skip


def made_after(ahead: Prerender, label: str, version: int) -> bool:
    """Whether the content made ahead for a source is of a snapshot after ``version``, and made."""
    made = ahead.made(label)
    return made is not None and made[0][0] > version and made[1].done()


def page_wait(made_s: float, period_s: float) -> float:
    """What a flush waits for the page after the source's update, averaged over when in its period the page
    asks (uniformly): its next ask, or the figures being made ahead if they take longer (``made_s``)."""
    if made_s >= period_s:
        return made_s
    return made_s + (period_s - made_s) ** 2 / (2 * period_s)


def resident_gib() -> float:
    """This process's resident memory now (Linux), else its peak."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 2**20
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _write(run: Path, cfg: SimConfig, asks: Connection) -> None:
    """The job: flushes the run up to each step it is sent, answering when the flush is on disk; None ends it."""
    grower = GrowingRun(run, cfg)
    while (upto := asks.recv()) is not None:
        grower.flush(upto)
        asks.send(upto)
    grower.close()
    asks.send(None)


class Job:
    """A simulated job writing its run dir from a process of its own, as a job's ranks do: written from the
    dashboard's process, a flush (a quarter of a second at 4,096 ranks) took turns with the source's update for
    the interpreter, and each slowed the other."""

    def __init__(self, run: Path, cfg: SimConfig) -> None:
        self._asks, theirs = multiprocessing.get_context("spawn").Pipe()
        self._process = multiprocessing.get_context("spawn").Process(target=_write, args=(run, cfg, theirs),
                                                                     daemon=True)  # fmt: skip
        self._process.start()

    def flush(self, upto: int) -> None:
        self._asks.send(upto)
        if not self._asks.poll(600) or self._asks.recv() != upto:
            raise SystemExit(f"end-to-end: the job did not write its flush up to step {upto}")

    def close(self) -> None:
        self._asks.send(None)
        self._asks.poll(60)
        self._process.join(60)


def end_to_end(cfg: SimConfig, first: int, flush_steps: int, poll_s: float, steps_kept: int | None = None,
               ahead_too: bool = True) -> None:  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        grower = Job(run, cfg)
        grower.flush(first)
        t0 = time.perf_counter()
        whole = analyze_run(run)
        to_json(render(Snapshot(whole, [], version=1), None))
        whole_s = time.perf_counter() - t0
        print(f"end-to-end: re-reading and re-analysing the whole run at {first} steps, then the figures and JSON "
              f"(what every flush would cost without incremental following): {whole_s:.1f} s")  # fmt: skip
        source = RunDirSource(run, interval_s=poll_s, window=steps_kept).start()  # its thread polls, as the dashboard's
        kept = f"; the source keeps the last {source.live.window} steps" if steps_kept else ""
        print(f"end-to-end: {cfg.ranks} ranks, {first} steps written; a flush of {flush_steps} steps to every "
              f"rank's stream at a time up to {cfg.steps}; the source polls every {poll_s} s{kept}")  # fmt: skip
        ahead = Prerender(render)  # as the app's callback: the page's content made as soon as the source updates
        if ahead_too:
            ahead.content(source, source.snapshot(), None)  # a page asked: the source is followed
        else:
            print("end-to-end: --no-ahead: the page's content is made when the page asks, as before it was made ahead")
        window: dict[str, list[float]] = {"source": [], "made ahead": [], "JSON": [], "shown": []}
        worst, size, shown = 0.0, 0, []
        phase = random.Random(0)
        for upto in range(first + flush_steps, cfg.steps + 1, flush_steps):
            time.sleep(phase.uniform(0.0, poll_s))  # a job's flush comes at any point of the source's polling period
            grower.flush(upto)
            t0 = time.perf_counter()
            while not holds(source.snapshot(), upto):  # the source's update holds the whole flush (a poll during
                # the flush's writing publishes the ranks written by then first)
                if time.perf_counter() - t0 > 60:
                    raise SystemExit(f"end-to-end: the source did not pick up the flush ({source.snapshot().error})")
                time.sleep(0.005)
            t1 = time.perf_counter()
            whole = source.snapshot().version
            while ahead_too and not made_after(ahead, source.label, whole - 1):  # made for it, on their own thread
                if time.perf_counter() - t1 > 60:
                    raise SystemExit("end-to-end: the figures were not made ahead")
                time.sleep(0.005)
            t2 = time.perf_counter()
            # the page's ask: Dash's JSON of the content made ahead (else made now)
            size = to_json(ahead.content(source, source.snapshot(), None) if ahead_too else
                           render(source.snapshot(), None))  # fmt: skip
            t3 = time.perf_counter()
            # the page asks at a time of its own, uniform over its period: it gets the content at its first ask
            # after the source's update, or when the figures are made if they are being made then
            source_s, made_s, json_s = t1 - t0, t2 - t1, t3 - t2
            expected = source_s + page_wait(made_s, REFRESH_S) + json_s
            for name, dt in zip(window, (source_s, made_s, json_s, expected), strict=True):
                window[name].append(dt)
            worst = max(worst, source_s + max(made_s, REFRESH_S) + json_s)
            shown.append(expected)
            if upto % 1000 == 0 or upto == cfg.steps:
                parts = ", ".join(f"{k} {statistics.median(v):.2f}/{max(v):.2f} s" for k, v in window.items())
                memory = (f"; arrays {held(source.live)[0] / 1e9:.2f} GB ({source.live.data.n} steps held), "
                          f"RSS {resident_gib():.2f} GiB" if steps_kept else "")  # fmt: skip
                print(f"  steps {upto - 999 if upto >= 1000 else 0}-{upto}: median/worst {parts}{memory}", flush=True)
                window = {k: [] for k in window}
        grower.close()
        t0 = time.perf_counter()
        # settled: the exact analysis is the one published (the source publishes it after the update that made it)
        while not (source.live.exact and source.snapshot().analysis is source.live.analysis):
            if time.perf_counter() - t0 > 120:
                break
            time.sleep(0.05)
        settled = time.perf_counter() - t0
        report = json.loads(json.dumps(source.snapshot().analysis.report))
        source.stop()
        same = report == json.loads(json.dumps(analyze_run(run).report)) if not steps_kept else None
        print(f"end-to-end: payload {size / 1e6:.2f} MB; with the page asking every {REFRESH_S} s (the dashboard's "
              f"default), a flush shows in about {statistics.median(shown):.2f} s typically (the median flush, "
              f"its wait for the page's ask averaged over when in its period the page asks), within "
              f"{worst:.1f} s at worst")  # fmt: skip
        total, adjusted = held(source.live)
        records = cfg.ranks * source.live.data.n
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"end-to-end: the followed run's arrays hold {total / 1e9:.2f} GB for {source.live.data.n} steps, "
              f"{total / records:.0f} bytes a record (of which the work-adjusted times {adjusted / records:.0f}); "
              f"peak RSS of this process {peak:.2f} GiB")  # fmt: skip
        print(f"end-to-end: the run stopped growing; settled on the exact analysis in {settled:.1f} s; "
              + (f"the same report as analyze: {same}" if same is not None else "(of the window: analyze reads the "
                 "whole run)"))  # fmt: skip


def small(flush_steps: int, poll_s: float, ranks: int = 256, steps: int = 1200, onset: int = 600) -> None:
    cfg = SimConfig(ranks, steps, noise=0.005, spike_prob=0.005, spike_mag=1.0,
                    injections=[Injection(17, 0.05, onset, "compute")])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        grower = Job(run, cfg)
        grower.flush(onset - 100)
        source = RunDirSource(run, interval_s=poll_s).start()
        named, shown = None, None
        for upto in range(onset - 100 + flush_steps, steps + 1, flush_steps):
            before = source.snapshot().version
            grower.flush(upto)
            t0 = time.perf_counter()
            while source.snapshot().version == before:
                if time.perf_counter() - t0 > 60:
                    raise SystemExit(f"small: the source did not pick up the flush ({source.snapshot().error})")
                time.sleep(0.005)
            if named is None and any(s["rank"] == 17 for s in source.snapshot().analysis.report["stragglers"]):
                to_json(render(source.snapshot(), None))  # the page's refresh: figures and JSON
                named, shown = upto, time.perf_counter() - t0
                break
        grower.close()
        source.stop()
        final = analyze_run(run).report if named is None else None
    found = [s for s in (final or {}).get("stragglers", []) if s["rank"] == 17]
    print(f"small: {ranks} ranks, 0.5% jitter, rank 17's compute 5% slower from step {onset}; flushes of {flush_steps} "
          f"steps, the source polling every {poll_s} s")  # fmt: skip
    if named is None:
        print(f"small: the live page never named it; analyze on the whole run: {found or 'not flagged'}")
        return
    proving = None  # the first batch after which analyze, on the steps written so far, flags it
    for upto in range(onset, named + 1, flush_steps):
        with tempfile.TemporaryDirectory() as tmp:
            part = GrowingRun(Path(tmp) / "run", cfg)
            part.flush(upto)
            part.close()
            if any(s["rank"] == 17 for s in analyze_run(part.out).report["stragglers"]):
                proving = upto
                break
    print(f"small: named live at the flush up to step {named} ({named - onset} steps after the onset), "
          f"{shown:.2f} s after that flush was on disk, plus up to the page's refresh period ({REFRESH_S} s); "
          f"analyze on the steps written so far first flags it after the flush up to step {proving}")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10_000, help="steps at the end (end-to-end) or of the snapshot")
    p.add_argument("--first", type=int, default=2000, help="end-to-end: steps written before the dashboard starts")
    p.add_argument("--flush-steps", type=int, default=10, help="end-to-end: steps a flush adds to every rank")
    p.add_argument("--poll", type=float, default=POLL_S, help="end-to-end: the source's polling period (s)")
    p.add_argument("--no-ahead", action="store_true",
                   help="end-to-end: the page's content made when the page asks (the figures' time then counts in "
                        "'JSON'), not ahead as the app makes it")  # fmt: skip
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--part", choices=("end-to-end", "render", "both", "small"), default="both")
    p.add_argument("--window", type=int, default=None, metavar="STEPS",
                   help="end-to-end: the source follows the last STEPS steps only (the dashboard's --window)")
    p.add_argument("--tokens", type=float, default=0.0,
                   help="mean tokens a rank a step: every rank its own batch each step (variable work, recorded "
                        "per step; the followed run is adjusted for it); default 0: no work recorded")  # fmt: skip
    args = p.parse_args()
    for_analysis()  # as the dashboard's process (the command, the service) sets its memory
    if args.part == "small":
        small(args.flush_steps, args.poll)
        return
    slow = [Injection(17, 0.2, args.steps // 4), Injection(900 % args.ranks, 0.1, args.steps // 2, "data")]
    cfg = SimConfig(args.ranks, args.steps, injections=slow, tokens=args.tokens)
    if args.part in ("end-to-end", "both"):
        end_to_end(cfg, args.first, args.flush_steps, args.poll, args.window, not args.no_ahead)
    if args.part == "end-to-end":
        return
    t0 = time.perf_counter()
    mat = to_matrix(to_frame(cfg))
    verdict = detect(mat)
    run_meta = {"run_id": "bench", "world_size": args.ranks}
    report = build_report(RankFigures.of(mat, verdict), verdict, run_meta, {}).to_dict()
    events = [{"kind": "stall", "rank": 5, "step": 800, "phase": "other", "detected_at": 1.8e9, "waited_s": 12.0}]
    snap = Snapshot(Analysis(report, mat, verdict), events, version=1)
    print(f"render only: {args.ranks} ranks x {args.steps} steps: analysis in memory {time.perf_counter() - t0:.1f} s")
    times, size = [], 0
    for i in range(args.repeat):
        t = time.perf_counter()
        out = render(snap, None if i % 2 else 900 % args.ranks)
        size = to_json(out)
        times.append(time.perf_counter() - t)
    print(f"render only: refresh callback (render + JSON): median {statistics.median(times):.3f} s, "
          f"worst {max(times):.3f} s; payload {size / 1e6:.2f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
