"""Overhead of stragglerwatch on a DDP training loop (not a pytest test).

Two measurements, each comparing instrumented against plain *in the same run*,
interleaved in blocks, reporting medians and ratios (a shared machine is noisy):

1. ``ddp``: 4 gloo ranks under torchrun, a ~30 ms CPU step. Two identical DDP
   models train side by side, one plain and one with ``attach()``; blocks of
   steps alternate between them (and which goes first). Prints the median step
   time of each and the instrumented/plain ratio.
2. ``hooks``: one process (gloo, world size 1) with a tiny model whose compute is
   negligible, so the step-time difference is the host time our hooks and log
   thread add per step, at DDP's default bucket size (one bucket for a small
   model), by default and with ``bucket_timings=True``; then the probe's hook
   calls alone, called directly.

    python benchmarks/overhead.py              # both
    python benchmarks/overhead.py --part hooks
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch
from stragglerwatch.probes import StepProbe


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


def interleave(variants: dict, batches, blocks: int, sync: bool) -> dict[str, list[float]]:
    """Per-block median step time of each variant; the order alternates per block."""
    names = list(variants)
    per_block: dict[str, list[float]] = {n: [] for n in names}
    for b in range(blocks):
        for name in names if b % 2 == 0 else names[::-1]:
            if sync:
                dist.barrier()
            model, opt = variants[name]
            per_block[name].append(statistics.median(timed_block(model, opt, batches)))
    return per_block


def make_pair(build, run_dir: Path, metrics_port: int | None = None, **ddp_kw):
    torch.manual_seed(0)
    plain = DDP(build(), **ddp_kw)
    torch.manual_seed(0)
    inst = DDP(build(), **ddp_kw)
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.01)
    opt_i = torch.optim.SGD(inst.parameters(), lr=0.01)
    watch = stragglerwatch.attach(
        inst, run_dir, optimizer=opt_i, prometheus_port=metrics_port, prometheus_addr="127.0.0.1"
    )
    return {"plain": (plain, opt_p), "instrumented": (inst, opt_i)}, watch


def ddp_worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    width = args.hidden

    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10))

    variants, watch = make_pair(build, Path(args.run_dir), metrics_port=args.metrics_port)
    batches = [(torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))) for _ in range(args.steps)]
    interleave(variants, batches[:5], 2, sync=True)  # warm-up
    res = interleave(variants, batches, args.blocks, sync=True)
    watch.close()
    if rank == 0:
        p, i = statistics.median(res["plain"]), statistics.median(res["instrumented"])
        pair = [b / a for a, b in zip(res["plain"], res["instrumented"], strict=True)]
        scraped = ", every rank's /metrics scraped once a second" if args.metrics_port else ""
        print(f"ddp: 4 gloo ranks, {args.blocks} blocks x {args.steps} steps each, interleaved{scraped}")
        print(f"ddp: median step plain {p * 1e3:.2f} ms, instrumented {i * 1e3:.2f} ms")
        print(f"ddp: ratio of medians {i / p:.4f}; median of per-block ratios {statistics.median(pair):.4f}")
        stats = watch.stats()
        print(f"ddp: steps recorded per rank {stats['steps_written']}, write errors {stats['write_errors']}")
    dist.destroy_process_group()


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
    print(
        f"hook calls alone (forward pre/post incl. output grad hook registration, optimizer pre/post): {t * 1e6:.2f} us"
    )


def hooks_bench(args: argparse.Namespace) -> None:
    """World size 1, tiny model: the step-time difference is the host time stragglerwatch adds."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)

        def build() -> nn.Module:
            return nn.Sequential(nn.Linear(8, 8))

        variants, watch = make_pair(build, Path(tmp) / "run")
        torch.manual_seed(0)
        timed = DDP(build())
        opt_t = torch.optim.SGD(timed.parameters(), lr=0.01)
        watch_t = stragglerwatch.attach(timed, Path(tmp) / "run-buckets", optimizer=opt_t, bucket_timings=True)
        variants["bucket_timings"] = (timed, opt_t)
        batches = [(torch.randn(4, 8), torch.randint(0, 8, (4,))) for _ in range(args.steps)]
        interleave(variants, batches, 4, sync=False)
        res = interleave(variants, batches, args.blocks, sync=False)
        watch.close()
        watch_t.close()
        plain = res["plain"]
        print(f"hooks: 1 gloo rank, tiny model (DDP default bucket size: 1 bucket), {args.blocks} interleaved blocks")
        print(f"hooks: plain DDP step {statistics.median(plain) * 1e6:.1f} us")
        for name in ("instrumented", "bucket_timings"):
            diffs = [b - a for a, b in zip(plain, res[name], strict=True)]
            q1, _, q3 = statistics.quantiles(diffs, n=4)
            print(
                f"hooks: {name}: added host time per step {statistics.median(diffs) * 1e6:.1f} us "
                f"(interquartile {q1 * 1e6:.1f}..{q3 * 1e6:.1f})"
            )
        dist.destroy_process_group()
    hook_calls_bench()


scraper_stats = {"ok": 0, "failed": 0}


def scrape_loop(base_port: int, ranks: int, stop: threading.Event) -> None:
    """Like a Prometheus server: GET every rank's /metrics once a second."""
    while not stop.wait(1.0):
        for r in range(ranks):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{base_port + r}/metrics", timeout=2).read()
                scraper_stats["ok"] += 1
            except OSError:
                scraper_stats["failed"] += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("ddp", "hooks", "both"), default="both")
    p.add_argument("--blocks", type=int, default=30, help="interleaved blocks per variant (default 30)")
    p.add_argument("--steps", type=int, default=20, help="steps per block (default 20)")
    p.add_argument("--hidden", type=int, default=1024, help="MLP width of the ddp part (default 1024)")
    p.add_argument("--batch", type=int, default=64, help="batch size of the ddp part (default 64)")
    p.add_argument("--scrape", action="store_true", help="ddp part: export /metrics and scrape every rank each second")
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--metrics-port", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if "LOCAL_RANK" in os.environ:  # we are a torchrun worker of the ddp part
        ddp_worker(args)
        return
    if args.part in ("hooks", "both"):
        hooks_bench(args)
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
                print(f"ddp: scrapes done {scraper_stats['ok']}, failed {scraper_stats['failed']}")


if __name__ == "__main__":
    main()
