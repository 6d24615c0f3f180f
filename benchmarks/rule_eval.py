"""What the shipped rules cost a real Prometheus that holds the series of 1,000+ ranks, in both
export modes. A script, not a test: ``python benchmarks/rule_eval.py [--ranks 1024] [--hours 1]``.

Method, for each mode (``full``, ``lean``):

1. One rank's series are those of a real scrape of a real exporter in that mode (``RankCollector``
   and ``ContextCollector`` of a GPU rank with one clock slowdown reason active), so the data holds
   exactly what N ranks would export (Prometheus's own ``up``/``scrape_*`` series aside).
2. OpenMetrics text for N ranks at the scrape interval (15 s), from ``--hours`` ago to
   ``--ahead-min`` minutes from now: steps of about 1 s, phase, busy and step times per rank (one
   rank in 128 a straggler), counters growing, gauges steady. ``promtool tsdb create-blocks-from
   openmetrics`` turns it into blocks.
3. ``prometheus`` opens that TSDB with the shipped rules file (5-minute windows, evaluated every
   15 s) and no scrape job. The backfilled blocks reach beyond "now", so every evaluation reads 5
   minutes (20 samples) of every rank's series, as on a server that scrapes the ranks live; an
   out-of-order window lets the rules' results, stamped "now", be written although the blocks
   end later (without it they are refused as out of bounds).
4. ``/api/v1/rules`` after every evaluation: ``evaluationTime`` of each rule and group (min,
   median and max over ``--evaluations``: on a shared machine the min is the least disturbed);
   then ``/api/v1/query?stats=all`` on each recording rule's expression: execution time and
   samples read; series counts; the TSDB's size on disk; Prometheus's resident memory.

The length of the history (``--hours``) changes the size on disk, not what an evaluation reads.

``--series`` only counts the series of one rank's real scrape, CPU and GPU, in both modes (by kind,
and without the histograms' ``_bucket`` series), and needs no Prometheus.

Every process and file it makes is gone when it ends (``--port`` 29090 by default; the exporter
used in step 1 listens on the port after it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.openmetrics.parser import text_string_to_metric_families

from stragglerwatch.presentation.promrules import installed_rules
from stragglerwatch.record.rundir import RunInfo
from stragglerwatch.record.schema import StepRecord
from stragglerwatch.runtime.context.ctxmetrics import ContextCollector
from stragglerwatch.runtime.context.sampler import ContextSampler
from stragglerwatch.runtime.output.exporter import Exporter, RankCollector, RankMetrics

#: Seconds per step in each phase of a healthy rank (a 1 s step); a straggler's compute is 20% slower
#: and it waits that much less in the all-reduce.
PHASE_S = {"data_wait": 0.01, "forward": 0.25, "backward": 0.40, "allreduce_wait": 0.25, "collective_wait": 0.02,
           "eval": 0.0, "optimizer": 0.05, "other": 0.02}  # fmt: skip
GPU_ROW = {"gpu": 0, "gpu_uuid": "GPU-00000000", "sm_clock_mhz": 1755.0, "sm_clock_max_mhz": 1980.0,
           "clock_reasons": 0x4, "temperature_c": 71.0, "power_w": 690.0, "power_limit_w": 700.0, "gpu_util": 0.97,
           "ecc_uncorrected": 0.0, "ecc_corrected": 0.0, "pcie_replays": 0.0, "nvlink_errors": 0.0,
           "xid_events": 0.0, "xid": 0.0}  # fmt: skip
Sample = tuple[str, str, str, dict[str, str], float]  # family, type, sample name, labels, value


def one_rank(mode: str, port: int, gpu: bool = True) -> list[Sample]:
    """The samples of one GPU (or CPU) rank, from a real scrape (OpenMetrics) of a real exporter in ``mode``."""
    sampler = ContextSampler(None, 0, open_gpu_sampler=lambda: None)
    sampler.sample_once()
    time.sleep(0.5)  # rates (CPU steal, context switches) need two samples apart
    sampler.sample_once()
    if gpu:
        sampler.latest = {**sampler.latest, **GPU_ROW}
    metrics = RankMetrics()
    step, comm = sum(PHASE_S.values()), PHASE_S["allreduce_wait"] + PHASE_S["collective_wait"]
    metrics.observe([StepRecord(0, 1, time.time() - step, *PHASE_S.values(), step, step - comm, comm, 1, "cuda",
                                [], [], [])])  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        info = RunInfo("bench", Path(tmp), 0, 0, 1, "node-0")
        exporter = Exporter(RankCollector(metrics, info, lean=mode == "lean"), port, "127.0.0.1", Path(tmp))
        exporter.registry.register(ContextCollector(sampler, "bench", 0, "node-0", lean=mode == "lean"))
        try:
            accept = {"Accept": "application/openmetrics-text; version=1.0.0"}
            request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=accept)
            text = urllib.request.urlopen(request, timeout=10).read().decode()
        finally:
            exporter.close()
    return [(f.name, f.type, s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text)
            for s in f.samples]  # fmt: skip


def series_counts(port: int) -> None:
    """Print the series of one rank's scrape, CPU and GPU, full and lean, by kind."""
    kinds = {"stragglerwatch_gpu_": "GPU context", "stragglerwatch_host_": "host context",
             "stragglerwatch_process_": "host context", "stragglerwatch_workers": "host context",
             "stragglerwatch_context_": "host context", "stragglerwatch_watchdog_": "watchdog",
             "stragglerwatch_phase_seconds": "phase histograms", "stragglerwatch_step_seconds": "step histogram",
             "stragglerwatch_busy_seconds": "busy histogram"}  # fmt: skip
    for mode in ("full", "lean"):
        for gpu in (False, True):
            samples = one_rank(mode, port, gpu)
            by_kind: dict[str, int] = {}
            for family, *_ in samples:
                kind = next((k for prefix, k in kinds.items() if family.startswith(prefix)), "other rank series")
                by_kind[kind] = by_kind.get(kind, 0) + 1
            buckets = sum(name.endswith("_bucket") for _, _, name, _, _ in samples)
            print(f"{mode} mode, {'GPU' if gpu else 'CPU'} rank: {len(samples)} series, {len(samples) - buckets} "
                  f"without _bucket; " + ", ".join(f"{k} {n}" for k, n in by_kind.items()))  # fmt: skip


def profile(rank: int) -> dict[str, float]:
    """Seconds per step in each phase of ``rank``: healthy ranks differ by up to 3%; one in 128 straggles."""
    p = dict(PHASE_S)
    scale = 1.0 + 0.01 * (rank % 4)
    if rank % 128 == 7:
        scale = 1.2
    extra = (p["forward"] + p["backward"]) * (scale - 1.0)
    p["forward"] *= scale
    p["backward"] *= scale
    p["allreduce_wait"] = max(0.0, p["allreduce_wait"] - extra)
    return p


def series_values(sample: Sample, p: dict[str, float], times: list[int], interval: int) -> list[str]:
    """The value of one series at each of ``times``: counters grow with the steps, gauges stay."""
    family, _, name, labels, value = sample
    step = sum(p.values())
    busy = step - p["allreduce_wait"] - p["collective_wait"] - p["eval"]
    duration = {"stragglerwatch_step_seconds": step, "stragglerwatch_busy_seconds": busy,
                "stragglerwatch_phase_seconds": p.get(labels.get("phase", ""), 0.0)}.get(family)  # fmt: skip
    steps = [int(k * interval / step) for k in range(len(times))]
    if duration is not None and name.endswith("_bucket"):
        return [str(n if float(labels["le"]) >= duration else 0) for n in steps]
    if duration is not None and name.endswith("_sum"):
        return [f"{n * duration:.6g}" for n in steps]
    if duration is not None or name == "stragglerwatch_steps_total":
        return [str(n) for n in steps]
    if name == "stragglerwatch_last_step_timestamp_seconds":
        return [str(t) for t in times]
    if name == "stragglerwatch_context_samples_total":
        return [str(k * interval) for k in range(len(times))]
    return [f"{value:g}"] * len(times)


def openmetrics(samples: list[Sample], ranks: int, times: list[int], interval: int) -> Iterator[str]:
    """The exposition of ``ranks`` ranks at ``times``, family by family, series by series."""
    profiles = {r % 4 if r % 128 != 7 else "straggler": profile(r) for r in range(min(ranks, 128))}
    kinds = {"info": "info", "counter": "counter", "gauge": "gauge", "histogram": "histogram", "summary": "summary"}
    done: set[str] = set()
    for family, kind, *_ in samples:
        if family in done:
            continue
        done.add(family)
        yield f"# TYPE {family} {kinds.get(kind, 'unknown')}\n"
        rows = [s for s in samples if s[0] == family]
        bodies = {  # "\x00" stands for the series' name and labels: one body per profile, not per rank
            (i, key): "".join(f"\x00{v} {t}\n" for v, t in zip(series_values(s, p, times, interval), times,
                                                                    strict=True))
            for i, s in enumerate(rows) for key, p in profiles.items()
        }  # fmt: skip
        for rank in range(ranks):
            key = rank % 4 if rank % 128 != 7 else "straggler"
            for i, (_, _, name, labels, _) in enumerate(rows):
                text = ",".join(f'{k}="{v}"' for k, v in {**labels, "rank": str(rank)}.items())
                yield bodies[i, key].replace("\x00", f"{name}{{{text}}} ")
    yield "# EOF\n"


def backfill(samples: list[Sample], ranks: int, start: int, end: int, interval: int, tsdb: Path) -> dict[str, Any]:
    """Blocks of ``ranks`` ranks from ``start`` to ``end``: one OpenMetrics file and one promtool run per
    two-hour window (promtool cuts blocks at those boundaries and reads its whole input once per window)."""
    window, stats = 7200, {"generate_s": 0.0, "promtool_s": 0.0, "openmetrics_bytes": 0, "samples": 0}
    for lo in range(start - start % window, end, window):
        times = list(range(max(start, lo), min(end, lo + window), interval))
        if not times:
            continue
        path = tsdb.parent / "input.om"
        t0 = time.perf_counter()
        with open(path, "w") as f:
            for text in openmetrics(samples, ranks, times, interval):
                f.write(text)
        stats["generate_s"] += time.perf_counter() - t0
        stats["openmetrics_bytes"] += path.stat().st_size
        t0 = time.perf_counter()
        out = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(path), str(tsdb)],
                             capture_output=True, text=True)  # fmt: skip
        stats["promtool_s"] += time.perf_counter() - t0
        path.unlink()
        if out.returncode != 0:
            raise RuntimeError(f"promtool failed: {out.stderr[-2000:]}")
        for line in out.stdout.splitlines()[1:]:  # BLOCK ULID, MIN TIME, MAX TIME, DURATION, SAMPLES, CHUNKS, SERIES
            stats["samples"] += int(line.split()[4])
            stats["block_series"] = max(stats.get("block_series", 0), int(line.split()[6]))
    return stats


def api(base: str, path: str, **params: Any) -> Any:
    url = f"{base}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
    data = json.loads(urllib.request.urlopen(url, timeout=120).read())
    if data.get("status") != "success":
        raise RuntimeError(f"{path}: {data}")
    return data["data"]


def evaluations(base: str, count: int, timeout_s: float) -> dict[str, list[float]]:
    """``evaluationTime`` (seconds) of each group and rule over ``count`` evaluations of every group."""
    seen: dict[str, str] = {}
    times: dict[str, list[float]] = {}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for group in api(base, "/api/v1/rules")["groups"]:
            if group["lastEvaluation"].startswith("0001") or seen.get(group["name"]) == group["lastEvaluation"]:
                continue
            seen[group["name"]] = group["lastEvaluation"]
            times.setdefault(f"group {group['name']}", []).append(group["evaluationTime"])
            for rule in group["rules"]:
                if rule.get("health") == "err":
                    raise RuntimeError(f"rule {rule['name']}: {rule.get('lastError')}")
                times.setdefault(rule["name"], []).append(rule["evaluationTime"])
        groups = [v for k, v in times.items() if k.startswith("group ")]
        if groups and all(len(v) >= count for v in groups):
            break
        time.sleep(1.0)
    return times


def query_stats(base: str, expr: str, repeat: int = 5) -> tuple[float, int, int]:
    """Shortest execution time (s) of ``repeat`` instant queries of ``expr``, samples read, series returned."""
    runs = [api(base, "/api/v1/query", query=expr, stats="all") for _ in range(repeat)]
    exec_s = min(r["stats"]["timings"]["execTotalTime"] for r in runs)
    return exec_s, runs[-1]["stats"]["samples"]["totalQueryableSamples"], len(runs[-1]["result"])


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(mode: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Backfill ``mode``'s series of ``args.ranks`` ranks, run Prometheus with the shipped rules, measure."""
    samples = one_rank(mode, args.port + 1)
    now = int(time.time())
    start, end = now - int(args.hours * 3600), now + int(args.ahead_min * 60)
    start -= start % args.interval
    tsdb = work / mode / "tsdb"
    tsdb.mkdir(parents=True)
    result: dict[str, Any] = {"mode": mode, "series_per_rank": len(samples), **backfill(
        samples, args.ranks, start, end, args.interval, tsdb)}  # fmt: skip
    config = work / mode / "prometheus.yml"
    config.write_text(
        f"global: {{scrape_interval: {args.interval}s, evaluation_interval: {args.interval}s}}\n"
        f"rule_files: ['{installed_rules()}']\n"
        "storage: {tsdb: {out_of_order_time_window: 2h}}  # the rules' results, stamped now, before the blocks end\n"
    )
    base = f"http://127.0.0.1:{args.port}"
    with open(work / mode / "prometheus.log", "w") as log:
        prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tsdb}",
                                 f"--web.listen-address=127.0.0.1:{args.port}"], stdout=log, stderr=log)  # fmt: skip
    try:
        t0 = time.perf_counter()
        while True:
            try:
                urllib.request.urlopen(f"{base}/-/ready", timeout=5)
                break
            except OSError:
                if prom.poll() is not None or time.perf_counter() - t0 > 600:
                    log_tail = (work / mode / "prometheus.log").read_text()[-2000:]
                    raise RuntimeError(f"prometheus did not start: {log_tail}") from None
                time.sleep(0.5)
        result["ready_s"] = time.perf_counter() - t0
        result["evaluations"] = evaluations(base, args.evaluations, args.evaluations * args.interval + 300)
        if time.time() > end - 300:
            print("  warning: the data ended less than 5 minutes after the last evaluation: raise --ahead-min")
        rules = [r for g in api(base, "/api/v1/rules")["groups"] for r in g["rules"]]
        result["queries"] = {r["name"]: query_stats(base, r["query"]) for r in rules if r["type"] == "recording"}
        slow = api(base, "/api/v1/query", query="stragglerwatch:busy_ratio:5m > 1.1")["result"]
        result["slow_ranks"] = sorted(int(s["metric"]["rank"]) for s in slow)
        raw = '__name__=~"stragglerwatch_[a-z0-9_]+"'
        result["series_total"] = int(api(base, "/api/v1/query", query=f"count({{{raw}}})")["result"][0]["value"][1])
        result["series_rank_7"] = int(
            api(base, "/api/v1/query", query=f'count({{{raw}, rank="7"}})')["result"][0]["value"][1])  # fmt: skip
        result["recorded_series"] = api(base, "/api/v1/status/tsdb")["headStats"]["numSeries"]
        status = Path(f"/proc/{prom.pid}/status")
        rss = [line.split()[1] for line in status.read_text().splitlines() if line.startswith("VmRSS:")]
        result["rss_bytes"] = int(rss[0]) * 1024 if rss else 0
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=60)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
    result["tsdb_bytes"] = du(tsdb)
    result["hours"] = (end - start) / 3600
    return result


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def report(r: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\n== {r['mode']} mode: {args.ranks} ranks, {r['series_per_rank']} series a rank "
          "(a real scrape of a GPU rank)")  # fmt: skip
    print(f"  data: {r['hours']:.2f} h at {args.interval} s: {r['samples']:,} samples, {r['block_series']:,} series "
          f"in the blocks ({r['series_total']:,} at evaluation time, {r['series_rank_7']} of rank 7), "
          f"OpenMetrics {r['openmetrics_bytes'] / 2**30:.2f} GiB generated in {r['generate_s']:.0f} s, "
          f"promtool {r['promtool_s']:.0f} s")  # fmt: skip
    print(f"  TSDB on disk: {r['tsdb_bytes'] / 2**20:.0f} MiB ({r['tsdb_bytes'] / r['samples']:.2f} bytes a "
          f"sample); Prometheus ready in {r['ready_s']:.1f} s, "
          f"resident {r['rss_bytes'] / 2**20:.0f} MiB after the evaluations; "
          f"{r['recorded_series']:,} recorded series; busy ratio > 1.1: ranks {r['slow_ranks']}")  # fmt: skip
    print(f"  evaluationTime over {args.evaluations} evaluations (min / median / max), and the expression alone as "
          "an instant query (shortest of 5, samples read, series out):")  # fmt: skip
    for name, values in r["evaluations"].items():
        spread = " / ".join(f"{ms(f(values)):>9s}" for f in (min, statistics.median, max))
        line = f"    {name:44s} {spread}"
        if name.startswith("group "):
            line += f"   (median {statistics.median(values) / max(min(values), 1e-9):.1f}x the min)"
        if name in r["queries"]:
            exec_s, read, out = r["queries"][name]
            line += f"   query {ms(exec_s):>9s}, {read:>7,} samples, {out:>5,} series"
        print(line)
    print(f"  the recording rules' expressions together read {sum(q[1] for q in r['queries'].values()):,} samples")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--hours", type=float, default=1.0, help="history before now (default 1)")
    parser.add_argument("--ahead-min", type=float, default=20.0, help="data after now: time to measure in")
    parser.add_argument("--interval", type=int, default=15, help="scrape and evaluation interval, seconds")
    parser.add_argument("--evaluations", type=int, default=8, help="evaluations of each group to measure")
    parser.add_argument("--modes", default="full,lean")
    parser.add_argument("--port", type=int, default=29090, help="Prometheus; the sample exporter uses the next")
    parser.add_argument("--series", action="store_true", help="only count one rank's series (no Prometheus needed)")
    args = parser.parse_args(argv)
    if args.series:
        series_counts(args.port + 1)
        return 0
    if PROMETHEUS is None or shutil.which("promtool") is None:
        print("needs prometheus and promtool (Debian's 'prometheus' package)")
        return 2
    print(f"rules: {installed_rules()}; {os.cpu_count()} CPUs")
    work = Path(tempfile.mkdtemp(prefix="stragglerwatch-rule-eval-"))
    t0 = time.perf_counter()
    try:
        for mode in args.modes.split(","):
            report(measure(mode, args, work), args)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    return 0


PROMETHEUS = shutil.which("prometheus")

if __name__ == "__main__":
    raise SystemExit(main())
