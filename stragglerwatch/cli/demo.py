"""``stragglerwatch demo`` and ``stragglerwatch dashboard``: serve the dashboard; run a demo job under it.

Design: the dashboard is served by werkzeug's threaded server on a thread of its
own (so the demo can run the job and print the report meanwhile), bound to
127.0.0.1 unless asked otherwise.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from stragglerwatch.cli.dashboard import DashboardServer, lacking, wait_forever

JOB_MODULE = "stragglerwatch.cli.demo_job"  # the demo's training job, shipped in the package (torchrun -m)


def demo_command(args: Any) -> list[str]:
    """The torchrun command line of the demo job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
           "-m", JOB_MODULE, "--steps", str(args.steps), "--slow-rank", str(args.slow_rank), "--delay",
           str(args.delay), "--cause", args.cause, "--from-step", str(args.from_step), "--run-dir",
           str(args.run_dir)]  # fmt: skip
    if args.hang:
        cmd += ["--stall-rank", str((args.slow_rank + 1) % args.ranks), "--stall-at-step",
                str(args.steps // 2), "--stall-seconds", "8", "--watchdog-timeout", "3"]  # fmt: skip
    return cmd


def start_prometheus(run_dir: Path, port: int) -> tuple[subprocess.Popen | None, str]:
    """A local Prometheus scraping the demo's ranks, when one is installed."""
    binary = shutil.which("prometheus")
    if binary is None:
        return None, "prometheus is not installed: skipped (apt-get install prometheus)"
    from stragglerwatch.presentation.promrules import render_config, render_rules

    rules = run_dir / "demo.rules.yml"
    rules.write_text(render_rules(window="30s", for_="15s"))
    config = run_dir / "prometheus.yml"
    config.write_text(render_config([str(run_dir / "stragglerwatch-*.json")], [str(rules)], "2s"))
    proc = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={run_dir / 'prometheus-data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    return proc, f"Prometheus: http://127.0.0.1:{port}/alerts"


def run_demo(args: Any) -> int:
    if lacking("stragglerwatch demo", "torch", "dash", "plotly"):
        return 2
    from stragglerwatch.analysis.report import analyze_run
    from stragglerwatch.presentation.dashboard import RunDirSource
    from stragglerwatch.presentation.render import render_text

    if not 0 <= args.slow_rank < args.ranks:
        print(f"stragglerwatch: error: --slow-rank must be in 0..{args.ranks - 1}", file=sys.stderr)
        return 2
    args.run_dir = Path(args.run_dir or f"stragglerwatch-runs/demo-{time.strftime('%Y%m%d-%H%M%S')}")
    args.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        server = DashboardServer(RunDirSource(args.run_dir), args.host, args.port).start()
    except OSError as exc:
        print(f"stragglerwatch: error: cannot serve the dashboard on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    prom, prom_line = None, ""
    if args.prometheus:
        env.update(STRAGGLERWATCH_PROMETHEUS_PORT=str(args.metrics_port), STRAGGLERWATCH_PROMETHEUS_ADDR="127.0.0.1")
        prom, prom_line = start_prometheus(args.run_dir, args.prometheus_port)
    what = f"rank {args.slow_rank} {args.delay * 1000:.0f} ms/step slower ({args.cause}) from step {args.from_step}"
    print(f"demo: {args.ranks} ranks, {args.steps} steps, {what}{'; plus a stall' if args.hang else ''}")
    print(f"demo: run dir {args.run_dir}")
    print(f"demo: dashboard {server.url}  (open it in a browser)", flush=True)
    if prom_line:
        print(f"demo: {prom_line}", flush=True)
    try:
        job = subprocess.run(demo_command(args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if job.returncode != 0:
            print(f"demo: the job ended with status {job.returncode}:\n{job.stderr[-2000:]}", file=sys.stderr)
        print("\n" + render_text(analyze_run(args.run_dir).report), flush=True)
        if not args.exit:
            wait_forever(f"\ndemo: the dashboard stays at {server.url} — Ctrl-C to stop")
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.stop()
        if prom is not None:
            prom.terminate()
    return 0
