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
Then an FSDP2 (``fully_shard``) job whose last rank's GPU is late by as much in forward: the
peers' waits for FSDP2's all-gathers and reduce-scatters (on the compute stream) must be
``collective_wait_s`` and the late rank flagged with cause ``compute``.
Where the NVML bindings are installed (``stragglerwatch[gpu]``), every rank's context samples must
name its own GPU (the UUID torch reports for it) and hold its SM clock, clock event reasons and
temperature. Prints the figures; exits 1 if a check fails.
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
    if world > 1:
        failures += fsdp2_check(world, rank, late)
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
    failures += context_check(run_dir)
    print("gpu_check: " + ("OK" if not failures else "FAILED: " + "; ".join(failures)))
    return failures


def context_check(run_dir: str) -> list[str]:
    """Rank 0's GPU context: its own device, with clocks, reasons and temperature."""
    from stragglerwatch.gpuctx import cuda_uuid, decode_reasons, load_nvml

    ctx = stragglerwatch.load_context(run_dir)
    mine = ctx[ctx["rank"] == 0]
    if load_nvml() is None:
        print("gpu_check: no NVML bindings (pip install nvidia-ml-py): GPU context not checked")
        return []
    if mine.empty:
        return ["no context sample of rank 0"]
    last = mine.iloc[-1]
    print(f"gpu_check: context: {len(mine)} samples of rank 0, {mine['sample_s'].median() * 1e6:.0f} us a sample; "
          f"GPU {last['gpu']} {last['gpu_uuid']}, SM {last['sm_clock_mhz']:.0f}/{last['sm_clock_max_mhz']:.0f} MHz, "
          f"{last['temperature_c']:.0f} C, {last['power_w']:.0f}/{last['power_limit_w']:.0f} W, reasons "
          f"{decode_reasons(int(last['clock_reasons']))}, XIDs {last['xid_events']}, "
          f"PCIe replays {last['pcie_replays']}")  # fmt: skip
    failures = []
    own = cuda_uuid(torch.cuda.current_device())
    if last["gpu_uuid"] != own:
        failures.append(f"context names GPU {last['gpu_uuid']}, not this rank's {own}")
    if not (last["sm_clock_mhz"] > 0 and last["clock_reasons"] >= 0 and last["temperature_c"] > 0):
        failures.append("the GPU context lacks the SM clock, the clock event reasons or the temperature")
    return failures


class Layers(nn.Module):
    """Three sharded blocks; the last rank's GPU spins ``late`` cycles in forward (compute straggler)."""

    def __init__(self, late: int):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()) for _ in range(3))
        self.late = late

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.late:
            torch.cuda._sleep(self.late)
        for block in self.blocks:
            x = block(x)
        return x


def fsdp2_check(world: int, rank: int, late: int) -> list[str]:
    """FSDP2 on NCCL: the compute stream's waits for FSDP2's all-gather and reduce-scatter
    streams are communication; the late rank is flagged with cause compute."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from stragglerwatch.analysis import analyze_run

    run_dir = [tempfile.mkdtemp(prefix="gpu-check-fsdp2-") if rank == 0 else None]
    dist.broadcast_object_list(run_dir, src=0)  # one run dir for all ranks (one machine)
    mesh = init_device_mesh("cuda", (world,), mesh_dim_names=("dp",))
    model = Layers(late).cuda()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, run_dir[0])
    x = torch.randn(64, 1024, device="cuda")
    for _ in range(60):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    watch.close()
    dist.barrier()
    if rank != 0:
        return []
    failures = []
    df = stragglerwatch.load_run(run_dir[0])
    df = df[df["step"] >= 5]
    ms = df.groupby("rank")[["step_s", "busy_s", "forward_s", "backward_s", "collective_wait_s"]].median() * 1e3
    print(f"gpu_check: FSDP2, {world} ranks, last rank's GPU late by {LATE_MS} ms a step; medians (ms):\n"
          f"{ms.round(3).to_string()}")  # fmt: skip
    others = ms.drop(index=world - 1)
    if (df["allreduce_wait_s"] != 0).any() or others["collective_wait_s"].min() < 0.7 * LATE_MS:
        failures.append("FSDP2: the peers' waits for the late rank are not communication")
    flagged = [(s["rank"], s["cause"]) for s in analyze_run(run_dir[0]).report["stragglers"]]
    print(f"gpu_check: FSDP2: analyze flags {flagged}")
    if flagged != [(world - 1, "compute")]:
        failures.append(f"FSDP2: analyze flagged {flagged}, not rank {world - 1} (compute)")
    print("gpu_check: FSDP2 " + ("OK" if not failures else "FAILED: " + "; ".join(failures)))
    return failures


if __name__ == "__main__":
    sys.exit(main())
