"""Check the CUDA-event timing path on a real GPU (not a pytest test; needs CUDA and NCCL).

    torchrun --nproc_per_node 1 benchmarks/gpu_check.py        # or as many GPUs as there are

Each rank trains a small model whose forward also spins the GPU for a known time
(``torch.cuda._sleep``). With stragglerwatch attached, the recorded ``forward_s`` must be
about that GPU time (host timestamps would only see the kernel launches), ``timing`` must be
``cuda``, the phases must add up to the step, and the host loop must not slow down (no
synchronisation in the hot path). Prints the figures; exits 1 if a check fails.
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


class Spin(nn.Module):
    def __init__(self, cycles: int):
        super().__init__()
        self.lin = nn.Linear(1024, 1024)
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)  # GPU busy for SPIN_MS, host returns at once
        return self.lin(x)


def cycles_per_ms() -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    end.synchronize()
    return 10_000_000 / start.elapsed_time(end)


def loop(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    x = torch.randn(64, 1024, device="cuda")
    host = []
    for _ in range(steps):
        t0 = time.perf_counter()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
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
    rank = dist.get_rank()
    cycles = int(cycles_per_ms() * SPIN_MS)
    run_dir = os.environ.get("STRAGGLERWATCH_RUN_DIR") or tempfile.mkdtemp(prefix="gpu-check-")
    plain = DDP(Spin(cycles).cuda(), device_ids=[local])
    inst = DDP(Spin(cycles).cuda(), device_ids=[local])
    opt_p = torch.optim.SGD(plain.parameters(), lr=0.01)
    opt_i = torch.optim.SGD(inst.parameters(), lr=0.01)
    loop(plain, opt_p, 5)
    watch = stragglerwatch.attach(inst, run_dir, optimizer=opt_i)
    host_plain, host_inst = [], []
    for _ in range(5):  # interleaved blocks
        host_plain += loop(plain, opt_p, 20)
        host_inst += loop(inst, opt_i, 20)
    watch.close()
    dist.barrier()
    failures = []
    if rank == 0:
        df = stragglerwatch.load_run(run_dir)
        df = df[df["step"] >= 2]
        fwd = df["forward_s"].median() * 1e3
        parts = df[["data_wait_s", "forward_s", "backward_s", "allreduce_wait_s", "optimizer_s", "other_s"]].sum(axis=1)
        ratio = statistics.median(host_inst) / statistics.median(host_plain)
        print(f"gpu_check: {torch.cuda.get_device_name()}, {dist.get_world_size()} rank(s), {len(df)} steps")
        print(f"gpu_check: timing column {sorted(set(df['timing']))}")
        print(f"gpu_check: forward_s median {fwd:.2f} ms (GPU spin {SPIN_MS:.1f} ms + the linear layer)")
        med = {c: df[c].median() * 1e3 for c in ("step_s", "busy_s", "allreduce_wait_s")}
        print(f"gpu_check: step_s {med['step_s']:.2f} ms, busy_s {med['busy_s']:.2f} ms, "
              f"allreduce_wait_s {med['allreduce_wait_s']:.3f} ms (medians)")  # fmt: skip
        print(f"gpu_check: max |phases - step| {float((parts - df['step_s']).abs().max()) * 1e6:.1f} us")
        print(f"gpu_check: host loop time instrumented/plain {ratio:.3f} (medians of interleaved blocks)")
        if set(df["timing"]) != {"cuda"}:
            failures.append("timing is not cuda")
        if not SPIN_MS * 0.9 <= fwd <= SPIN_MS * 1.5:
            failures.append(f"forward_s {fwd:.2f} ms is not the GPU time")
        if ratio > 1.10:
            failures.append(f"host loop slowed by {ratio:.3f}x: a sync in the hot path?")
        print("gpu_check: " + ("OK" if not failures else "FAILED: " + "; ".join(failures)))
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
