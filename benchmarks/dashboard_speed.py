"""Server-side time of one dashboard refresh on a large run (not a pytest test).

Simulates 1,024 ranks x 2,000 steps (with two stragglers and a stall event), builds the
snapshot the run-dir source would hold, then times the refresh callback's work: ``render``
(all figures, aggregated on the server, and the table) plus serialising every output to the
JSON Dash sends. Prints the median and worst of ``--repeat`` refreshes, and the payload size.

    python benchmarks/dashboard_speed.py [--ranks 1024 --steps 2000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import plotly.io as pio
from plotly.utils import PlotlyJSONEncoder

from stragglerwatch.analysis import Analysis, build_report
from stragglerwatch.dashboard import Snapshot
from stragglerwatch.dashboard.app import render
from stragglerwatch.detect import detect, to_matrix
from stragglerwatch.simulate import Injection, SimConfig, to_frame


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    cfg = SimConfig(args.ranks, args.steps, injections=[Injection(17, 0.2, 500), Injection(900, 0.1, 1200, "data")])
    t0 = time.perf_counter()
    mat = to_matrix(to_frame(cfg))
    verdict = detect(mat)
    report = build_report(mat, verdict, {"run_id": "bench", "world_size": args.ranks}, {})
    events = [{"kind": "stall", "rank": 5, "step": 800, "phase": "other", "detected_at": 1.8e9, "waited_s": 12.0}]
    snap = Snapshot(Analysis(report, mat, verdict), events, version=1)
    print(f"{args.ranks} ranks x {args.steps} steps: analysis (done once per data change, on the source's "
          f"thread) {time.perf_counter() - t0:.1f} s")  # fmt: skip
    times, size = [], 0
    for i in range(args.repeat):
        t = time.perf_counter()
        out = render(snap, None if i % 2 else 900)
        payload = [pio.to_json(out[k], validate=False) for k in ("heatmap", "breakdown", "band", "events")]
        payload.append(json.dumps({"rows": out["rows"], "options": out["options"]}, cls=PlotlyJSONEncoder))
        times.append(time.perf_counter() - t)
        size = sum(len(x) for x in payload)
    print(f"refresh callback (render + JSON): median {statistics.median(times):.3f} s, worst {max(times):.3f} s; "
          f"payload {size / 1e6:.2f} MB")  # fmt: skip


if __name__ == "__main__":
    main()
