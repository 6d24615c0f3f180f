"""Cost of one context sample (not a pytest test): what the context sampler's thread spends per
sample, on the host and, where NVML and a GPU are present, on the GPU.

For each part, ``--samples`` samples back to back (after a warm-up): the median and 95th
percentile wall time per sample, and the CPU time of the sampling thread per sample (an upper
bound on the time it can hold the GIL, i.e. take from the training thread). The host part runs
first with no child process, then with ``--workers`` idle child processes (data-loader workers
are read too): the cost per child is the difference over their number. At the default interval
of 1 s, the cost per second of training is the cost of one sample (printed as a share of one
core). Then the cost of writing a batch of 10 rows to the context stream.

    python benchmarks/context_cost.py
    python benchmarks/context_cost.py --samples 500 --workers 8 --gpu 0
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pyarrow as pa  # noqa: E402

from stragglerwatch.record.context import CONTEXT_SCHEMA, rows_to_batch  # noqa: E402
from stragglerwatch.runtime.context.gpuctx import EMPTY, open_gpu  # noqa: E402
from stragglerwatch.runtime.context.hostctx import HostSampler  # noqa: E402


def measure(sample: Callable[[], Any], n: int) -> dict[str, float]:
    for _ in range(5):
        sample()
    wall, cpu = [], []
    for _ in range(n):
        t, c = time.perf_counter(), time.thread_time()
        sample()
        wall.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
    wall.sort()
    return {"median_us": statistics.median(wall) * 1e6, "p95_us": wall[int(0.95 * (n - 1))] * 1e6,
            "cpu_us": statistics.median(cpu) * 1e6}  # fmt: skip


def line(name: str, m: dict[str, float]) -> str:
    return (f"{name:<28} {m['median_us']:8.0f} µs median, {m['p95_us']:8.0f} µs p95, "
            f"{m['cpu_us']:8.0f} µs CPU of the sampling thread")  # fmt: skip


def _idle(seconds: float) -> None:
    time.sleep(seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=200, help="samples per part (default 200)")
    p.add_argument("--workers", type=int, default=2, help="idle child processes, as data-loader workers (default 2)")
    p.add_argument("--gpu", type=int, default=0, help="CUDA device index for the GPU part (default 0)")
    args = p.parse_args(argv)
    import torch  # a training process has torch's threads: the host sampler reads every thread's children

    print(f"torch {torch.__version__}, {args.samples} samples per part")
    host = HostSampler()
    alone = measure(host.sample, args.samples)
    print(line("host sample, no child process", alone))
    ctx = mp.get_context("fork")
    workers = [ctx.Process(target=_idle, args=(600,), daemon=True) for _ in range(args.workers)]
    for w in workers:
        w.start()
    try:
        row = host.sample()
        print(f"host: {row['cpus']} CPUs, affinity {row['affinity']}, {row['workers']} child processes seen, "
              f"/proc/pressure {'present' if row['cpu_pressure'] == row['cpu_pressure'] else 'absent'}")  # fmt: skip
        with_workers = measure(host.sample, args.samples)
        print(line(f"host sample, {args.workers} children", with_workers))
        if args.workers:
            print(f"per child process: {(with_workers['median_us'] - alone['median_us']) / args.workers:.0f} µs; at "
                  f"1 Hz: {alone['median_us'] / 1e4:.3f}% of one core, {with_workers['median_us'] / 1e4:.3f}% with "
                  f"{args.workers} children")  # fmt: skip
        gpu = open_gpu(args.gpu)
        if gpu is None:
            print("gpu sample                   (no NVML or no GPU here: nothing sampled, nothing costs)")
            rows = [{**host.sample(), **EMPTY}] * 10
        else:
            first = gpu.sample()
            print(f"gpu: NVML index {first['gpu']} {first['gpu_uuid']}, {len(gpu.links)} active NVLink links, "
                  f"XID events {'on' if gpu._events is not None else 'unavailable'}")  # fmt: skip
            print(line("gpu sample", measure(gpu.sample, args.samples)))
            rows = [{**host.sample(), **gpu.sample()}] * 10
            gpu.close()
        with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "c.arrows", "wb") as f:
            writer = pa.ipc.new_stream(f, CONTEXT_SCHEMA)

            def write() -> None:
                writer.write_batch(rows_to_batch(rows))
                f.flush()

            print(line("write 10 rows (every 10 s)", measure(write, max(20, args.samples // 10))))
            writer.close()
    finally:
        for w in workers:
            w.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
