"""Overhead of stragglerwatch on a DDP training loop (not a pytest test).

Every comparison is instrumented against plain *in the same run*, interleaved in blocks whose
order alternates, reporting medians and ratios (a shared machine is noisy). A plain block runs
with nothing of ours alive: no hook, no tap, no log, watchdog or exporter thread.

1. ``ddp``: 4 gloo ranks under torchrun, a ~30 ms CPU step. Two identical DDP models train
   side by side; before each of the instrumented model's blocks it is attached (log thread,
   watchdog, optionally the exporter) and after it closed, so the threads' cost is inside the
   instrumented blocks and absent from the plain ones. Prints the median step time of each,
   the ratio of medians and the median of per-block ratios. ``--scrape`` also exports
   ``/metrics`` and scrapes every rank once a second during the instrumented blocks.
2. ``buckets``: host time added per step, one gloo rank, a model of N 64x64 layers with a
   bucket cap of about one layer (DDP's rebuilt buckets: printed), for N = 1, 50, 100, 200.
   Default attach: in one process, attached and closed around each instrumented block,
   alternating with plain blocks. ``bucket_timings=True`` registers a DDP comm hook that
   PyTorch cannot remove, so there each block is a separate process (same seed, same model),
   alternating with plain processes. Prints the added microseconds per step and, for
   ``bucket_timings``, per bucket. Then the probe's hook calls alone, called directly.

    python benchmarks/overhead.py                  # both
    python benchmarks/overhead.py --part buckets --bucket-blocks 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch
from stragglerwatch.runtime.probes import StepProbe

BUCKETS = (1, 50, 100, 200)
VARIANTS = ("plain", "attached", "bucket_timings")


def step_fn(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed_block(model, opt, batches) -> list[float]:
    out = []
    for x, y in batches:
        t0 = time.perf_counter()
        step_fn(model, opt, x, y)
        out.append(time.perf_counter() - t0)
    return out


def ddp_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    width = args.hidden

    def build() -> nn.Module:
        torch.manual_seed(0)
        return DDP(nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                 nn.Linear(width, 10)))  # fmt: skip

    plain, inst = build(), build()
    opts = {"plain": torch.optim.SGD(plain.parameters(), lr=0.01),
            "instrumented": torch.optim.SGD(inst.parameters(), lr=0.01)}  # fmt: skip
    models = {"plain": plain, "instrumented": inst}
    batches = [(torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))) for _ in range(args.steps)]
    steps_written = 0

    def attached(block: Callable[[], list[float]]) -> list[float]:
        nonlocal steps_written
        watch = stragglerwatch.attach(inst, args.run_dir, optimizer=opts["instrumented"],
                                      prometheus_port=args.metrics_port, prometheus_addr="127.0.0.1")  # fmt: skip
        try:
            return block()
        finally:
            watch.close()
            steps_written += watch.stats()["steps_written"]

    per_block: dict[str, list[float]] = {"plain": [], "instrumented": []}
    for b in range(args.blocks + 2):  # the first two are warm-up
        for name in ("plain", "instrumented") if b % 2 == 0 else ("instrumented", "plain"):
            dist.barrier()

            def block(name: str = name) -> list[float]:
                return timed_block(models[name], opts[name], batches)

            times = attached(block) if name == "instrumented" else block()
            if b >= 2:
                per_block[name].append(statistics.median(times[2:]))  # the block's first steps: attach's warm-up
    if rank == 0:
        p, i = statistics.median(per_block["plain"]), statistics.median(per_block["instrumented"])
        pair = [b / a for a, b in zip(per_block["plain"], per_block["instrumented"], strict=True)]
        scraped = ", every rank's /metrics scraped once a second" if args.metrics_port else ""
        print(f"ddp: 4 gloo ranks, {args.blocks} blocks x {args.steps} steps each, interleaved, attached and "
              f"closed around each instrumented block{scraped}")  # fmt: skip
        print(f"ddp: median step plain {p * 1e3:.2f} ms, instrumented {i * 1e3:.2f} ms ({(i - p) * 1e6:+.0f} us)")
        print(f"ddp: ratio of medians {i / p:.4f}; median of per-block ratios {statistics.median(pair):.4f}")
        print(f"ddp: steps recorded on rank 0: {steps_written}")
    dist.destroy_process_group()


def bucket_model(buckets: int) -> tuple[nn.Module, float]:
    """``buckets`` 64x64 layers; a bucket cap that puts each layer's gradients in a bucket of its own."""
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64) for _ in range(buckets)]
    per_layer_mb = sum(p.numel() * 4 for p in layers[0].parameters()) / 2**20
    return nn.Sequential(*layers), per_layer_mb * 1.01


def count_buckets(ddp: DDP) -> int | None:
    """How many gradient buckets DDP uses after its first iteration's rebuild (from its logging
    data; None if this torch lacks it)."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        return len(str(sizes).split(",")) if sizes else None
    except Exception:
        return None


def bucket_worker(args: argparse.Namespace) -> None:
    """In a fresh process, either one block of plain or ``bucket_timings`` (``--variant``), or
    (``--variant attached``) the in-process A/B of plain against attach-per-block. Prints JSON."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        model, cap = bucket_model(args.buckets)
        ddp = DDP(model, bucket_cap_mb=cap)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        batches = [(torch.randn(4, 64), torch.randint(0, 64, (4,))) for _ in range(args.steps)]
        timed_block(ddp, opt, batches[:20])  # warm-up: DDP rebuilds its buckets after the first step
        row: dict[str, object] = {"buckets": count_buckets(ddp)}
        if args.variant == "attached":
            added = []
            for b in range(args.ab_blocks):
                times = {}
                for name in ("plain", "attached") if b % 2 == 0 else ("attached", "plain"):
                    watch = stragglerwatch.attach(ddp, Path(tmp) / "run", optimizer=opt) if name == "attached" else None
                    times[name] = statistics.median(timed_block(ddp, opt, batches)[2:])
                    if watch is not None:
                        watch.close()
                added.append(times["attached"] - times["plain"])
            row["added_s"] = statistics.median(added)
        else:
            watch = None
            if args.variant == "bucket_timings":
                watch = stragglerwatch.attach(ddp, Path(tmp) / "run", optimizer=opt, bucket_timings=True)
            row["median_s"] = statistics.median(timed_block(ddp, opt, batches))
            if watch is not None:
                watch.close()
        dist.destroy_process_group()
    print(json.dumps(row))


def run_bucket_worker(variant: str, buckets: int, steps: int, ab_blocks: int = 0) -> dict:
    cmd = [sys.executable, __file__, "--bucket-worker", "--variant", variant, "--buckets", str(buckets),
           "--bucket-steps", str(steps), "--ab-blocks", str(ab_blocks)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def buckets_bench(args: argparse.Namespace) -> None:
    print(f"buckets: 1 gloo rank, N 64x64 layers, bucket cap ~ one layer; default attach: {args.ab_blocks} "
          f"in-process A/B block pairs of {args.bucket_steps // 4} steps; bucket_timings: {args.bucket_blocks} "
          f"processes of {args.bucket_steps} steps alternating with plain ones")  # fmt: skip
    for n in BUCKETS:
        ab = run_bucket_worker("attached", n, args.bucket_steps // 4, args.ab_blocks)
        plain, timed = [], []
        for b in range(args.bucket_blocks):
            for variant in ("plain", "bucket_timings") if b % 2 == 0 else ("bucket_timings", "plain"):
                row = run_bucket_worker(variant, n, args.bucket_steps)
                (plain if variant == "plain" else timed).append(row["median_s"])
        added = statistics.median([t - p for p, t in zip(plain, timed, strict=True)])
        buckets = ab["buckets"] or n
        line = (f"buckets: {n:3d} layers, {buckets} buckets: plain step {statistics.median(plain) * 1e6:.0f} us; "
                f"attached {ab['added_s'] * 1e6:+.1f} us; bucket_timings {added * 1e6:+.1f} us")  # fmt: skip
        if buckets > 1:
            line += f" ({added / buckets * 1e6:.1f} us a bucket)"
        print(line)
    hook_calls_bench()


def hook_calls_bench(n: int = 20000) -> None:
    """The probe's own Python work per step, calling its hooks directly (no autograd, no DDP)."""
    import timeit

    sink: list = []
    opt = object()
    probe = StepProbe(sink.append, None, lambda: True, ender=id(opt))
    out = torch.randn(4, 4, requires_grad=True) * 2
    module = nn.Linear(1, 1)

    def one_step() -> None:
        probe.on_forward_pre(module, None)
        probe.on_forward(module, None, out)
        probe.on_optimizer_pre(opt, None, None)
        probe.on_optimizer_post(opt, None, None)
        sink.clear()

    t = min(timeit.repeat(one_step, number=n, repeat=5)) / n
    print(f"hook calls alone (forward pre/post incl. output grad hook registration, optimizer pre/post): "
          f"{t * 1e6:.2f} us")  # fmt: skip


scraper_stats = {"ok": 0, "failed": 0}


def scrape_loop(base_port: int, ranks: int, stop: threading.Event) -> None:
    """Like a Prometheus server: GET every rank's /metrics once a second (refused while plain)."""
    while not stop.wait(1.0):
        for r in range(ranks):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{base_port + r}/metrics", timeout=2).read()
                scraper_stats["ok"] += 1
            except OSError:
                scraper_stats["failed"] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("ddp", "buckets", "both"), default="both")
    p.add_argument("--blocks", type=int, default=30, help="ddp: interleaved blocks per variant (default 30)")
    p.add_argument(
        "--bucket-blocks", type=int, default=6, help="buckets: bucket_timings processes per size (default 6)"
    )
    p.add_argument(
        "--ab-blocks", type=int, default=20, help="buckets: in-process A/B block pairs per size (default 20)"
    )
    p.add_argument("--steps", type=int, default=20, help="ddp: steps per block (default 20)")
    p.add_argument("--bucket-steps", type=int, default=300, help="buckets: timed steps per process (default 300)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width of the ddp part (default 1024)")
    p.add_argument("--batch", type=int, default=64, help="batch size of the ddp part (default 64)")
    p.add_argument("--scrape", action="store_true", help="ddp part: export /metrics and scrape every rank each second")
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--bucket-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, default="plain", help=argparse.SUPPRESS)
    p.add_argument("--buckets", type=int, default=1, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.bucket_worker:
        bucket_worker(args)
        return
    if "LOCAL_RANK" in os.environ:  # we are a torchrun worker of the ddp part
        ddp_worker(args)
        return
    if args.part in ("buckets", "both"):
        buckets_bench(args)
    if args.part in ("ddp", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            port = 29650 if args.scrape else None
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", __file__,
                   "--blocks", str(args.blocks), "--steps", str(args.steps), "--hidden", str(args.hidden),
                   "--batch", str(args.batch), "--run-dir", os.path.join(tmp, "run")]  # fmt: skip
            stop = threading.Event()
            if port:
                cmd += ["--metrics-port", str(port)]
                threading.Thread(target=scrape_loop, args=(port, 4, stop), daemon=True).start()
            try:
                subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800)
            finally:
                stop.set()
            if port:
                print(f"ddp: scrapes done {scraper_stats['ok']}, refused while plain {scraper_stats['failed']}")


if __name__ == "__main__":
    main()
