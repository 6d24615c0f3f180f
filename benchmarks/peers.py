"""The peers, side by side: stragglerwatch and the tools a user would pick instead of it, run on
the same 4-rank gloo jobs with the same injected stragglers (not a pytest test).

The jobs (``benchmarks/peers_job.py``): a small DDP MLP on CPU, 4 ranks under torchrun,
``OMP_NUM_THREADS=1``, three scenarios: ``healthy``, ``data`` (one rank's DataLoader is
``--delay`` s slower a batch from ``--from-step`` on) and ``compute`` (its forward and backward
are). Each tool gets a run of its own, instrumented as its documentation shows for a plain
PyTorch loop, and each scenario a plain run without any tool (the overhead's reference):

- ``stragglerwatch``: ``attach(model, optimizer=opt)`` and ``watch.wrap(loader)``; the verdict is
  ``stragglerwatch analyze RUN_DIR --format json`` after the run;
- ``traceml`` (``traceml-ai``): ``traceml.init(mode="auto")``, ``traceml.trace_step(model)``
  around the step, launched by ``traceml run JOB --nproc-per-node 4``; the verdict is the
  rank-straggler finding of the end-of-run ``final_summary.json`` (its default ``summary``
  mode). Read a second way, which favours it: its live view (``--mode cli``: the last 100
  common steps, the ``live`` policy) replayed from the run's own telemetry database with its
  own code every ``--replay-every`` steps, to see how soon it would have named the rank;
- ``nvrx`` (``nvidia-resiliency-ext``'s straggler ``Detector``): sections ``data_loading`` and
  ``fwd`` timed on the CPU, ``generate_report()`` every ``--nvrx-every`` steps and
  ``identify_stragglers()`` with its default thresholds (0.75) on rank 0; a second run reports
  every ``--nvrx-fast-every`` steps (favours it: sooner); each run is also read with its
  relative scores alone (favours it: fewer false flags). On CPU two stubs stand in for CUDA in
  the job's processes (see ``benchmarks/peers_job.py``).

Per (scenario, tool): did it name the injected rank, the right cause (data or compute; "not
reported" when the tool has no notion of one), how soon (steps after the onset of its first
naming of that rank, or "end of run only"), its false flags (any other rank named, and the
injected rank named before its onset; every flag on the healthy job), the wall time per step
against the plain run of the same scenario (median of each run's per-step times after 10 steps
of warm-up, median over the ranks; separate processes, noisy on a small shared machine: runs
alternate in order, and ``--repeats`` runs each again) and the launch-to-exit time of the job.

The peers are not dependencies of this project: install them into a virtualenv of their own
(``.venv-peers``; the wheels of ``nvidia-resiliency-ext`` 0.7 need Python >= 3.12 and
glibc 2.39, 0.4.1 carries the same straggler code and has a wheel for Python 3.11)::

    python3.11 -m venv .venv-peers
    .venv-peers/bin/pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu  # CPU-only box
    .venv-peers/bin/pip install -r benchmarks/peers-requirements.txt -e '.[train]'
    .venv-peers/bin/python benchmarks/peers.py                      # ~7 minutes on 2 cores
    .venv-peers/bin/python benchmarks/peers.py --repeats 2 --json peers.json   # ~14 minutes
    .venv-peers/bin/python benchmarks/peers.py --slow-rank 1 --from-step 150 --delay 0.03

A tool that is not installed gets "not installed" in its rows, never a guess.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
JOB = HERE / "peers_job.py"
SCENARIOS = ("healthy", "data", "compute")
WARMUP = 10
RANKS = 4
TRACEML_STRAGGLERS = {"INPUT_STRAGGLER": "data", "COMPUTE_STRAGGLER": "compute", "H2D_STRAGGLER": "h2d",
                      "STRAGGLER": "unattributed"}  # fmt: skip
DISTS = ("torch", "stragglerwatch", "traceml-ai", "nvidia-resiliency-ext")
NVRX_SECTION_CAUSE = {"data_loading": "data", "fwd": "compute"}

UNFAIR = [
    "nvrx: its main signal, the GPU performance score from CUPTI kernel timings (profile_cuda=True), does "
    "not exist on CPU; only its CPU section timing runs here, and its CUPTI extension is stubbed out.",
    "nvrx: its documentation reports every few minutes (report_time_interval defaults to 60 s, the guide "
    "says 300 s); the training of a whole job here lasts ~10 s, so at its default it would report nothing. It "
    "reports every N steps instead, and a second run every few steps.",
    "nvrx: the documented sections time the batch fetch and the forward only; the compute injection puts a "
    "third of its delay in forward (two thirds in backward, which DDP's all-reduce wait makes useless to "
    "time on the host), so it sees a third of that straggler.",
    "traceml: it is built for GPU clocks (CUDA events) and runs here on its CPU clock; its default summary "
    "mode reports once, at the end of the run, over the whole run: the live replay reads its live view "
    "every few steps, more often than its terminal view refreshes (every 2 s, ~50 steps here).",
    "traceml: its aggregator is a process of its own that shares the 2 cores with the 4 ranks here; on a "
    "GPU node it would use a spare core. Its step overhead here is an upper bound.",
    "traceml: it names at most one culprit rank (the rank with the least backward time, i.e. the one the "
    "others wait for), and in its STRAGGLER verdict says the cause was not measured.",
    "stragglerwatch: this is its own benchmark; the injection is modelled on its demo's; its verdict comes "
    "from analyze after the run (the rule's detected_step), whose noise estimate sees the whole run; a "
    "dashboard following the run settles on the same verdict.",
]
NOT_MEASURED = [
    "GPU and NCCL behaviour of all three tools (no GPU here): nvrx's GPU score, traceml's GPU clock, "
    "stragglerwatch's CUDA-event timing.",
    "traceml's live terminal view itself: its diagnosis is replayed from its database with its own code, "
    "not read off the terminal.",
    "Hangs: neither peer's straggler feature looks for them (nvrx's fault_tolerance package does, and is a "
    "different tool).",
    "Overhead on an idle machine or a GPU node: every figure here is from 4 ranks sharing 2 cores.",
]


@dataclass
class Naming:
    step: int | None  # the training step (from 0) at which it was said; None: at the end of the run
    rank: int
    cause: str | None  # data, compute, h2d, unattributed; None: the tool has no notion of cause
    held: bool = False  # a flag that stays raised from ``step`` on (stragglerwatch's), not a report of one moment
    until: int | None = None  # the last step it stayed raised at (held flags; None: to the end)


@dataclass
class Reading:
    namings: list[Naming] = field(default_factory=list)
    points: int = 1  # reports, views or verdicts the tool gave
    unit: str = "verdict"
    error: str | None = None
    tool_s: float | None = None  # what reading the verdict cost the tool (stragglerwatch's analyze), seconds


@dataclass
class Run:
    name: str
    scenario: str
    repeat: int
    out: Path
    rc: int
    wall_s: float
    step_ms: float | None
    log: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def run_specs(args: argparse.Namespace) -> dict[str, tuple[str, list[str], str | None]]:
    """Run name -> (the job's --tool, extra job arguments, module it needs)."""
    return {
        "plain": ("none", [], None),
        "stragglerwatch": ("stragglerwatch", [], "stragglerwatch"),
        "traceml": ("traceml", [], "traceml_ai"),
        "nvrx": ("nvrx", ["--nvrx-every", str(args.nvrx_every)], "nvidia_resiliency_ext"),
        "nvrx-fast": ("nvrx", ["--nvrx-every", str(args.nvrx_fast_every)], "nvidia_resiliency_ext"),
    }


def launch(name: str, scenario: str, repeat: int, args: argparse.Namespace, work: Path) -> Run:
    tool, extra, _ = run_specs(args)[name]
    out = work / f"{scenario}-{name}-{repeat}"
    if out.exists():  # a --work-dir used before: a run dir left there would be continued, not replaced
        shutil.rmtree(out)
    out.mkdir(parents=True)
    job_args = ["--tool", tool, "--scenario", scenario, "--slow-rank", str(args.slow_rank),
                "--from-step", str(args.from_step), "--delay", str(args.delay), "--steps", str(args.steps),
                "--out", str(out), *extra]  # fmt: skip
    if tool == "traceml":
        cmd = [sys.executable, "-m", "traceml_ai.launcher.cli", "run", str(JOB), "--nproc-per-node", str(RANKS),
               "--logs-dir", str(out / "traceml"), "--run-name", "run", "--master-port", str(free_port()),
               "--aggregator-port", str(free_port()), "--args", *job_args]  # fmt: skip
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
               str(JOB), *job_args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    log = out / "log.txt"
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=out,
                                timeout=args.timeout).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            rc = -1
    wall = time.perf_counter() - t0
    medians = []
    for rank in range(RANKS):
        path = out / f"steps-{rank}.json"
        if path.is_file():
            steps = json.loads(path.read_text())["step_s"][WARMUP:]
            if steps:
                medians.append(statistics.median(steps))
    step_ms = 1e3 * statistics.median(medians) if rc == 0 and len(medians) == RANKS else None
    return Run(name, scenario, repeat, out, rc, wall, step_ms, log)


# what each tool said, read from what it wrote


def read_stragglerwatch(run: Run, args: argparse.Namespace) -> Reading:
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "stragglerwatch", "analyze", str(run.out / "stragglerwatch"),
                        "--format", "json"], capture_output=True, text=True, timeout=300)  # fmt: skip
    if p.returncode != 0:
        return Reading(error=f"analyze failed: {p.stderr.strip()[-200:]}")
    report = json.loads(p.stdout)
    if report.get("busy_unavailable"):
        return Reading(error=f"busy time unavailable: {report['busy_unavailable']}")
    return Reading([Naming(s["detected_step"], s["rank"], s["cause"], True, s["last_step"])
                    for s in report["stragglers"]], tool_s=time.perf_counter() - t0)  # fmt: skip


def traceml_findings(issues: list[dict[str, Any]], step: int | None) -> list[Naming]:
    return [Naming(step, int(r), TRACEML_STRAGGLERS[i["kind"]])
            for i in issues if i.get("kind") in TRACEML_STRAGGLERS for r in i.get("ranks") or ()]  # fmt: skip


def read_traceml_summary(run: Run, args: argparse.Namespace) -> Reading:
    path = run.out / "traceml" / "run" / "final_summary.json"
    if not path.is_file():
        return Reading(error="no final_summary.json")
    summary = json.loads(path.read_text())
    return Reading(traceml_findings(summary["step_time"].get("issues") or [], None), unit="summary")


def read_traceml_live(run: Run, args: argparse.Namespace) -> Reading:
    """Its live view's diagnosis at every --replay-every steps, by its own code on its own database:
    the live profile's read (the last 100 common steps of a 400-step lookback) and live policy."""
    from traceml_ai.diagnostics.step_time.api import diagnose_step_time_window
    from traceml_ai.diagnostics.step_time.policy import LIVE_STEP_TIME_POLICY
    from traceml_ai.step_time.analysis import StepTimeAnalyzer
    from traceml_ai.step_time.model import StepTimeLoadRequest
    from traceml_ai.step_time.sqlite import SQLiteStepTimeRepository

    db = run.out / "traceml" / "run" / "aggregator" / "telemetry"
    if not db.is_file():
        return Reading(error="no telemetry database")
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        repo, analyzer = SQLiteStepTimeRepository(conn), StepTimeAnalyzer()
        last = conn.execute("SELECT MAX(step) FROM step_time_samples").fetchone()[0] or 0
        namings, points = [], 0
        for done in range(args.replay_every, last + 1, args.replay_every):  # its steps count from 1
            snapshot = repo.load_summary(StepTimeLoadRequest(start_step=max(1, done - 399), end_step=done))
            result = diagnose_step_time_window(analyzer.analyze(snapshot, window_size=100),
                                               policy=LIVE_STEP_TIME_POLICY)  # fmt: skip
            issues = [{"kind": i.kind, "ranks": i.ranks} for i in result.issues]
            namings += traceml_findings(issues, done - 1)
            points += 1
    finally:
        conn.close()
    return Reading(namings, points, "views")


def nvrx_reader(relative_only: bool) -> Callable[[Run, argparse.Namespace], Reading]:
    keys = ["straggler_sections_relative", "straggler_gpus_relative"]
    if not relative_only:
        keys += ["straggler_sections_individual", "straggler_gpus_individual"]

    def read(run: Run, args: argparse.Namespace) -> Reading:
        path = run.out / "steps-0.json"
        if not path.is_file():
            return Reading(error="no reports")
        reports = json.loads(path.read_text())["reports"]
        namings = []
        for rep in reports:
            for key in keys:
                found = rep["stragglers"][key]
                if isinstance(found, dict):  # section -> ranks
                    namings += [Naming(rep["step"], r, NVRX_SECTION_CAUSE.get(sec)) for sec, rs in found.items()
                                for r in rs]  # fmt: skip
                else:  # GPU score: no section, no cause
                    namings += [Naming(rep["step"], r, None) for r in found]
        return Reading(namings, len(reports), "reports")

    return read


@dataclass
class Row:
    label: str
    run: str
    read: Callable[[Run, argparse.Namespace], Reading]


def rows(args: argparse.Namespace) -> list[Row]:
    return [
        Row("stragglerwatch (analyze after the run)", "stragglerwatch", read_stragglerwatch),
        Row("traceml, end-of-run summary (its default)", "traceml", read_traceml_summary),
        Row(f"traceml, live view replayed every {args.replay_every} steps (favours it)", "traceml",
            read_traceml_live),  # fmt: skip
        Row(f"nvrx, report every {args.nvrx_every} steps, default thresholds", "nvrx", nvrx_reader(False)),
        Row(f"nvrx, every {args.nvrx_every} steps, relative scores only (favours it)", "nvrx", nvrx_reader(True)),
        Row(f"nvrx, report every {args.nvrx_fast_every} steps (favours it)", "nvrx-fast", nvrx_reader(False)),
        Row(f"nvrx, every {args.nvrx_fast_every} steps, relative scores only (favours it)", "nvrx-fast",
            nvrx_reader(True)),  # fmt: skip
    ]


# scoring


def score(reading: Reading, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    if reading.error:
        return {"error": reading.error}
    injected = scenario != "healthy"

    def right(n: Naming) -> bool:  # names the injected rank while it is slow
        if not injected or n.rank != args.slow_rank:
            return False
        if n.step is None or n.step >= args.from_step:
            return True
        return n.held and (n.until is None or n.until >= args.from_step)  # raised early, still up at the onset

    def early(n: Naming) -> bool:  # a flag raised before anything was slow
        return n.step is not None and n.step < args.from_step

    hits = [n for n in reading.namings if right(n)]
    false = [n for n in reading.namings if not right(n) or early(n)]
    said = [n.step for n in hits if n.step is not None]
    first = min(said) if said else None
    causes = sorted({str(n.cause) for n in hits if n.step == first}) if hits else []
    return {
        "named_rank": bool(hits) if injected else None,
        "end_of_run_only": bool(hits) and first is None,
        "steps_after_onset": None if not hits or first is None else first - args.from_step,
        "causes": causes,
        "right_cause": (causes == [scenario]) if hits else None,
        "false_ranks": sorted({n.rank for n in false if not (injected and n.rank == args.slow_rank)}),
        "injected_rank_early": any(n.rank == args.slow_rank for n in false) if injected else False,
        "false_points": len({n.step for n in false}),
        "points": reading.points,
        "slow_rank": args.slow_rank,
        "unit": reading.unit,
        "namings": [[n.step, n.rank, n.cause] for n in reading.namings],
        "tool_s": reading.tool_s,
    }


def joined(values: list[str]) -> str:
    return values[0] if len(set(values)) == 1 else " / ".join(values)


def cells(scores: list[dict[str, Any]], scenario: str) -> list[str]:
    """right rank, right cause, how soon, false flags: one value per repeat, joined when they differ."""
    if any("error" in s for s in scores):
        return [joined([s.get("error", "ok") for s in scores])] + ["-"] * 3
    rank, cause, soon, false = [], [], [], []
    for s in scores:
        if scenario == "healthy":
            rank.append("n/a")
            cause.append("n/a")
            soon.append("n/a")
        elif not s["named_rank"]:
            rank.append("no")
            cause.append("-")
            soon.append("-")
        else:
            rank.append("yes")
            if s["causes"] == ["None"]:
                cause.append("not reported")
            elif s["causes"] == ["unattributed"]:
                cause.append("no (\"cause not measured\")")
            else:
                cause.append(("yes" if s["right_cause"] else "no") + f" ({', '.join(s['causes'])})")
            after = s["steps_after_onset"]
            soon.append("end of run only" if s["end_of_run_only"] else
                        f"+{after} steps" if after >= 0 else f"{after} steps (raised before the onset)")  # fmt: skip
        others = s["false_ranks"]
        named = [("rank " if len(others) == 1 else "ranks ") + ", ".join(str(r) for r in others)] if others else []
        if s["injected_rank_early"]:
            named.append(f"rank {s['slow_rank']} before the onset")
        if not named:
            false.append("none")
        elif s["unit"] in ("verdict", "summary"):
            false.append(", ".join(named))
        else:
            false.append(f"{', '.join(named)} ({s['false_points']} of {s['points']} {s['unit']})")
    return [joined(rank), joined(cause), joined(soon), joined(false)]


def pct(x: float) -> str:
    return f"{100 * x:+.0f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    p.add_argument("--slow-rank", type=int, default=2, help="the injected rank (default 2)")
    p.add_argument("--from-step", type=int, default=100, help="onset, the first slowed step from 0 (default 100)")
    p.add_argument("--delay", type=float, default=0.02, help="extra seconds a step (default 0.02)")
    p.add_argument("--steps", type=int, default=300, help="steps per job (default 300)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each (scenario, tool) (default 1)")
    p.add_argument("--nvrx-every", type=int, default=50, help="nvrx: steps between reports (default 50)")
    p.add_argument("--nvrx-fast-every", type=int, default=10, help="nvrx, second run: steps between reports (10)")
    p.add_argument("--replay-every", type=int, default=5, help="traceml live replay: steps between views (5)")
    p.add_argument("--timeout", type=float, default=600, help="seconds a job may take (default 600)")
    p.add_argument("--work-dir", help="where the jobs write (default: a temporary dir, removed unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep the jobs' outputs")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if not 0 <= args.slow_rank < RANKS or not 0 <= args.from_step < args.steps:
        p.error(f"--slow-rank must be in 0..{RANKS - 1} and --from-step below --steps")

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="peers-"))
    work.mkdir(parents=True, exist_ok=True)
    specs = run_specs(args)
    available = {name for name, (_, _, module) in specs.items() if module is None or installed(module)}
    names = [n for n in specs if n in available]
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    runs: dict[tuple[str, str, int], Run] = {}
    k = 0
    for repeat in range(args.repeats):
        for scenario in args.scenarios:
            order = names[k % len(names):] + names[: k % len(names)]  # rotate: no tool always first or last
            k += 1
            for name in order:
                run = launch(name, scenario, repeat, args, work)
                runs[(scenario, name, repeat)] = run
                status = f"{run.step_ms:.1f} ms/step" if run.step_ms else f"FAILED (rc {run.rc}, {run.log})"
                print(f"  {scenario:8} {name:15} run {repeat + 1}: {run.wall_s:5.1f} s, {status}", flush=True)

    results: list[dict[str, Any]] = []
    table = ["| scenario | tool | named the rank | right cause | how soon | false flags | time/step vs plain "
             "| job wall |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    overheads: dict[str, list[float]] = {}
    for scenario in args.scenarios:
        plain = [runs[(scenario, "plain", r)] for r in range(args.repeats)]
        plain_ms = [r.step_ms for r in plain if r.step_ms]
        plain_wall = statistics.median(r.wall_s for r in plain)
        step = f"{statistics.median(plain_ms):.1f} ms" if plain_ms else "failed"
        table.append(f"| {scenario} | plain (no tool) | | | | | {step} | {plain_wall:.0f} s |")
        for row in rows(args):
            if row.run not in available:
                table.append(f"| {scenario} | {row.label} | not installed | - | - | - | - | - |")
                results.append({"scenario": scenario, "tool": row.label, "error": "not installed"})
                continue
            mine = [runs[(scenario, row.run, r)] for r in range(args.repeats)]
            scores = []
            for run in mine:
                if run.step_ms is None:
                    scores.append({"error": f"run failed (rc {run.rc})"})
                    continue
                try:
                    scores.append(score(row.read(run, args), scenario, args))
                except Exception as e:  # a peer's format we did not expect: say so, do not guess
                    scores.append({"error": f"could not read: {type(e).__name__}: {e}"})
            ratios = [m.step_ms / pl.step_ms - 1 for m, pl in zip(mine, plain, strict=True) if m.step_ms and pl.step_ms]
            over = pct(statistics.median(ratios)) if ratios else "-"
            wall = statistics.median(m.wall_s for m in mine)
            table.append(f"| {scenario} | {row.label} | " + " | ".join(cells(scores, scenario))
                         + f" | {over} | {wall:.0f} s ({wall - plain_wall:+.0f}) |")  # fmt: skip
            results.append({"scenario": scenario, "tool": row.label, "run": row.run, "scores": scores,
                            "step_overhead": ratios, "wall_s": [m.wall_s for m in mine],
                            "plain_wall_s": [pl.wall_s for pl in plain],
                            "step_ms": [m.step_ms for m in mine], "plain_step_ms": [pl.step_ms for pl in plain]})
    for name in names[1:]:  # per run, not per reading of it
        overheads[name] = [runs[(sc, name, r)].step_ms / runs[(sc, "plain", r)].step_ms - 1
                           for sc in args.scenarios for r in range(args.repeats)
                           if runs[(sc, name, r)].step_ms and runs[(sc, "plain", r)].step_ms]  # fmt: skip
    elapsed = time.perf_counter() - t_start

    command = "python benchmarks/peers.py" + "".join(f" {shlex.quote(a)}" for a in (argv or sys.argv[1:]))
    print()
    print(f"{command}")
    print(f"{RANKS} gloo ranks on {os.cpu_count()} CPUs ({platform.machine()}, Python {platform.python_version()}), "
          f"{args.steps} steps, rank {args.slow_rank} slowed by {1e3 * args.delay:.0f} ms a step from step "
          f"{args.from_step}; {args.repeats} run(s) of each; {elapsed / 60:.1f} min in all; load average "
          f"{load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    print("versions: " + ", ".join(f"{d} {version(d)}" for d in DISTS))
    print()
    print("\n".join(table))
    print()
    print("time/step vs plain, the median over scenarios and runs (separate processes, 4 ranks on shared cores: "
          "noisy): " + ", ".join(f"{n} {pct(statistics.median(v))} ({len(v)} runs)"
                                 for n, v in overheads.items() if v))  # fmt: skip
    print()
    print("Where the comparison is unfair to a peer:")
    print("\n".join(f"- {u}" for u in UNFAIR))
    print("Not measured here:")
    print("\n".join(f"- {u}" for u in NOT_MEASURED))
    if args.json:
        Path(args.json).write_text(json.dumps({
            "command": command, "cpus": os.cpu_count(), "steps": args.steps, "slow_rank": args.slow_rank,
            "from_step": args.from_step, "delay_s": args.delay, "repeats": args.repeats,
            "elapsed_s": elapsed, "load_average_start": load_start, "versions": {d: version(d) for d in DISTS},
            "rows": results, "step_overhead": overheads, "unfair": UNFAIR, "not_measured": NOT_MEASURED,
        }, indent=1))  # fmt: skip
    if args.keep or args.work_dir:
        print(f"\njob outputs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    failed = [r for r in runs.values() if r.step_ms is None]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
