"""Analysis throughput on a large simulated run (not a pytest test).

Writes (once) a simulated run of 1024 ranks x 10,000 steps (10.24 M step records,
one Parquet file per rank, three stragglers), then times in separate processes:
``stragglerwatch analyze RUN --format json`` and a plain pyarrow read of the same
files (after one read that warms the page cache, in turns, ``--repeat`` times), reporting the
medians of wall time and peak memory (max RSS) and their ratio.

``--engine ray`` times ``analyze --engine ray`` instead, on a local Ray started by the child
process with every CPU here, and reports the peak memory of each Ray worker process (polled),
the driver's, and (``--compare``) whether the stragglers and the whole JSON report, key for key,
equal the local engine's.

``--scaling 1024x1000,1024x10000,10000x10000`` prints the Ray engine's scaling table instead: one
simulated run per size (kept under ``--run-dir`` when given, as ``RANKSxSTEPS``), each analysed once
on a local Ray with every CPU here: wall time, records a second per CPU (flat where the analysis is
linear in the records), the driver's peak memory, the largest worker's own memory (USS) beside its
share of the data (the analysed columns' uncompressed bytes, from the Parquet footers, over the CPUs).

    python benchmarks/throughput.py [--ranks 1024 --steps 10000] [--run-dir DIR] [--tokens 4096]
    python benchmarks/throughput.py --ranks 10000 --steps 10000 --run-dir DIR --engine ray --compare
    python benchmarks/throughput.py --scaling 1024x1000,1024x10000,10000x10000 --tokens 4096 --run-dir DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PLAIN_READ = """
import sys, glob, pyarrow as pa, pyarrow.parquet as pq
t = pa.concat_tables([pq.read_table(f) for f in sorted(glob.glob(sys.argv[1] + '/rank-*.parquet'))])
print(t.num_rows)
"""


def measure(cmd: list[str]) -> tuple[float, float, str]:
    """Wall seconds, peak RSS in GiB and stdout of one child process."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(cmd, stdout=out)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return wall, usage.ru_maxrss / 2**20, text


RAY_RUN = """
import json, sys, time
from stragglerwatch.analysis.rayengine import analyze_on_ray
from stragglerwatch.evidence.combine import add_flight_recorder, add_hang_verdict
t0 = time.perf_counter()
say = lambda stage: print(f"  {time.perf_counter() - t0:6.1f} s  {stage}", file=sys.stderr)
report = analyze_on_ray(sys.argv[1], progress=say).report
add_flight_recorder(report, None)  # as `analyze --format json` does: the same keys as the local report
add_hang_verdict(report)
print(json.dumps(report))
"""


def ray_workers() -> dict[int, tuple[float, float]]:
    """RSS and USS (GiB; USS leaves out the object store's shared pages) of the Ray worker processes."""
    import psutil

    out = {}
    for proc in psutil.process_iter(["cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ray::" in cmd or "default_worker.py" in cmd:
            try:
                mem = proc.memory_full_info()
            except (psutil.Error, OSError):
                continue
            out[proc.pid] = (mem.rss / 2**30, mem.uss / 2**30)
    return out


def measure_ray(run: Path) -> tuple[float, float, tuple[float, float], int, str]:
    """Wall seconds, driver peak RSS, the largest worker's peak (RSS, USS), workers seen, stdout."""
    peaks: dict[int, tuple[float, float]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen([sys.executable, "-c", RAY_RUN, str(run)], stdout=out)
        status = None
        while status is None:
            for pid, (rss, uss) in ray_workers().items():
                old = peaks.get(pid, (0.0, 0.0))
                peaks[pid] = (max(old[0], rss), max(old[1], uss))
            try:
                _, status, usage = os.wait4(proc.pid, os.WNOHANG)
                status = status if _ else None
            except ChildProcessError:
                break
            time.sleep(0.25)
        wall = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode()
    if status is None or os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit("the Ray analysis failed")
    largest = (max((p[0] for p in peaks.values()), default=0.0), max((p[1] for p in peaks.values()), default=0.0))
    return wall, usage.ru_maxrss / 2**20, largest, len(peaks), text


def simulate(run: Path, ranks: int, steps: int, tokens: float) -> None:
    """The benchmark's run (three stragglers from 20%, 30% and 60% of the steps, the second ending at 80%),
    written once."""
    if (run / "run.json").exists():
        return
    t0 = time.perf_counter()
    a, b = (ranks - 1000, ranks // 2 - 191) if ranks > 1000 else (ranks * 3 // 4, ranks // 3)
    at = [steps * k // 10 for k in (2, 6, 3, 8)]
    subprocess.run(
        [sys.executable, "-m", "stragglerwatch.cli", "simulate", str(run), "--ranks", str(ranks),
         "--steps", str(steps), "--straggler", f"{17 % ranks}:1.15:{at[0]}:data", "--straggler",
         f"{a}:1.1:{at[1]}", "--straggler", f"{b}:1.12:{at[2]}:compute:{at[3]}",
         *(["--tokens", str(tokens)] if tokens else [])],
        check=True,
    )  # fmt: skip
    print(f"simulated {ranks} x {steps} in {time.perf_counter() - t0:.1f} s", flush=True)


def data_bytes(run: Path) -> int:
    """The uncompressed bytes of the step logs' columns, from their Parquet footers."""
    import pyarrow.parquet as pq

    total = 0
    for f in run.glob("rank-*.parquet"):
        meta = pq.read_metadata(f)
        total += sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))
    return total


def scaling(sizes: list[tuple[int, int]], root: Path, tokens: float) -> None:
    """The Ray engine's scaling table: a row per size, printed as it is measured."""
    cpus = os.cpu_count() or 1
    print(f"the Ray engine on a local Ray with {cpus} CPUs{', work recorded' if tokens else ''}:")
    head = (f"{'ranks':>6} {'steps':>7} {'records':>12} {'wall s':>8} {'M rec/s':>8} {'M rec/s/CPU':>11} "
            f"{'driver GiB':>10} {'worker USS GiB':>14} {'data/CPU GiB':>12}")  # fmt: skip
    rows = []
    for ranks, steps in sizes:
        run = root / f"{ranks}x{steps}"
        simulate(run, ranks, steps, tokens)
        wall, rss, worker, _, out = measure_ray(run)
        records = ranks * steps
        share = data_bytes(run) / cpus / 2**30
        found = [(s["rank"], s["cause"], s["first_step"], s["last_step"]) for s in json.loads(out)["stragglers"]]
        rows.append(f"{ranks:>6} {steps:>7} {records:>12,} {wall:>8.1f} {records / wall / 1e6:>8.2f} "
                    f"{records / wall / 1e6 / cpus:>11.2f} {rss:>10.2f} {worker[1]:>14.2f} {share:>12.2f}")  # fmt: skip
        print(f"  {ranks} x {steps}: stragglers found {found}", flush=True)
        print("\n".join([head, *rows]), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10_000)
    p.add_argument("--run-dir", help="simulated run to use/create (default: a temporary directory)")
    p.add_argument("--engine", choices=("local", "ray"), default="local")
    p.add_argument("--compare", action="store_true", help="with --engine ray: also run the local engine")
    p.add_argument("--repeat", type=int, default=3, help="interleaved runs of analyze and the plain read")
    p.add_argument("--tokens", type=float, default=0.0,
                   help="simulate variable work (mean tokens a rank a step, recorded per step): the work fit and "
                        "the imbalance run too; default 0: no work recorded")  # fmt: skip
    p.add_argument("--scaling", metavar="RxS,...",
                   help="the Ray engine's scaling table over these sizes (ranks x steps), e.g. "
                        "1024x1000,1024x10000,10000x10000")  # fmt: skip
    args = p.parse_args()
    tmp = None
    if args.scaling:
        try:
            sizes = [(int(a), int(b)) for a, b in (x.lower().split("x") for x in args.scaling.split(","))]
        except ValueError:
            p.error(f"--scaling: sizes as RANKSxSTEPS, comma-separated, not {args.scaling!r}")
        with tempfile.TemporaryDirectory() as t:
            scaling(sizes, Path(args.run_dir or t), args.tokens)
        return
    if args.run_dir:
        run = Path(args.run_dir)
    else:
        tmp = tempfile.TemporaryDirectory()
        run = Path(tmp.name) / "run"
    simulate(run, args.ranks, args.steps, args.tokens)
    records = args.ranks * args.steps
    if args.engine == "ray":
        wall, rss, worker, n, out_ray = measure_ray(run)
        found = [(s["rank"], s["cause"], s["first_step"], s["last_step"]) for s in json.loads(out_ray)["stragglers"]]
        cpus = os.cpu_count() or 1
        print(f"analyze --engine ray: {wall:.1f} s, {records / wall / 1e6:.2f} M records/s "
              f"({records / wall / 1e6 / cpus:.2f} M a second per CPU, {cpus} CPUs); peak RSS of the driver "
              f"{rss:.2f} GiB; the largest of {n} Ray worker processes: peak RSS {worker[0]:.2f} GiB (with the "
              f"object store's pages it reads), peak USS {worker[1]:.2f} GiB (its own memory)")  # fmt: skip
        print(f"  stragglers found: {found}")
        if not args.compare:
            return
    # a first plain read warms the page cache; then analyze and the plain read take turns
    measure([sys.executable, "-c", PLAIN_READ, str(run)])
    runs, reads = [], []
    for _ in range(args.repeat):
        runs.append(measure([sys.executable, "-m", "stragglerwatch.cli", "analyze", str(run), "--format", "json"]))
        reads.append(measure([sys.executable, "-c", PLAIN_READ, str(run)]))
    wall, rss = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
    out = runs[-1][2]
    report = json.loads(out)
    local = [(s["rank"], s["cause"], s["first_step"], s["last_step"]) for s in report["stragglers"]]
    print(f"analyze --format json: {wall:.1f} s, peak RSS {rss:.2f} GiB, {records / wall / 1e6:.2f} M records/s")
    print(f"  stragglers found: {local}")
    im = report.get("imbalance")
    if im:
        print(f"  imbalance: detected {im['detected']}, {im['lost_seconds']} s lost, unit {im['unit']}")
    if args.engine == "ray":
        same = json.dumps(report, sort_keys=True) == json.dumps(json.loads(out_ray), sort_keys=True)
        print(f"  the same as the Ray engine's: {local == found}; the JSON report equals the Ray engine's key for key: "
              f"{same}")  # fmt: skip
        return
    pwall, prss = statistics.median(r[0] for r in reads), statistics.median(r[1] for r in reads)
    ratio = statistics.median(a[0] / b[0] for a, b in zip(runs, reads, strict=True))
    print(f"plain pyarrow read of the same files: {pwall:.1f} s, peak RSS {prss:.2f} GiB")
    print(f"medians of {args.repeat} interleaved runs each; ratio analyze / plain read: {wall / pwall:.1f}x time "
          f"(median of the pairs' ratios {ratio:.1f}x), {rss / prss:.1f}x memory")  # fmt: skip
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
