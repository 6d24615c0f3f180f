"""The ``stragglerwatch`` command. Each subcommand only parses arguments and calls the library."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from stragglerwatch._memory import for_analysis
from stragglerwatch._version import __version__
from stragglerwatch.presentation.summary import render_summary, summary_dict
from stragglerwatch.record.steplog import RunDirError


def _duration(text: str) -> str:
    """A Prometheus duration (``15s``, ``1m``, ``500ms``), for an option that goes into its configuration."""
    if not re.fullmatch(r"([0-9]+(ms|s|m|h|d|w|y))+", text.strip()):
        raise argparse.ArgumentTypeError(f"{text!r} is not a Prometheus duration (such as 15s, 1m or 500ms)")
    return text.strip()


def _window_steps(text: str) -> int:
    """The steps a followed run keeps (``dashboard --window``): a whole number, at least ``live.MIN_WINDOW``."""
    from stragglerwatch.analysis.live import window_problem

    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of steps") from None
    problem = window_problem(steps)
    if problem:
        raise argparse.ArgumentTypeError(f"{steps} steps: {problem}")
    return steps


def _show_warning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
    print(f"stragglerwatch: warning: {message}", file=sys.stderr)


def cmd_summary(args: argparse.Namespace) -> int:
    """``stragglerwatch summary``: the per-rank table of :func:`stragglerwatch.api.analyze`'s report."""
    from stragglerwatch.api import analyze

    report = analyze(args.run_dir).to_dict()
    print(json.dumps(summary_dict(report), indent=2) if args.format == "json" else render_summary(report))
    return 0


class Progress:
    """``n/total`` on one stderr line, only when stderr is a terminal and the work is large."""

    def __init__(self, label: str, min_total: int = 32):
        self.label = label
        self.min_total = min_total
        self.enabled = sys.stderr.isatty()

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or total < self.min_total:
            return
        width = 30
        fill = width * done // total
        end = "\n" if done == total else ""
        print(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {done}/{total}", end=end, file=sys.stderr)


def cmd_analyze(args: argparse.Namespace) -> int:
    """``stragglerwatch analyze``: the report of :func:`stragglerwatch.api.analyze` (an op-level trace: of
    ``traces.analyze_trace``) as text, JSON or HTML."""
    from stragglerwatch.api import FINDINGS, AnalysisReport, analyze, detect_config
    from stragglerwatch.runtime.config import ConfigError

    def error(message: str) -> int:
        print(f"stragglerwatch: error: {message}", file=sys.stderr)
        return 2

    if args.run_dir is None and not args.logs and args.fr is None:
        return error("give a RUN_DIR, --logs FILE..., --fr DIR, or several")
    if args.engine == "ray" and args.format == "html":
        return error("--engine ray gives --format text or json (the HTML report's figures need every step of "
                     "every rank in one process)")  # fmt: skip
    settings = {"window": args.window, "level_window": args.level_window, "min_slowdown": args.min_slowdown,
                "tolerance": args.tolerance, "z": args.z, "decision": args.decision,
                "min_cost_share": args.min_cost_share}  # fmt: skip
    trace = args.run_dir is not None and Path(args.run_dir).is_file()
    if trace and not args.meta:
        return error(f"{args.run_dir} is a file: a trace needs --meta META.yaml")
    try:
        detect_config(settings)
        if trace:  # an op-level trace
            report: AnalysisReport = _trace_report(args)
        else:
            report = analyze(args.run_dir, engine=args.engine,
                             address=args.address, logs=args.logs, flight_recorder=args.fr,
                             progress=Progress("analyze", 32 if args.engine == "local" else 1),
                             **settings)  # fmt: skip
    except Exception as exc:  # one line each: a setting, the run dir, a trace, logs, dumps, Ray
        from stragglerwatch.analysis.rayengine import RayEngineError
        from stragglerwatch.evidence.traces import TraceError

        if not isinstance(exc, (ConfigError, RunDirError, TraceError, RayEngineError, ValueError, OSError)):
            raise
        return error(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    if args.format == "json":
        text = json.dumps(report.to_dict(), indent=2)
    elif args.format == "html":
        text = report.to_html()
        if args.out is None:
            base = Path(args.run_dir or ".")
            args.out = str(base.with_suffix(".html") if base.is_file() else base / "report.html")
    else:
        text = report.to_text()
    if args.out:
        try:
            Path(args.out).write_text(text + "\n")
        except OSError as exc:
            return error(f"cannot write {args.out}: {exc.strerror or exc}")
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        print(text)
    found = report.findings(FINDINGS if "any" in args.fail_on else args.fail_on) if args.fail_on else []
    for line in found:
        print(f"stragglerwatch: --fail-on: {line}", file=sys.stderr)
    return 1 if found else 0


def _trace_report(args: argparse.Namespace) -> Any:
    """The report of an op-level trace (``--meta``), with PyTorch's logs and dumps when given."""
    from stragglerwatch.api import as_report
    from stragglerwatch.evidence.combine import add_flight_recorder, add_hang_verdict, add_pytorch_logs
    from stragglerwatch.evidence.torchlogs import parse_files
    from stragglerwatch.evidence.traces import analyze_trace

    analysis = analyze_trace(args.run_dir, args.meta)
    if args.logs:
        add_pytorch_logs(analysis.report, parse_files(args.logs))
    add_flight_recorder(analysis.report, args.fr)
    add_hang_verdict(analysis.report)
    return as_report(analysis)


def cmd_simulate(args: argparse.Namespace) -> int:
    from stragglerwatch.record.simulate import Injection, SimConfig, write_run

    out = Path(args.out_dir)
    if (out / "run.json").exists() and not args.force:
        print(f"stragglerwatch: error: {out} already holds a run (use --force to overwrite)", file=sys.stderr)
        return 2
    try:
        injections = [Injection.parse(t) for t in args.straggler]
    except ValueError as exc:
        print(f"stragglerwatch: error: {exc}", file=sys.stderr)
        return 2
    if args.ranks < 1 or args.steps < 1:
        print("stragglerwatch: error: --ranks and --steps must be at least 1", file=sys.stderr)
        return 2
    cfg = SimConfig(
        ranks=args.ranks, steps=args.steps, seed=args.seed, step_ms=args.step_ms, comm_ms=args.comm_ms,
        noise=args.noise, drift=args.drift, spike_prob=args.spike_prob, spike_mag=args.spike_mag,
        injections=injections, groups=args.groups, offset=args.offset, spike_tail=args.spike_tail,
        stall_every=args.stall_every, stall_mag=args.stall_mag, host_noise=args.host_noise,
        rank_drift=args.rank_drift, drift_steps=args.drift_steps, bootstrap=args.bootstrap or "",
        tokens=args.tokens, token_cv=args.token_cv, token_seqs=args.token_seqs, token_mode=args.token_mode,
        heavy_rank=args.heavy_rank, heavy_share=args.heavy_share, token_share=args.token_share,
        attn_share=args.attn_share,
    )  # fmt: skip
    try:
        write_run(out, cfg, progress=Progress("writing ranks"))
    except (ValueError, OSError) as exc:
        print(f"stragglerwatch: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {args.ranks} ranks x {args.steps} steps to {out}", file=sys.stderr)
    truth = json.loads((out / "run.json").read_text())["simulation"].get("imbalance_truth")
    if truth:
        print(f"true imbalance cost: {truth['lost_seconds']:.2f} s of {truth['job_seconds']:.2f} s "
              f"(S = {truth['slowdown']:.3f} from the unequal work alone)", file=sys.stderr)  # fmt: skip
    return 0


def cmd_prometheus_config(args: argparse.Namespace) -> int:
    from stragglerwatch.presentation.promrules import installed_rules, render_config
    from stragglerwatch.record.rundir import read_run_meta

    run = Path(args.run_dir).resolve()
    meta = read_run_meta(run)
    if meta is None:
        print(f"stragglerwatch: error: {run}: not a stragglerwatch run dir (no readable run.json)", file=sys.stderr)
        return 2
    sd_dir = Path(args.sd_dir or os.environ.get("STRAGGLERWATCH_SD_DIR") or run).resolve()
    pattern = (
        str(sd_dir / f"stragglerwatch-{meta['run_id']}-*.json")
        if not args.all_runs
        else str(sd_dir / "stragglerwatch-*.json")
    )
    rules = [str(Path(r).resolve()) for r in args.rules] or [str(installed_rules())]
    print(render_config([pattern], rules, args.scrape_interval), end="")
    return 0


def _add_prometheus_config(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "prometheus-config",
        help="print a prometheus.yml that scrapes a run's ranks (file_sd) with stragglerwatch's rules",
        description="Print a complete prometheus.yml: a scrape job over the file_sd target files the ranks of "
        "RUN_DIR publish (attach(..., prometheus_port=P)), and rule_files pointing at the rules installed with "
        "stragglerwatch. Use it as is: prometheus --config.file=prometheus.yml",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir (its run.json names the run)")
    p.add_argument("--sd-dir", help="where the target files are (default $STRAGGLERWATCH_SD_DIR or RUN_DIR)")
    p.add_argument("--all-runs", action="store_true", help="scrape every run's targets in the SD dir")
    p.add_argument("--scrape-interval", default="15s", metavar="DURATION", type=_duration,
                   help="scrape and rule evaluation interval, a Prometheus duration such as 15s or 1m "
                   "(default 15s)")  # fmt: skip
    p.add_argument("--rules", action="append", default=[], metavar="FILE",
                   help="rule files to load instead of the installed ones (repeatable)")  # fmt: skip
    p.set_defaults(func=cmd_prometheus_config)


def cmd_grafana(args: argparse.Namespace) -> int:
    from stragglerwatch.presentation.grafana import main as write_grafana

    return write_grafana([args.out_dir])


def _add_grafana(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "grafana",
        help="write the Grafana dashboards, their provisioning and a Docker Compose setup into a folder",
        description="Write into OUT_DIR the files of the repository's grafana/ folder, generated from the installed "
        "package: dashboards/ (stragglerwatch.json: one run; stragglerwatch-overview.json: all runs), "
        "provisioning/ (the dashboards and a Prometheus data source), docker-compose.yml, compose/prometheus.yml "
        "and prometheus/stragglerwatch.rules.yml. Existing files of those names are overwritten.",
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="the folder to write (created if missing)")
    p.set_defaults(func=cmd_grafana)


def _add_dashboard(sub: argparse._SubParsersAction) -> None:
    from stragglerwatch.cli.dashboard import run_dashboard
    from stragglerwatch.cli.demo import run_demo

    p = sub.add_parser(
        "dashboard",
        help="live dashboard of a run dir (followed as the job writes it) or of a Prometheus",
        description="Serve the live Dash dashboard: verdict banner, rank x step heatmap, per-rank phase breakdown, "
        "a rank's busy time against its peers, watchdog events and a sortable per-rank table. The data source "
        "is fixed at start-up. Binds 127.0.0.1 unless --host says otherwise.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="?", help="a run dir (may still be empty)")
    p.add_argument("--prometheus", metavar="URL", help="read a live Prometheus instead (needs --run)")
    p.add_argument("--run", metavar="RUN_ID", help="the run id (the `run` label) to show from Prometheus")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, metavar="PORT", default=8050, help="port (default 8050)")
    p.add_argument("--refresh-ms", type=int, metavar="MS", default=250, help="browser refresh period, ms (default 250)")
    p.add_argument("--window", type=_window_steps, metavar="STEPS",
                   help="follow a run dir's last STEPS steps only (at least 1024): memory then stays under about "
                   "1.25 x STEPS x ranks x 190 bytes however long the run, and the report is of those steps "
                   "(default: every step; `analyze` reads the whole run)")  # fmt: skip
    p.set_defaults(func=run_dashboard)

    d = sub.add_parser(
        "demo",
        help="run a 4-rank CPU DDP job with an injected straggler under the live dashboard",
        description="Run a small CPU DDP job (torchrun, gloo) with an injected straggler (and optionally a stall), "
        "open the live dashboard on it, print its URL, and print the analysis when the job ends. The dashboard "
        "then stays up until Ctrl-C (or exit at once with --exit).",
    )
    d.add_argument("--ranks", type=int, default=4, metavar="N", help="ranks (default 4)")
    d.add_argument("--steps", type=int, default=600, metavar="N", help="steps (default 600, about half a minute)")
    d.add_argument("--slow-rank", type=int, metavar="RANK", default=2, help="the straggler (default 2)")
    d.add_argument("--delay", type=float, default=0.02, metavar="SECONDS",
                   help="seconds the straggler is slowed by every step (default 0.02)")  # fmt: skip
    d.add_argument("--cause", choices=("compute", "data", "optimizer", "other"), default="compute",
                   help="what is slow (default compute)")  # fmt: skip
    d.add_argument("--from-step", type=int, metavar="STEP", default=50,
                   help="the step it starts being slow at (default 50)")  # fmt: skip
    d.add_argument("--hang", action="store_true", help="also make another rank stall 8 s halfway")
    d.add_argument("--run-dir", help="run dir (default stragglerwatch-runs/demo-<time>)")
    d.add_argument("--host", default="127.0.0.1", help="dashboard bind address (default 127.0.0.1)")
    d.add_argument("--port", type=int, metavar="PORT", default=8050, help="dashboard port (default 8050)")
    d.add_argument("--prometheus", action="store_true", help="also export metrics and run a local Prometheus")
    d.add_argument("--metrics-port", type=int, metavar="PORT", default=19400,
                   help="first rank's /metrics port (default 19400)")  # fmt: skip
    d.add_argument("--prometheus-port", type=int, metavar="PORT", default=9090,
                   help="local Prometheus port (default 9090)")  # fmt: skip
    d.add_argument("--exit", action="store_true", help="exit after the report instead of serving until Ctrl-C")
    d.set_defaults(func=run_demo)


def _add_analyze(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "analyze",
        help="find consistently slow ranks, their cause and what they cost (text, JSON or HTML report)",
        description="Analyse a run dir: which ranks are consistently slower than their peers (busy time = "
        "step minus exposed communication and evaluation, compared per step with the median of the peers), since when, "
        "why (data, compute, optimizer, other), and what they cost the job (what-if: each step without "
        "the excess of the slowest rank; job slowdown S = actual / ideal time).",
    )
    p.add_argument(
        "run_dir", metavar="RUN_DIR", nargs="?", help="a run dir written by stragglerwatch.attach() or simulate"
    )
    p.add_argument("--logs", nargs="+", metavar="FILE", default=[],
                   help="torchrun/worker log files to read PyTorch's own failure messages from (NCCL watchdog "
                   "and heartbeat timeouts, gloo timeouts, monitoredBarrier, torchrun's ChildFailedError): "
                   "the report names the first failing rank and collective")  # fmt: skip
    p.add_argument("--fr", metavar="DIR",
                   help="PyTorch Flight Recorder dumps of the job's ranks (a directory, searched recursively, or "
                   "one file): torch's pickles ($TORCH_FR_DUMP_TEMP_FILE<rank>, written on an NCCL watchdog "
                   "timeout) or JSON (_dump_fr_trace_json, the debug server's fr_trace_json); the report names "
                   "the first collective not entered by every rank, the missing or late ranks, mismatched "
                   "operations and each rank's last completed collective. Without --fr, the dumps our watchdog "
                   "wrote into RUN_DIR at a stall are read")  # fmt: skip
    p.add_argument("--meta", metavar="META.yaml",
                   help="with RUN_DIR being an op-level trace (Parquet, one row per op per worker): its "
                   "parallel layout; adds the what-if job slowdown and its attribution to workers, stages, op "
                   "types")  # fmt: skip
    p.add_argument("--format", choices=("text", "json", "html"), default="text",
                   help="text (default): verdict and per-rank table; json: one object (its keys: docs/analysis.md); "
                   "html: self-contained report with figures (default file RUN_DIR/report.html)")  # fmt: skip
    p.add_argument("--out", metavar="FILE", help="write the report to FILE instead of stdout")
    p.add_argument("--fail-on", metavar="KIND", action="append", default=[],
                   choices=("straggler", "hang", "imbalance", "any"),
                   help="exit 1 (after the report) when the run has a finding of this kind: straggler, hang, "
                   "imbalance (unequal work or peer groups) or any; repeatable. Without it the exit status is 0 "
                   "whatever the report says (2: bad input)")  # fmt: skip
    p.add_argument("--window", type=int, default=16, metavar="STEPS",
                   help="steps a slowdown must persist over: the short median (default 16)")  # fmt: skip
    p.add_argument("--level-window", type=int, default=64, metavar="STEPS",
                   help="steps of the level median and of each rank's own baseline (default 64)")  # fmt: skip
    p.add_argument("--min-slowdown", default=None, metavar="RATIO",
                   help="smallest slowdown of a rank's busy time that is flagged, a ratio to its peers (1.06 or "
                   "6%%: 6%% busier); default: from the run's noise, 3 times its per-step jitter within "
                   "1.02-1.06, flags below 1.06 only where they cost the job at least --min-cost-share (1.06: "
                   "the fixed floor of earlier releases)")  # fmt: skip
    p.add_argument("--tolerance", default=None, metavar="RATIO",
                   help="a rank up to this slowdown ratio from the start is healthy hardware variation, never "
                   "flagged (default: 5/6 of the smallest slowdown flagged, e.g. 1.05 for 1.06)")  # fmt: skip
    p.add_argument("--min-cost-share", type=float, default=0.005, metavar="SHARE",
                   help="below the fixed floor (1.06), a flag must save the job at least this share of its time "
                   "while it lasts, were its rank as fast as its peers (default 0.005 = 0.5%%)")  # fmt: skip
    p.add_argument("--z", type=float, default=5.0, metavar="SE",
                   help="noise margin of the level test in standard errors (default 5)")  # fmt: skip
    p.add_argument("--decision", type=float, default=14.0, metavar="NATS",
                   help="evidence the change test needs, in nats of log-likelihood ratio between a change of "
                   "the floor (--min-slowdown) and one of a third of it (default 14); lower finds changes "
                   "sooner, higher flags less")  # fmt: skip
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="where the analysis runs: local (this process, the default) or ray (tasks on a Ray "
                   "cluster, for runs too large for one machine; same report; needs stragglerwatch[ray], the "
                   "run dir on storage every node reads, and --format text or json)")  # fmt: skip
    p.add_argument("--address", default=None,
                   help="with --engine ray: the cluster to use, as ray.init takes it ('auto', 'ray://HOST:10001', "
                   "HOST:6379); default: a local Ray started for this command, or RAY_ADDRESS")  # fmt: skip
    p.set_defaults(func=cmd_analyze)


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="write a synthetic run dir (any number of ranks) with noise and injected stragglers",
        description="Write a synthetic run dir in the real event-log format: N ranks x M steps with "
        "per-step jitter, job-wide drift, transient spikes and injected stragglers; the all-reduce barrier "
        "is modelled (every rank's step = busiest rank + transfer). The ground truth is kept in run.json.",
    )
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to write (created)")
    p.add_argument("--ranks", type=int, required=True, metavar="N", help="world size")
    p.add_argument("--steps", type=int, required=True, metavar="N", help="steps per rank")
    p.add_argument("--straggler", action="append", default=[], metavar="RANK:SLOWDOWN[:ONSET[:CAUSE[:END]]]",
                   help="inject a straggler, e.g. 7:1.2:500:data (SLOWDOWN a ratio to its peers' busy time, 1.2 "
                   "or 20%%: 20%% busier, from step 500 on, in data loading); causes: compute, data, optimizer, "
                   "other; END: the first healthy step again; repeatable")  # fmt: skip
    p.add_argument("--seed", type=int, metavar="SEED", default=0, help="random seed (default 0)")
    p.add_argument("--step-ms", type=float, metavar="MS", default=100.0,
                   help="base busy time per step, ms (default 100)")  # fmt: skip
    p.add_argument("--comm-ms", type=float, metavar="MS", default=10.0,
                   help="all-reduce transfer time, ms (default 10)")  # fmt: skip
    p.add_argument("--noise", type=float, metavar="FRACTION", default=0.03,
                   help="per-step per-rank jitter, a fraction of the busy time (default 0.03 = 3%%)")  # fmt: skip
    p.add_argument("--drift", type=float, metavar="FRACTION", default=0.02,
                   help="per-step job-wide jitter, a fraction of the busy time (default 0.02)")  # fmt: skip
    p.add_argument("--spike-prob", type=float, metavar="P", default=0.002,
                   help="chance of a transient spike, per rank and step (default 0.002)")  # fmt: skip
    p.add_argument("--spike-mag", type=float, metavar="TIMES", default=1.0,
                   help="spike size, times the base step (default 1.0)")  # fmt: skip
    p.add_argument("--groups", type=int, metavar="K", default=1, help="peer groups, e.g. pipeline stages (default 1)")
    real = p.add_argument_group("noise of real clusters (all off by default)")
    real.add_argument("--offset", type=float, metavar="FRACTION", default=0.0,
                      help="persistent per-rank offsets, uniform in [-X, +X] (heterogeneous hardware)")  # fmt: skip
    real.add_argument("--spike-tail", type=float, metavar="SHAPE", default=0.0,
                      help="heavy-tailed spikes: Pareto shape (e.g. 1.5), same mean as --spike-mag")  # fmt: skip
    real.add_argument("--stall-every", type=int, metavar="STEPS", default=0,
                      help="all ranks stall every N steps (GC, checkpoint)")  # fmt: skip
    real.add_argument("--stall-mag", type=float, metavar="TIMES", default=0.5,
                      help="stall size, times the base step (default 0.5)")  # fmt: skip
    real.add_argument("--host-noise", type=float, metavar="FRACTION", default=0.0,
                      help="per-step jitter shared by a host's 8 ranks")  # fmt: skip
    real.add_argument("--rank-drift", type=float, metavar="FRACTION", default=0.0,
                      help="slow mean-reverting per-rank drift: its standard deviation (e.g. 0.02)")  # fmt: skip
    real.add_argument("--drift-steps", type=int, metavar="STEPS", default=3000,
                      help="... its correlation time in steps (default 3000)")  # fmt: skip
    real.add_argument(
        "--bootstrap",
        metavar="CSV",
        help="resample per-step noise from real healthy runs (as benchmarks/record_noise.py writes)",
    )
    work = p.add_argument_group(
        "load imbalance (off by default)",
        "ranks given different work in the same step (variable-length sequences): each rank draws a batch of "
        "sequences of log-normal lengths every step; the record carries the tokens as its work, and run.json "
        "the true cost of the unequal work",
    )
    work.add_argument("--tokens", type=float, metavar="TOKENS", default=0.0,
                      help="mean tokens per rank per step (e.g. 4096); 0: no imbalance, no work recorded")  # fmt: skip
    work.add_argument("--token-cv", type=float, metavar="CV", default=0.25,
                      help="spread of a rank's tokens per step: coefficient of variation (default 0.25)")  # fmt: skip
    work.add_argument("--token-seqs", type=int, metavar="N", default=8, help="sequences per rank per step (default 8)")
    work.add_argument("--token-mode", choices=["variable", "balanced", "static"], default="variable",
                      help="variable: each rank draws its own batch (a different rank heaviest each step); "
                      "balanced: every rank the step's token count (token-based batching); static: as variable, "
                      "with one rank's shard always heavier (default variable)")  # fmt: skip
    work.add_argument("--heavy-rank", type=int, metavar="RANK", default=0,
                      help="with --token-mode static: the heavy rank (default 0)")  # fmt: skip
    work.add_argument("--heavy-share", type=float, metavar="FRACTION", default=0.2,
                      help="with --token-mode static: its sequences this much longer (default 0.2 = 20%%)")  # fmt: skip
    work.add_argument("--token-share", type=float, metavar="FRACTION", default=0.8,
                      help="share of forward + backward growing with the tokens at the mean (default 0.8)")  # fmt: skip
    work.add_argument("--attn-share", type=float, metavar="FRACTION", default=0.0,
                      help="of that, the part quadratic in the sequence lengths, as attention (default 0)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="overwrite an existing run in OUT_DIR")
    p.set_defaults(func=cmd_simulate)


def _add_control(sub: argparse._SubParsersAction) -> None:
    def run(args: argparse.Namespace) -> int:
        from stragglerwatch.runtime.controls.controlfile import command
        from stragglerwatch.runtime.controls.controlspec import ControlError

        try:
            return command(args.run_dir, args.set, args.rank, args.wait)
        except ControlError as exc:
            print(f"stragglerwatch: error: {exc}", file=sys.stderr)
            return 2

    p = sub.add_parser(
        "control",
        help="change a running job's recording, watchdog threshold or flush interval, or show who did",
        description="Change settings of the ranks of a running job without a restart, through the run dir "
        "(works with every torch; with a torch that has the debug server, attach(debug_server_port=P) also "
        "gives a page to do it). With --set, append a request to RUN_DIR/control.json: one rank per host looks "
        "at it every control_interval_s (1 s) and passes it on to the host's other ranks; each applies it and "
        "answers in control-ack-NNNNN.json; the command waits up to --wait seconds for the answers. Without "
        "--set, show the latest requests and which ranks applied, refused or have not answered them. Requests "
        "made before a rank attached are not applied. Exit status: 0 every rank addressed applied it; 1 some "
        "refused it or did not answer; 2 a bad request, or no rank answered (no running job to control).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir of the running job")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="recording=on|off, watchdog_timeout_s=SECONDS|auto, flush_interval_s=SECONDS "
                   "(repeatable; all applied or none)")  # fmt: skip
    p.add_argument("--rank", type=int, help="only this rank (default: every rank)")
    p.add_argument("--wait", type=float, default=5.0, metavar="SECONDS",
                   help="how long to wait for the ranks' answers after --set "
                   "(default 5; 0: neither wait nor check)")  # fmt: skip
    p.set_defaults(func=run)


class _Parser(argparse.ArgumentParser):
    """A command-line mistake is one line, as every other error (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (--help for usage)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="stragglerwatch",
        description="Find the slow and the stuck ranks of PyTorch DDP training jobs.",
        epilog="Record a run with stragglerwatch.attach(model) in the training script; "
        "then inspect its run dir with the commands above. Exit status: 0 done, 1 a finding asked for with "
        "analyze --fail-on (or a control request some ranks did not apply), 2 bad input (one line on stderr), "
        "130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"stragglerwatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser(
        "summary",
        help="per-rank table of a run: median step, busy and phase times, busy time vs peers",
        description="Print one row per rank of a run dir: median step time, busy time "
        "(step minus exposed communication and evaluation: the straggler signal) and phase times in ms, "
        "busy_vs_peers (the median over its steps of its busy time over its peers', a ratio: 1.20x is 20%% "
        "busier) and whether analyze flags it: the per-rank table of analyze's report, every rank of it.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run dir written by stragglerwatch.attach()")
    p.add_argument("--format", choices=("text", "json"), default="text", help="output format (default text)")
    p.set_defaults(func=cmd_summary)
    _add_analyze(sub)
    _add_simulate(sub)
    _add_prometheus_config(sub)
    _add_grafana(sub)
    _add_dashboard(sub)
    _add_control(sub)
    return parser


#: Per command, the options that do something only with another: (option, what it needs, whether it has it).
#: Given without it, the option is refused, not ignored.
NEEDS: dict[str, list[tuple[str, str, Callable[[argparse.Namespace], bool]]]] = {
    "analyze": [("meta", "an op-level trace file as RUN_DIR", lambda a: bool(a.run_dir) and Path(a.run_dir).is_file()),
                ("address", "--engine ray", lambda a: a.engine == "ray")],
    "dashboard": [("run", "--prometheus URL", lambda a: bool(a.prometheus))],
    "demo": [("metrics_port", "--prometheus", lambda a: a.prometheus),
             ("prometheus_port", "--prometheus", lambda a: a.prometheus)],
    "simulate": [(name, "--tokens", lambda a: a.tokens > 0) for name in
                 ("token_cv", "token_seqs", "token_mode", "token_share", "attn_share")]
                + [(name, "--token-mode static", lambda a: a.token_mode == "static") for name in
                   ("heavy_rank", "heavy_share")]
                + [("drift_steps", "--rank-drift", lambda a: a.rank_drift > 0),
                   ("stall_mag", "--stall-every", lambda a: a.stall_every > 0)],
}  # fmt: skip


def refused(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The first option of ``args`` given (not at its default) without what it needs (:data:`NEEDS`)."""
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub = subs.choices[args.command]
    for dest, needs, has in NEEDS.get(args.command, []):
        if getattr(args, dest) != sub.get_default(dest) and not has(args):
            return f"--{dest.replace('_', '-')} does nothing without {needs}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    why = refused(parser, args)
    if why:
        print(f"stragglerwatch {args.command}: error: {why}", file=sys.stderr)
        return 2
    warnings.showwarning = _show_warning
    for_analysis()  # the process is ours: no stall on its memory (stragglerwatch/_memory.py)
    try:
        return args.func(args)
    except RunDirError as exc:
        print(f"stragglerwatch: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stragglerwatch: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # a bug of ours, or an input no check foresaw: one line, not a traceback
        if os.environ.get("STRAGGLERWATCH_DEBUG"):
            raise
        print(f"stragglerwatch: error: {type(exc).__name__}: {exc} (STRAGGLERWATCH_DEBUG=1 shows where)",
              file=sys.stderr)  # fmt: skip
        return 2


if __name__ == "__main__":
    sys.exit(main())
