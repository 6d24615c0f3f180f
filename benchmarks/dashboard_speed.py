"""Time a user waits for the dashboard on a large run (not a pytest test).

Two measurements, 1,024 ranks x 2,000 steps by default (two stragglers, a stall event):

1. ``end-to-end`` (what a live run costs): a simulated run dir is written in the real
   event-log format; then, ``--repeat`` times, one rank's log gets a new flush (a stream
   segment of 10 steps, as a running job writes), and the path a user waits for is timed:
   the run-dir source notices the change and reloads and re-analyses the run, then the
   refresh callback renders every figure and the table and serialises them to the JSON Dash
   sends. Prints each stage's median and the total; the source's polling interval and the
   browser's refresh interval add up to their lengths on top (printed too).
2. ``render`` only: the refresh callback's work on a prepared snapshot (the part a browser
   refresh costs when the data did not change).

    python benchmarks/dashboard_speed.py [--ranks 1024 --steps 2000 --repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import plotly.io as pio
from plotly.utils import PlotlyJSONEncoder

from stragglerwatch.analysis import Analysis, RankFigures, build_report
from stragglerwatch.dashboard import Snapshot
from stragglerwatch.dashboard.app import render
from stragglerwatch.dashboard.sources import RunDirSource
from stragglerwatch.detect import detect, to_matrix
from stragglerwatch.eventlog import EventLogWriter, log_path
from stragglerwatch.simulate import Injection, SimConfig, to_frame, write_run
from stragglerwatch.timing import StepMarks


def to_json(out: dict) -> int:
    """The JSON Dash sends for one refresh; its size in bytes."""
    payload = [pio.to_json(out[k], validate=False) for k in ("heatmap", "breakdown", "band", "events")]
    payload.append(json.dumps({"rows": out["rows"], "options": out["options"]}, cls=PlotlyJSONEncoder))
    return sum(len(x) for x in payload)


def new_flush(run_dir: Path, rank: int, first_step: int, n: int = 10) -> None:
    """What a running rank does every flush interval: n more steps in its log stream."""
    writer = EventLogWriter(
        log_path(run_dir, rank), rank, wall_anchor=2e9, flush_interval_s=3600, attach=1 + first_step
    )
    t = 0.0
    for step in range(n):
        m = StepMarks(step, t, t)
        m.fwd_start, m.fwd_end, m.bwd_start, m.bwd_end = [t], [t + 0.03], [t + 0.03], [t + 0.09]
        m.opt = [[t + 0.09, t + 0.095]]
        m.end = t = t + 0.1
        writer.submit(m)
    writer.flush()  # flushed, not closed: the stream stays as a live run leaves it (its thread sleeps on)


def end_to_end(cfg: SimConfig, repeat: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        t0 = time.perf_counter()
        write_run(run, cfg)
        print(f"end-to-end: wrote {cfg.ranks} ranks x {cfg.steps} steps in {time.perf_counter() - t0:.1f} s")
        source = RunDirSource(run, interval_s=2.0)
        source.refresh()
        stages: dict[str, list[float]] = {"reload and analysis": [], "render": [], "JSON": [], "total": []}
        size = 0
        for i in range(repeat):
            new_flush(run, rank=i % cfg.ranks, first_step=i)
            t0 = time.perf_counter()
            before = source.snapshot().version
            source.refresh()  # what the source thread does at its next tick
            snap = source.snapshot()
            if snap.version == before or snap.error:
                raise SystemExit(f"end-to-end: the source did not pick up the new flush ({snap.error})")
            t1 = time.perf_counter()
            out = render(snap, None)
            t2 = time.perf_counter()
            size = to_json(out)
            t3 = time.perf_counter()
            for name, dt in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t3 - t0), strict=True):
                stages[name].append(dt)
        parts = ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in stages.items())
        worst = max(stages["total"])
        print(f"end-to-end: new flush on disk -> figures' JSON, median of {repeat}: {parts} "
              f"(worst total {worst:.2f} s); payload {size / 1e6:.2f} MB")  # fmt: skip
        print(f"end-to-end: plus up to {source.interval_s:.0f} s until the source's next poll and up to 3 s until "
              f"the page's next refresh (their intervals)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--part", choices=("end-to-end", "render", "both"), default="both")
    args = p.parse_args()
    cfg = SimConfig(args.ranks, args.steps, injections=[Injection(17, 0.2, 500), Injection(900 % args.ranks, 0.1,
                                                                                          1200, "data")])  # fmt: skip
    if args.part in ("end-to-end", "both"):
        end_to_end(cfg, args.repeat)
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
