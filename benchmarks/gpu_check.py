"""Check the CUDA-event timing path on a real GPU (not a pytest test; needs CUDA and NCCL).

    torchrun --nproc_per_node 1 benchmarks/gpu_check.py        # or as many GPUs as there are

Each rank trains a small model with a BatchNorm layer (DDP broadcasts its buffers at every
forward) whose forward also spins the GPU for a known time (``torch.cuda._sleep``), and the
loop all-reduces its loss every step. With stragglerwatch attached, the recorded
``forward_s`` must be about that GPU time (host timestamps would only see the kernel
launches), ``timing`` must be ``cuda``, the phases must add up to the step, the broadcast and
the loss all-reduce must be seen as ``collective_wait_s``, ``busy_s`` must be the step minus
communication, and the host loop must not slow down (no synchronisation in the hot path).

With two or more GPUs the last rank also spins its GPU ``LATE_MS`` before the loss all-reduce:
on NCCL the other hosts do not block, their streams wait, so their ``collective_wait_s`` must
hold that wait (measured on the stream, by events around ``Work.wait``), the late rank's busy
time must exceed theirs by about as much, and ``analyze`` must flag it with cause ``other``.
Prints the figures; exits 1 if a check fails.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch

SPIN_MS = 20.0
LATE_MS = 15.0


class Spin(nn.Module):
    def __init__(self, cycles: int):
        super().__init__()
        self.lin = nn.Linear(1024, 1024)
        self.norm = nn.BatchNorm1d(1024)  # buffers: DDP broadcasts them at every forward
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)  # GPU busy for SPIN_MS, host returns at once
        return self.norm(self.lin(x))


def cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int, late_cycles: int = 0) -> list[float]:
    x = torch.randn(64, 1024, device="cuda")
    host = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if late_cycles:
            torch.cuda._sleep(late_cycles)  # this rank's GPU is late for the loss all-reduce
        logged = loss.detach()
        dist.all_reduce(logged)  # the loop's own collective, every step
        host.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return host


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check", file=sys.stderr)
        return 0
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    per_ms = cycles_per_ms()
    cycles = int(per_ms * SPIN_MS)
    late = int(per_ms * LATE_MS) if world > 1 and rank == world - 1 else 0
    run_dir = os.environ.get("STRAGGLERWATCH_RUN_DIR") or tempfile.mkdtemp(prefix="gpu-check-")
    plain = DDP(Spin(cycles).cuda(), device_ids=[local])
    inst = DDP(Spin(cycles).cuda(), device_ids=[local])
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.01)
    opt_i = torch.optim.SGD(inst.parameters(), lr=0.01)
    loop(plain, opt_p, 5)
    watch = stragglerwatch.attach(inst, run_dir, optimizer=opt_i)
    host_plain, host_inst = [], []
    for _ in range(5):  # interleaved blocks
        host_plain += loop(plain, opt_p, 20, late)
        host_inst += loop(inst, opt_i, 20, late)
    watch.close()
    dist.barrier()
    failures = []
    if rank == 0:
        failures = check(run_dir, statistics.median(host_inst) / statistics.median(host_plain), world)
    dist.destroy_process_group()
    return 1 if failures else 0


def check(run_dir: str, ratio: float, world: int) -> list[str]:
    """Print the figures of the run and return the checks that failed."""
    from stragglerwatch.analysis import analyze_run
    from stragglerwatch.schema import PHASE_COLUMNS

    failures = []
    df = stragglerwatch.load_run(run_dir)
    df = df[df["step"] >= 2]
    ms = (df.groupby("rank")[["step_s", "busy_s", "forward_s", "allreduce_wait_s", "collective_wait_s",
                              "other_s"]].median() * 1e3)  # fmt: skip
    parts = df[list(PHASE_COLUMNS)].sum(axis=1)
    print(f"gpu_check: {torch.cuda.get_device_name()}, {world} rank(s), {len(df)} steps")
    print(f"gpu_check: timing column {sorted(set(df['timing']))}")
    print(f"gpu_check: medians per rank (ms):\n{ms.round(3).to_string()}")
    print(f"gpu_check: max |phases - step| {float((parts - df['step_s']).abs().max()) * 1e6:.1f} us")
    busy_err = (df["busy_s"] - (df["step_s"] - df["comm_wait_s"] - df["eval_s"])).abs().max()
    print(f"gpu_check: host loop time instrumented/plain {ratio:.3f} (medians of interleaved blocks)")
    if set(df["timing"]) != {"cuda"}:
        failures.append("timing is not cuda")
    if not ms["forward_s"].between(SPIN_MS * 0.9, SPIN_MS * 1.5).all():
        failures.append("forward_s is not the GPU time")
    if float((parts - df["step_s"]).abs().max()) > 1e-6 or busy_err > 1e-9:
        failures.append("phases do not add up, or busy is not step - communication")
    if not (df.groupby("rank")["collective_wait_s"].min() > 0).all():
        failures.append("the buffer broadcast and the loss all-reduce were not seen as communication")
    if ratio > 1.10:
        failures.append(f"host loop slowed by {ratio:.3f}x: a sync in the hot path?")
    if world > 1:
        late, others = ms.loc[world - 1], ms.drop(index=world - 1)
        print(f"gpu_check: late rank {world - 1}: busy {late['busy_s']:.2f} ms vs others' max "
              f"{others['busy_s'].max():.2f}; others' collective wait min {others['collective_wait_s'].min():.2f} ms "
              f"(GPU late by {LATE_MS} ms)")  # fmt: skip
        if others["collective_wait_s"].min() < 0.7 * LATE_MS:
            failures.append("the peers' wait on the stream for the late rank is not communication")
        if late["busy_s"] - others["busy_s"].max() < 0.7 * LATE_MS:
            failures.append("the late rank's busy time does not stand out")
        flagged = [(s["rank"], s["cause"]) for s in analyze_run(run_dir).report["stragglers"]]
        print(f"gpu_check: analyze flags {flagged}")
        if flagged != [(world - 1, "other")]:
            failures.append(f"analyze flagged {flagged}, not rank {world - 1} (other)")
    print("gpu_check: " + ("OK" if not failures else "FAILED: " + "; ".join(failures)))
    return failures


    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
