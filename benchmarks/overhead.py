"""What stragglerwatch costs a training job, as the user pays it (not a pytest test).

Every comparison is against a truly plain baseline: a plain run is a separate process that never
imports stragglerwatch. Plain and instrumented runs alternate (and which goes first alternates),
on the same seed and batches; the figures are medians over the pairs, with the ratios per pair.

1. ``ddp`` (default): 4 gloo ranks under torchrun, a ~35 ms CPU step, ``--steps`` timed steps
   per run after ``--warmup`` untimed ones. Per run (rank 0's clock, every rank's steps): the loop's
   wall time from barrier to barrier, the mean, median and p99 step (a median cannot see a cost
   paid once a second: flushes, the samplers, the control file, the watchdog's polls; the mean
   and the p99 can), and for the instrumented run ``attach()`` and ``close()`` (close includes
   the last flush and the compaction to Parquet, timed on its own). ``--scrape`` also exports
   ``/metrics`` and scrapes every rank once a second.
2. ``buckets``: host time added per step on one gloo rank, a model of N 64x64 layers with a bucket
   cap of about one layer (N = 1, 50, 100, 200): plain, default attach and ``bucket_timings=True``,
   each a separate process, in turns.
3. ``marks``: the probe's own work per step, calling its hooks directly (no autograd, no DDP): on
   the host clock, and with CUDA-style marks (an event created and recorded per mark) on the fake
   CUDA layer of the test suite (``tests/fake_cuda.py``; its events are Python objects, whose own
   cost is measured and printed beside it; a real ``torch.cuda.Event`` costs what
   ``benchmarks/gpu_check.py`` measures on a GPU).

    python benchmarks/overhead.py                       # ddp, 6 pairs of 300 steps (~5 min)
    python benchmarks/overhead.py --part buckets
    python benchmarks/overhead.py --part marks
    python benchmarks/overhead.py --part all --pairs 4

The log thread's CPU per step, by collectives per step: ``benchmarks/logthread_cost.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from separate import in_turns, result, step_summary
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
BUCKETS = (1, 50, 100, 200)


def step_fn(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# --- ddp: a torchrun job per run --------------------------------------------------------------


def ddp_worker(args: argparse.Namespace) -> None:
    """One rank of one run; rank 0 prints the run's figures as JSON. Imports stragglerwatch only
    when instrumented."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    width = args.hidden
    model = DDP(nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                              nn.Linear(width, 10)))  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches = [(torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))) for _ in range(16)]
    row: dict[str, Any] = {"variant": args.variant}
    watch = None
    if args.variant == "attached":
        t0 = time.perf_counter()
        import stragglerwatch
        from stragglerwatch.runtime.output import writer

        row["import_s"] = time.perf_counter() - t0
        compaction: list[float] = []
        compact = writer.compact_stream

        def timed_compact(path: Any) -> Any:  # measurement only: the same call, timed
            c0 = time.perf_counter()
            try:
                return compact(path)
            finally:
                compaction.append(time.perf_counter() - c0)

        writer.compact_stream = timed_compact
        t0 = time.perf_counter()
        watch = stragglerwatch.attach(model, args.run_dir, optimizer=opt, prometheus_port=args.metrics_port,
                                      prometheus_addr="127.0.0.1")  # fmt: skip
        row["attach_s"] = time.perf_counter() - t0
    for i in range(args.warmup):
        step_fn(model, opt, *batches[i % len(batches)])
    dist.barrier()
    times = []
    start = time.perf_counter()
    for i in range(args.steps):
        t0 = time.perf_counter()
        step_fn(model, opt, *batches[i % len(batches)])
        times.append(time.perf_counter() - t0)
    dist.barrier()
    row.update(step_summary(times, time.perf_counter() - start))
    if watch is not None:
        t0 = time.perf_counter()
        watch.close()
        row["close_s"] = time.perf_counter() - t0
        row["compaction_s"] = sum(compaction)
        row["steps_written"] = watch.stats()["steps_written"]
    closes = [None] * dist.get_world_size()
    dist.all_gather_object(closes, row.get("close_s"))
    if dist.get_rank() == 0:
        row["close_max_s"] = max((c for c in closes if c is not None), default=None)
        print("RESULT " + json.dumps(row), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # past here only interpreter teardown, where gloo's threads have aborted a rank now and then


def run_ddp(variant: str, args: argparse.Namespace, tmp: str, n: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__,
           "--worker", "ddp", "--variant", variant, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--hidden", str(args.hidden), "--batch", str(args.batch),
           "--run-dir", os.path.join(tmp, f"run{n}")]  # fmt: skip
    if args.scrape and variant == "attached":
        cmd += ["--metrics-port", str(args.scrape_port)]
    return result(cmd)


scraper_stats = {"ok": 0, "failed": 0}


def scrape_loop(base_port: int, ranks: int, stop: threading.Event) -> None:
    """Like a Prometheus server: GET every rank's /metrics once a second (refused while none runs)."""
    while not stop.wait(1.0):
        for r in range(ranks):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{base_port + r}/metrics", timeout=2).read()
                scraper_stats["ok"] += 1
            except OSError:
                scraper_stats["failed"] += 1


def ddp_bench(args: argparse.Namespace) -> None:
    print(f"ddp: 4 gloo ranks on {os.cpu_count()} cores, {args.pairs} pairs of separate runs (plain never imports "
          f"stragglerwatch), {args.steps} timed steps after {args.warmup} warm-up each, alternating order"
          + (", every rank's /metrics scraped once a second" if args.scrape else ""))  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "attached": []}
    stop = threading.Event()
    if args.scrape:
        threading.Thread(target=scrape_loop, args=(args.scrape_port, 4, stop), daemon=True).start()
    with tempfile.TemporaryDirectory() as tmp:
        for p, variant in in_turns(args.pairs, ("plain", "attached")):
            row = run_ddp(variant, args, tmp, 2 * p + len(runs[variant]))
            runs[variant].append(row)
            print(f"  pair {p + 1} {variant:8s} wall {row['wall_s']:.3f} s, mean {row['mean_s'] * 1e3:.2f} "
                  f"ms, median {row['median_s'] * 1e3:.2f} ms, p99 {row['p99_s'] * 1e3:.2f} ms",
                  flush=True)  # fmt: skip
    stop.set()
    med = {v: {k: statistics.median(r[k] for r in rows) for k in ("wall_s", "mean_s", "median_s", "p99_s")}
           for v, rows in runs.items()}  # fmt: skip
    plain, inst = med["plain"], med["attached"]
    print("ddp: medians over the runs (ms a step; wall in s)")
    print("| variant | loop wall | mean step | median step | p99 step |")
    print("|---|---|---|---|---|")
    for v in ("plain", "attached"):
        m = med[v]
        print(f"| {v} | {m['wall_s']:.3f} | {m['mean_s'] * 1e3:.2f} | {m['median_s'] * 1e3:.2f} | "
              f"{m['p99_s'] * 1e3:.2f} |")  # fmt: skip
    walls = [a["wall_s"] / b["wall_s"] for a, b in zip(runs["attached"], runs["plain"], strict=True)]
    print(f"ddp: attached/plain: loop wall {inst['wall_s'] / plain['wall_s']:.3f} (per pair: median "
          f"{statistics.median(walls):.3f}, range {min(walls):.3f}-{max(walls):.3f}); mean step "
          f"{inst['mean_s'] / plain['mean_s']:.3f}; median step {inst['median_s'] / plain['median_s']:.3f}; "
          f"p99 step {inst['p99_s'] / plain['p99_s']:.3f}")  # fmt: skip
    att = runs["attached"]

    def ms(key: str) -> float:
        return statistics.median(r[key] for r in att) * 1e3

    print(f"ddp: one-off costs of the instrumented run (medians): import {ms('import_s'):.0f} ms, attach "
          f"{ms('attach_s'):.0f} ms, close {ms('close_s'):.0f} ms on rank 0 (slowest rank {ms('close_max_s'):.0f} "
          f"ms), of which the compaction to Parquet {ms('compaction_s'):.0f} ms; steps recorded on rank 0 "
          f"{att[-1]['steps_written']} of {args.warmup + args.steps}")  # fmt: skip
    if args.scrape:
        print(f"ddp: scrapes done {scraper_stats['ok']}, refused while no instrumented run was up "
              f"{scraper_stats['failed']}")


# --- buckets: a process per run -----------------------------------------------------------------


def bucket_model(buckets: int) -> tuple[nn.Module, float]:
    """``buckets`` 64x64 layers; a bucket cap that puts each layer's gradients in a bucket of its own."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(buckets)]
    per_layer_mb = sum(p.numel() * 4 for p in layers[0].parameters()) / 2**20
    return nn.Sequential(*layers), per_layer_mb * 1.01


def count_buckets(ddp: DDP) -> int | None:
    """How many gradient buckets DDP uses after its first iteration's rebuild (None if unknown)."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        return len(str(sizes).split(",")) if sizes else None
    except Exception:
        return None


def bucket_worker(args: argparse.Namespace) -> None:
    """One run: plain, attached or bucket_timings; prints JSON. Imports stragglerwatch only when
    instrumented."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        model, cap = bucket_model(args.buckets)
        ddp = DDP(model, bucket_cap_mb=cap)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        watch = None
        if args.variant != "plain":
            import stragglerwatch

            watch = stragglerwatch.attach(ddp, Path(tmp) / "run", optimizer=opt,
                                          bucket_timings=args.variant == "bucket_timings")  # fmt: skip
        batches = [(torch.randn(4, 64), torch.randint(0, 64, (4,))) for _ in range(16)]
        for i in range(20):  # warm-up: DDP rebuilds its buckets after the first step
            step_fn(ddp, opt, *batches[i % 16])
        times, start = [], time.perf_counter()
        for i in range(args.steps):
            t0 = time.perf_counter()
            step_fn(ddp, opt, *batches[i % 16])
            times.append(time.perf_counter() - t0)
        row: dict[str, Any] = {"buckets": count_buckets(ddp), **step_summary(times, time.perf_counter() - start)}
        if watch is not None:
            watch.close()
        dist.destroy_process_group()
    print("RESULT " + json.dumps(row))


def run_bucket_worker(variant: str, buckets: int, steps: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", "buckets", "--variant", variant, "--buckets", str(buckets),
           "--steps", str(steps)]  # fmt: skip
    return result(cmd)


def buckets_bench(args: argparse.Namespace) -> None:
    steps = args.bucket_steps
    print(f"buckets: 1 gloo rank, N 64x64 layers, bucket cap ~ one layer; plain, attached and bucket_timings "
          f"each a separate process of {steps} timed steps, {args.bucket_runs} of each per size, in turns; "
          "medians")  # fmt: skip
    print("| layers | buckets | plain mean step | attached: added mean (p99) | bucket_timings: added mean (p99) "
          "| per bucket |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    variants = ("plain", "attached", "bucket_timings")
    for n in BUCKETS:
        rows: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        for _, v in in_turns(args.bucket_runs, variants):
            rows[v].append(run_bucket_worker(v, n, steps))
        med = {v: {k: statistics.median(x[k] for x in rs) for k in ("mean_s", "p99_s")} for v, rs in rows.items()}
        buckets = rows["plain"][0]["buckets"] or n

        def added(v: str, key: str, med: dict = med) -> float:
            return (med[v][key] - med["plain"][key]) * 1e6

        per = f"{added('bucket_timings', 'mean_s') / buckets:.1f} us" if buckets > 1 else "-"
        print(f"| {n} | {buckets} | {med['plain']['mean_s'] * 1e6:.0f} us | {added('attached', 'mean_s'):+.0f} us "
              f"({added('attached', 'p99_s'):+.0f}) | {added('bucket_timings', 'mean_s'):+.0f} us "
              f"({added('bucket_timings', 'p99_s'):+.0f}) | {per} |", flush=True)  # fmt: skip


# --- marks: the probe's own work ------------------------------------------------------------------


def marks_bench(n: int = 20000) -> None:
    """The probe's hooks of one step called directly, on the host clock and with CUDA-style marks."""
    import timeit

    from stragglerwatch.runtime.capture.probes import StepProbe

    sys.path.insert(0, str(HERE.parent / "tests"))
    import fake_cuda

    def per_step(probe: StepProbe, sink: list) -> float:
        opt = object()
        probe._ender = id(opt)
        out = torch.randn(4, 4, requires_grad=True) * 2
        module = nn.Linear(1, 1)

        def one_step() -> None:
            probe.on_forward_pre(module, None)
            probe.on_forward(module, None, out)
            probe.on_optimizer_pre(opt, None, None)
            probe.on_optimizer_post(opt, None, None)
            sink.clear()

        return min(timeit.repeat(one_step, number=n, repeat=5)) / n

    sink: list = []
    host = per_step(StepProbe(sink.append, None, lambda: True), sink)
    fake_cuda.install()
    from stragglerwatch.runtime.capture.devices import CaptureGate, CudaMarks

    marks = CudaMarks(CaptureGate())
    made = [0]

    def counted() -> Any:
        made[0] += 1
        return marks.mark()

    cuda = per_step(StepProbe(sink.append, counted, lambda: True), sink)
    per_mark = made[0] / (n * 5)  # per_step runs 5 repeats of n steps
    one = min(timeit.repeat(lambda: torch.cuda.Event(enable_timing=True).record(), number=n, repeat=5)) / n
    print("marks: the probe's hooks of one step (forward pre/post with the output's grad hook, optimizer pre/post), "
          "called directly")  # fmt: skip
    print(f"marks: host clock {host * 1e6:.2f} us a step")
    print(f"marks: CUDA-style marks (fake CUDA layer) {cuda * 1e6:.2f} us a step, ours "
          f"{(cuda - one * per_mark) * 1e6:.2f} us without the fake events' own "
          f"create and record {one * 1e6:.2f} us a mark x {per_mark:.1f} marks a step; a real "
          f"torch.cuda.Event's cost is measured by benchmarks/gpu_check.py, not here")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("ddp", "buckets", "marks", "all"), default="ddp")
    p.add_argument("--pairs", type=int, default=6, help="ddp: pairs of plain and instrumented runs (default 6)")
    p.add_argument("--steps", type=int, default=300, help="ddp: timed steps per run (default 300)")
    p.add_argument("--warmup", type=int, default=10, help="ddp: untimed steps first (default 10)")
    p.add_argument("--hidden", type=int, default=1024, help="ddp: MLP width (default 1024)")
    p.add_argument("--batch", type=int, default=64, help="ddp: batch size (default 64)")
    p.add_argument("--scrape", action="store_true", help="ddp: export /metrics and scrape every rank each second")
    p.add_argument("--scrape-port", type=int, default=29650, help="ddp --scrape: rank 0's port (default 29650)")
    p.add_argument("--bucket-runs", type=int, default=4, help="buckets: runs of each variant per size (default 4)")
    p.add_argument("--bucket-steps", type=int, default=300, help="buckets: timed steps per run (default 300)")
    p.add_argument("--worker", choices=("ddp", "buckets"), help=argparse.SUPPRESS)
    p.add_argument("--variant", default="plain", help=argparse.SUPPRESS)
    p.add_argument("--buckets", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker == "ddp":
        ddp_worker(args)
    elif args.worker == "buckets":
        bucket_worker(args)
    else:
        if args.part in ("marks", "all"):
            marks_bench()
        if args.part in ("buckets", "all"):
            buckets_bench(args)
        if args.part in ("ddp", "all"):
            ddp_bench(args)


if __name__ == "__main__":
    main()
