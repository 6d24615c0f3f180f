"""Check stragglerwatch's CUDA timing path on a real GPU (not a pytest test; needs CUDA and NCCL).

    python benchmarks/gpu_check.py                        # every claim, about 3 to 5 minutes on one H200
    python benchmarks/gpu_check.py --only graph_capture,bounded_close --out /tmp/gpu-check
    python benchmarks/gpu_check.py --only host_cost_fsdp2 --profile --out /tmp/gpu-check  # where host time goes

The script checks one claim at a time. Each claim runs its own sub-jobs (``torch.multiprocessing``
spawn, a free port on 127.0.0.1, NCCL at world size 1 or several ranks on the GPUs there are,
every join bounded by a timeout), which send their results back as JSON files in a temporary
directory; the judging is done here, from those files and the run dirs. Each claim prints one line
``PASS <claim>: <figures>`` or ``FAIL <claim>: <figures> -- FAILED: <why>`` (a crash of a claim
is a FAIL with its exception line; the other claims still run), then ``gpu_check: N passed, M
failed``; the exit status is 1 if any claim failed. Without CUDA it checks nothing and exits 0.
GPU time is made with ``torch.cuda._sleep(cycles)`` (a spin kernel), calibrated against CUDA
events in every sub-job (one rank at a time where ranks share a GPU). Every figure that a claim
needs to know is either such a spin or measured here without stragglerwatch; every claim has a
control or a bound that a wrong implementation misses. Ranks of one job share GPU 0 over gloo
(with CUDA tensors) when there is one GPU, and use one GPU each over NCCL when there are more.

Claims, and how each fails when the implementation is wrong:

``sync_vs_async``: every collective of the loop is counted, synchronous or not.
  (a) NCCL, world size 1, a DDP model without buffers (``broadcast_buffers=False``): the same
  loop three times, with no collective of its own, with a synchronous
  ``dist.all_reduce(t, op=AVG)`` of 1 GiB (on NCCL since torch 2.8 it returns no ``Work``) and
  with the asynchronous ``all_reduce(..., async_op=True).wait()``. AVG makes NCCL run a kernel
  even at one rank (an in-place SUM is a no-op there), whose GPU time this script measures first
  with its own events. ``collective_wait_s`` must be 0 without the collective and that GPU time
  (25 % + 30 us) with either. A tap in ``Work.wait`` alone misses the synchronous one (0); host
  timestamps see only the launch (microseconds); counting DDP's own all-reduce as a collective
  breaks the control. (b) Several ranks, the last one's GPU spinning ``LATE_MS`` after backward,
  before the loop's synchronous loss all-reduce: the peers' ``collective_wait_s`` must hold that
  wait (>= 70 %), the late rank's must not (<= 30 %: it waits for nobody), and without the spin
  nobody's does. Over gloo both hosts block in the call, so host timing fails the late rank's bound;
  over NCCL no host blocks at all, so host timing fails the peers'.
``exposed_wait_known``: an exposed wait of known length shows within 10 %. NCCL, world size 1:
  a side stream waits for the compute stream, spins ``SPIN_MS`` and issues an async all-reduce
  that the compute stream waits for (``Work.wait``): ``collective_wait_s`` = the spin. A DDP comm
  hook (``attach(comm_hook=...)``) spins ``SPIN_MS`` on the stream before its all-reduce:
  ``allreduce_wait_s`` = the spin. Each with a control without the spin (< 10 % of it). Host timing
  sees microseconds (the host never blocks on NCCL); putting the hook's wait in backward, or
  counting the hook's all-reduce as another collective, misses it in ``allreduce_wait_s``.
``no_sync_in_hot_path``: (a) the instrumented DDP loop (with a loss all-reduce) runs under
  ``torch.cuda.set_sync_debug_mode("error")``, also while the log thread resolves its steps: no
  error, no new failure counted in ``stats()["problems"]`` (our hooks swallow their own errors),
  no warning logged, the steps recorded; the plain loop is run under the same mode first, as the
  control that the loop itself does not sync. (b) A GPU-bound loop (``GPU_BOUND_MS`` of spin a
  step, no host sync): instrumented host time a step must stay below 0.2 of the GPU time a step
  and within 10 % + 200 us of the plain loop's (interleaved blocks; a separate model and
  optimizer; the watch closed during plain blocks, so nothing of ours is alive in them).
  Event-synchronising code escapes the debug mode but not (b): its host time becomes the GPU's.
``phase_accuracy``: ``forward_s``, ``backward_s`` and ``optimizer_s`` (medians) match the GPU
  time that ``torch.profiler`` attributes to ``record_function`` ranges around forward, backward
  and ``optimizer.step()`` (kernels launched inside each range, matched by correlation id, summed)
  within 10 % or 0.3 ms. Each phase spins a different known time (4, 6, 2 ms) so that a phase
  taking its neighbour's interval fails, and host timing (launch times) fails all three.
``straggler_and_stall``: several ranks, DDP. The last rank's GPU spins ``LATE_MS`` in forward
  from step 10: ``analyze`` must flag that rank alone, with cause ``compute``. Then the last rank
  sleeps ``STALL_S`` on the host before a step (``watchdog_timeout_s=WATCHDOG_S``): a ``diagnosis``
  event must name it (and only it) as culprit. Comparing step times finds nothing; comparing
  backward times blames the peers.
``graph_capture``: steps whose events are still pending (a GPU spin at the last step; the log
  thread polls every 0.25 s), then ``torch.cuda.graph`` (capture mode "global") captures a forward
  of the watched model and holds the capture open 1 s: the capture must succeed (an event query
  from our threads during it invalidates it), replays must match eager, ``capture_dropped_marks``
  must be >= 1 (our forward marks inside the capture are dropped), the pending steps and the
  steps after must be written, ``unresolved_steps`` 0 (an event recorded in a capture never
  completes outside it: a log that kept it would stall).
``bounded_close``: a 30 s GPU spin right after a step, a few more steps, ``close()``
  (``close_timeout_s=2``): it returns within ``close_timeout_s + 3`` s, the steps before the spin
  are written, and the later ones are reported (``unresolved_steps >= 1``) or missing. Also the
  steps after the spin must cost the host well under a second (no wait for the GPU in them).
``fsdp2``: FSDP2 (``fully_shard``, world size 1) with and without ``CPUOffloadPolicy``: timing
  ``cuda`` in both (with offload the parameters live on the CPU: choosing by the first parameter
  picks host timing), ``forward_s`` = the forward spin (``FSDP_SPIN_MS``, 90 % to +3 ms),
  backward and optimizer positive.
``host_cost_fsdp2``: host time a step of a 32-layer FSDP2 model (world size 1), instrumented
  against plain (interleaved blocks; the watch closed during plain blocks): PASS if the added
  time (of the medians) is < 5 % of the plain step or < 300 us. A per-collective synchronisation
  or heavy per-collective host work fails it.
``hang_policy_nccl``: the hang policy on NCCL (world size 1, ``on_hang="abort"``, a 2 s watchdog, a
  6 s bound): after a few steps, with an all-reduce and more kernels queued behind a GPU spin, the
  rank stops making progress in a Python sleep. It must end with status 75 within the bound, **without
  running the application's SIGTERM handler** (a checkpoint from a state queued kernels may corrupt),
  having called ``hang_handler`` told ``backend: nccl`` and ``state_suspect: True``, its ``action``
  event saying the same. Sending SIGTERM or aborting the groups first (the gloo path) runs the handler.
``gpu_context`` (only with NVML bindings, ``stragglerwatch[gpu]``; else SKIP): the context samples
  name the rank's own GPU (torch's UUID) and hold its SM clock, clock event reasons and temperature.

Sub-jobs drop ``STRAGGLERWATCH_*`` environment variables so that settings of the caller's shell
do not change the checks. ``--out DIR`` keeps the run dirs and sub-job logs under ``DIR/runs-*``
(one per run) and writes every figure to ``DIR/figures.json`` and ``DIR/figures.csv``. The whole
check stops starting sub-jobs after ``--budget`` seconds (default 480).
"""

from __future__ import annotations

import argparse
import csv
import functools
import itertools
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch

WARM = 3  # steps left out of every median (DDP rebuilds its buckets at the second step)
SPIN_MS = 10.0  # the known exposed waits of exposed_wait_known
LATE_MS = 15.0  # how late the last rank's GPU is in sync_vs_async (b) and straggler_and_stall
GPU_BOUND_MS = 10.0  # GPU time a step of no_sync_in_hot_path's GPU-bound loop
PHASE_SPIN_MS = {"forward": 4.0, "backward": 6.0, "optimizer": 2.0}  # phase_accuracy
FSDP_SPIN_MS = 5.0  # forward spin of the fsdp2 models
PENDING_MS = 1000.0  # graph_capture: the GPU is this far behind when the capture starts
HOLD_S = 1.0  # graph_capture: how long the capture stays open (the log thread polls every 0.25 s)
BLOCK_S = 30.0  # bounded_close: the GPU spin that close() must not wait for
CLOSE_TIMEOUT_S = 2.0  # bounded_close's close_timeout_s
STALL_S = 7.0  # straggler_and_stall: the culprit's host sleep
WATCHDOG_S = 2.0  # straggler_and_stall: watchdog_timeout_s of the stall run
BIG_ELEMS = 256 * 1024 * 1024  # 1 GiB of float32: the loop collective of sync_vs_async (a)
NO_CUDA_MESSAGE = "gpu_check: no CUDA device; nothing checked"
DEVICE = "cuda"  # where the sub-jobs' tensors live (the current device of each rank)
PROFILE_ENV = "GPU_CHECK_PROFILE"  # set by --profile: the host-cost claims profile an instrumented block


# ---------------------------------------------------------------------------------------------
# Sub-job side: runs in spawned processes
# ---------------------------------------------------------------------------------------------


@dataclass
class Ctx:
    """What a worker knows about its sub-job."""

    rank: int
    world: int
    device: int
    dir: Path
    params: dict[str, Any]
    quick: bool
    shared_gpu: bool
    cycles_per_ms: float = 0.0

    def cycles(self, ms: float) -> int:
        return int(ms * self.cycles_per_ms)

    def run_dir(self, name: str) -> str:
        """A run dir of this sub-job, the same path for all its ranks."""
        return str(self.dir / name)

    def steps(self, n: int, minimum: int = 12) -> int:
        return max(minimum, n // 2) if self.quick else n


def _entry(index: int, spec: dict[str, Any]) -> None:
    """Body of every spawned process: set up the rank, run its worker, write its JSON result."""
    rank, world = index, spec["world"]
    out = Path(spec["dir"])
    log = open(out / f"log-{rank}.txt", "w", buffering=1)  # noqa: SIM115  # the process's stdout/stderr
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    sys.stdout = sys.stderr = log
    for key in [k for k in os.environ if k.startswith("STRAGGLERWATCH_")]:
        del os.environ[key]
    device = rank if spec["own_gpus"] else 0
    result: dict[str, Any] = {}
    error: BaseException | None = None
    try:
        torch.cuda.set_device(device)
        backend = spec["backend"]
        if backend:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["port"]), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))  # fmt: skip
            extra = {"device_id": torch.device("cuda", device)} if backend == "nccl" else {}
            dist.init_process_group(backend, timeout=timedelta(seconds=120), **extra)
        ctx = Ctx(rank, world, device, out, spec["params"], spec["quick"], not spec["own_gpus"] and world > 1)
        ctx.cycles_per_ms = _calibrate_in_turn(ctx)
        result = WORKERS[spec["worker"]](ctx) or {}
        result["cycles_per_ms"] = ctx.cycles_per_ms
    except BaseException as exc:
        error = exc
        line = f"{type(exc).__name__}: {exc}".strip().splitlines()
        result = {"error": line[0] if line else type(exc).__name__, "traceback": traceback.format_exc()}
    tmp = out / f"result-{rank}.json.tmp"
    tmp.write_text(json.dumps(result, default=str))
    tmp.replace(out / f"result-{rank}.json")
    if dist.is_available() and dist.is_initialized() and (error is None or world == 1):
        dist.destroy_process_group()
    log.flush()
    if error is not None:
        raise error
    if spec["hard_exit"]:  # the GPU is still spinning: leave without waiting for it
        os._exit(0)


def _calibrate() -> float:
    """Spin-kernel cycles per millisecond of GPU time, measured with events (median of 3)."""
    torch.cuda._sleep(2_000_000)
    torch.cuda.synchronize()
    rates = []
    for _ in range(3):
        start, end = _event(), _event()
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        rates.append(20_000_000 / start.elapsed_time(end))
    return statistics.median(rates)


def _calibrate_in_turn(ctx: Ctx) -> float:
    """Ranks that share a GPU calibrate one at a time (two spins at once share the GPU)."""
    if not ctx.shared_gpu:
        return _calibrate()
    rate = 0.0
    for turn in range(ctx.world):
        if turn == ctx.rank:
            rate = _calibrate()
        dist.barrier()
    return rate


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def gpu_ms(fn: Callable[[], Any], reps: int = 5) -> float:
    """Median GPU time of ``fn`` on the current stream, bracketed by our own events (no watch)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = _event(), _event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def mlp(width: int = 256) -> nn.Module:
    """No buffers (nothing for DDP to broadcast), < 1 MiB of parameters (one gradient bucket)."""
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


class SpinNet(nn.Module):
    """An MLP whose forward first spins the GPU ``self.spin`` cycles (the host returns at once)."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.net = mlp(width)
        self.spin = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spin:
            torch.cuda._sleep(self.spin)
        return self.net(x)


def ddp(module: nn.Module, ctx: Ctx) -> DDP:
    ids = [ctx.device] if DEVICE == "cuda" else None
    return DDP(module.to(DEVICE), device_ids=ids, broadcast_buffers=False)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor,
               between: Callable[[], Any] | None = None) -> torch.Tensor:  # fmt: skip
    """Forward, backward, ``between()`` (the loop's own work before the optimizer), step."""
    loss = model(x).pow(2).mean()
    loss.backward()
    if between is not None:
        between()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def profile_block(ctx: Ctx, name: str, block: Callable[[], Any]) -> None:
    """With ``--profile``: one more run of ``block`` under cProfile, its 40 costliest functions (own time) and
    the 40 of ours by time inside them written to ``profile-<name>.txt`` in the sub-job's dir (and its path
    into the log): where an instrumented step's host time goes, when a host-cost claim fails."""
    if not os.environ.get(PROFILE_ENV):
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.runcall(block)
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats("stragglerwatch", 40)
    path = ctx.dir / f"profile-{name}.txt"
    path.write_text(text.getvalue())
    print(f"profile: {path}", flush=True)


def _attach(model: nn.Module, run_dir: str, opt: torch.optim.Optimizer, **kw: Any) -> Any:
    kw.setdefault("context_interval_s", 0)
    return stragglerwatch.attach(model, run_dir, optimizer=opt, **kw)


def _stats(watch: Any) -> dict[str, Any]:
    return json.loads(json.dumps(watch.stats(), default=str))


def w_sync_async(ctx: Ctx) -> dict[str, Any]:
    """sync_vs_async (a): no loop collective / a sync one / an async one, NCCL world size 1."""
    payload = torch.ones(BIG_ELEMS, device=DEVICE)
    avg = dist.ReduceOp.AVG

    def sync() -> None:
        dist.all_reduce(payload, op=avg)

    def async_() -> None:
        dist.all_reduce(payload, op=avg, async_op=True).wait()

    out: dict[str, Any] = {"ref_ms": {"sync": gpu_ms(sync), "async": gpu_ms(async_)}}
    x = torch.randn(64, 256, device=DEVICE)
    for variant, between in (("none", None), ("sync", sync), ("async", async_)):
        torch.manual_seed(0)
        model = ddp(mlp(), ctx)
        opt = sgd(model)
        run_dir = ctx.run_dir(f"loop-{variant}")
        watch = _attach(model, run_dir, opt)
        for _ in range(WARM + ctx.steps(20)):
            train_step(model, opt, x, between)
        torch.cuda.synchronize()
        watch.close()
        out[variant] = run_dir
    return out


def w_late_collective(ctx: Ctx) -> dict[str, Any]:
    """sync_vs_async (b): the last rank's GPU late for the loop's synchronous loss all-reduce."""
    late = ctx.cycles(LATE_MS) if ctx.rank == ctx.world - 1 else 0
    x = torch.randn(64, 256, device=DEVICE)
    out: dict[str, Any] = {}
    for variant in ("late", "control"):
        torch.manual_seed(0)
        model = ddp(mlp(), ctx)
        opt = sgd(model)
        run_dir = ctx.run_dir(f"loss-allreduce-{variant}")
        watch = _attach(model, run_dir, opt)
        spin = late if variant == "late" else 0
        for _ in range(WARM + ctx.steps(30)):
            loss = model(x).pow(2).mean()
            loss.backward()
            if spin:
                torch.cuda._sleep(spin)  # this rank's GPU is late for the all-reduce below
            logged = loss.detach().clone()
            dist.all_reduce(logged)  # synchronous: on NCCL no Work comes back
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        watch.close()
        dist.barrier()
        out[variant] = run_dir
    return out


def spin_allreduce_hook(cycles: int, bucket: Any) -> torch.futures.Future:
    """A DDP comm hook: spin the GPU ``cycles`` on the current stream, then the default all-reduce."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    if cycles:
        torch.cuda._sleep(cycles)
    return default_hooks.allreduce_hook(None, bucket)


def w_exposed_wait(ctx: Ctx) -> dict[str, Any]:
    """exposed_wait_known: a side-stream spin before an async collective; a spinning comm hook."""
    x = torch.randn(64, 256, device=DEVICE)
    flag = torch.ones(1, device=DEVICE)
    side = torch.cuda.Stream()
    out: dict[str, Any] = {}
    for variant, ms in (("side", SPIN_MS), ("side-control", 0.0)):
        torch.manual_seed(0)
        model = ddp(mlp(), ctx)
        opt = sgd(model)
        run_dir = ctx.run_dir(variant)
        watch = _attach(model, run_dir, opt)
        cycles = ctx.cycles(ms)
        for _ in range(WARM + ctx.steps(20)):
            loss = model(x).pow(2).mean()
            side.wait_stream(torch.cuda.current_stream())  # the spin starts where the compute stream is
            with torch.cuda.stream(side):
                if cycles:
                    torch.cuda._sleep(cycles)
                work = dist.all_reduce(flag, async_op=True)  # NCCL's stream waits for the spin
            work.wait()  # the compute stream waits for the all-reduce: an exposed wait of the spin
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        watch.close()
        out[variant] = run_dir
    for variant, ms in (("hook", SPIN_MS), ("hook-control", 0.0)):
        torch.manual_seed(0)
        model = ddp(mlp(), ctx)  # a fresh model: a comm hook cannot be removed
        opt = sgd(model)
        run_dir = ctx.run_dir(variant)
        watch = _attach(model, run_dir, opt, comm_hook=(ctx.cycles(ms), spin_allreduce_hook))
        for _ in range(WARM + ctx.steps(20)):
            train_step(model, opt, x)
        torch.cuda.synchronize()
        watch.close()
        out[variant] = run_dir
    return out


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().splitlines()[0] if record.getMessage() else record.levelname)


def _under_sync_debug(fn: Callable[[], Any]) -> str | None:
    """Run ``fn`` with every CUDA synchronisation an error; the error's first line, or None."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as exc:
        return (str(exc).strip().splitlines() or ["RuntimeError"])[0]
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _timed_block(step: Callable[[], Any], steps: int) -> tuple[float, float]:
    """(host seconds, GPU seconds) a step over ``steps`` steps without a host sync between them."""
    torch.cuda.synchronize()
    start, end = _event(), _event()
    start.record()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return host / steps, start.elapsed_time(end) / 1e3 / steps


def w_no_sync(ctx: Ctx) -> dict[str, Any]:
    """no_sync_in_hot_path: sync debug mode over plain then instrumented steps; GPU-bound blocks."""
    x = torch.randn(64, 256, device=DEVICE)
    payload = torch.ones(1024, device=DEVICE)

    def loss_allreduce() -> None:
        dist.all_reduce(payload)

    torch.manual_seed(0)
    plain, inst = ddp(mlp(), ctx), ddp(mlp(), ctx)
    plain_opt, inst_opt = sgd(plain), sgd(inst)
    for _ in range(WARM):
        train_step(plain, plain_opt, x, loss_allreduce)
        train_step(inst, inst_opt, x, loss_allreduce)
    torch.cuda.synchronize()
    out: dict[str, Any] = {}
    window_steps = 10

    def plain_window() -> None:
        for _ in range(window_steps):
            train_step(plain, plain_opt, x, loss_allreduce)
        time.sleep(0.8)  # torch's own threads (NCCL's watchdog) run under the debug mode as long

    out["plain_error"] = _under_sync_debug(plain_window)
    run_dir = ctx.run_dir("sync-debug")
    watch = _attach(inst, run_dir, inst_opt, flush_interval_s=0.25)
    for _ in range(WARM):
        train_step(inst, inst_opt, x, loss_allreduce)
    torch.cuda.synchronize()
    time.sleep(0.6)  # the warm steps written before the window
    before = dict(watch.stats()["problems"])
    written_before = watch.stats()["steps_written"]
    handler = _Records()
    logging.getLogger("stragglerwatch").addHandler(handler)

    def window() -> None:
        for _ in range(window_steps):
            train_step(inst, inst_opt, x, loss_allreduce)
        time.sleep(0.8)  # the log thread resolves and writes these steps under the debug mode too

    out["inst_error"] = _under_sync_debug(window)
    logging.getLogger("stragglerwatch").removeHandler(handler)
    torch.cuda.synchronize()
    after = dict(watch.stats()["problems"])
    out["window_written"] = watch.stats()["steps_written"] - written_before
    out["window_steps"] = window_steps
    watch.close()
    out["new_problems"] = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    out["log_records"] = handler.lines
    out["sync_debug_run"] = run_dir

    # (b) GPU-bound: interleaved plain/instrumented blocks, the watch closed in plain ones
    torch.manual_seed(0)
    gplain, ginst = SpinNet(), SpinNet()
    gplain.spin = ginst.spin = ctx.cycles(GPU_BOUND_MS)
    gplain, ginst = ddp(gplain, ctx), ddp(ginst, ctx)
    gplain_opt, ginst_opt = sgd(gplain), sgd(ginst)
    for _ in range(WARM):
        train_step(gplain, gplain_opt, x)
        train_step(ginst, ginst_opt, x)
    blocks: dict[str, list[list[float]]] = {"plain": [], "inst": []}
    steps = ctx.steps(10, minimum=8)
    for pair in range(4):
        for kind in ("plain", "inst") if pair % 2 == 0 else ("inst", "plain"):
            if kind == "plain":
                for _ in range(2):
                    train_step(gplain, gplain_opt, x)
                blocks[kind].append(list(_timed_block(lambda: train_step(gplain, gplain_opt, x), steps)))
            else:
                w = _attach(ginst, ctx.run_dir(f"gpu-bound-{pair}"), ginst_opt)
                for _ in range(2):
                    train_step(ginst, ginst_opt, x)
                blocks[kind].append(list(_timed_block(lambda: train_step(ginst, ginst_opt, x), steps)))
                w.close()
    out["blocks"] = blocks  # [host s/step, GPU s/step] per block
    w = _attach(ginst, ctx.run_dir("gpu-bound-profile"), ginst_opt)
    profile_block(ctx, "no_sync_gpu_bound", lambda: [train_step(ginst, ginst_opt, x) for _ in range(4 * steps)])
    w.close()
    return out


class SpinFn(torch.autograd.Function):
    """Identity that spins the GPU a known time in forward and another in backward."""

    @staticmethod
    def forward(fctx: Any, x: torch.Tensor, fwd_cycles: int, bwd_cycles: int) -> torch.Tensor:
        fctx.bwd_cycles = bwd_cycles
        if fwd_cycles:
            torch.cuda._sleep(fwd_cycles)
        return x.clone()

    @staticmethod
    def backward(fctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if fctx.bwd_cycles:
            torch.cuda._sleep(fctx.bwd_cycles)
        return grad, None, None


class PhaseNet(nn.Module):
    def __init__(self, fwd_cycles: int, bwd_cycles: int, width: int = 512):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(width, width), nn.Linear(width, width)
        self.cycles = (fwd_cycles, bwd_cycles)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(SpinFn.apply(self.lin1(x), *self.cycles)))


class SpinSGD(torch.optim.Optimizer):
    """Plain SGD whose step first spins the GPU (its own step: no nested optimizer hooks)."""

    def __init__(self, params: Any, cycles: int, lr: float = 1e-3):
        super().__init__(params, {"lr": lr})
        self.cycles = cycles

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        torch.cuda._sleep(self.cycles)
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if params:
                torch._foreach_add_(params, [p.grad for p in params], alpha=-group["lr"])


def w_phase_profile(ctx: Ctx) -> dict[str, Any]:
    """phase_accuracy: a profiled run with the watch attached and record_function ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    model = PhaseNet(ctx.cycles(PHASE_SPIN_MS["forward"]), ctx.cycles(PHASE_SPIN_MS["backward"])).to(DEVICE)
    opt = SpinSGD(model.parameters(), ctx.cycles(PHASE_SPIN_MS["optimizer"]))
    x = torch.randn(64, 512, device=DEVICE)
    run_dir = ctx.run_dir("profiled")
    watch = _attach(model, run_dir, opt)
    warm = 5
    for _ in range(warm):
        train_step(model, opt, x)
    steps = ctx.steps(15, minimum=10)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            with record_function("sw_fwd"):
                out = model(x)
            loss = out.pow(2).mean()
            with record_function("sw_bwd"):
                loss.backward()
            with record_function("sw_opt"):
                opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    trace = ctx.dir / "trace.json"
    prof.export_chrome_trace(str(trace))
    watch.close()
    return {"run_dir": run_dir, "trace": str(trace), "first_step": warm, "steps": steps}


class LateNet(SpinNet):
    """SpinNet whose spin is set per step by the loop (the late rank's forward)."""


def w_straggler(ctx: Ctx) -> dict[str, Any]:
    """straggler_and_stall: a compute straggler from step 10, then a host stall of the last rank."""
    late_rank = ctx.world - 1
    x = torch.randn(64, 256, device=DEVICE)
    torch.manual_seed(0)
    inner = LateNet()
    model = ddp(inner, ctx)
    opt = sgd(model)
    slow_dir = ctx.run_dir("straggler")
    watch = _attach(model, slow_dir, opt)
    onset, steps = 10, ctx.steps(60, minimum=45)
    for step in range(steps):
        inner.spin = ctx.cycles(LATE_MS) if ctx.rank == late_rank and step >= onset else 0
        train_step(model, opt, x)
    torch.cuda.synchronize()
    watch.close()
    dist.barrier()

    torch.manual_seed(0)
    model = ddp(mlp(), ctx)
    opt = sgd(model)
    stall_dir = ctx.run_dir("stall")
    watch = _attach(model, stall_dir, opt, watchdog_timeout_s=WATCHDOG_S)
    stall_step = 8
    for step in range(16):
        if step == stall_step and ctx.rank == late_rank:
            time.sleep(STALL_S)  # the culprit: stuck on its host before the step's collectives
        train_step(model, opt, x).detach().item()  # a logging loop: the peers block here or in the all-reduce
    torch.cuda.synchronize()
    watch.close()
    dist.barrier()
    return {"straggler": slow_dir, "stall": stall_dir, "late_rank": late_rank, "onset": onset,
            "stall_step": stall_step}  # fmt: skip


def w_graph_capture(ctx: Ctx) -> dict[str, Any]:
    """graph_capture: capture (mode "global") a forward of the watched model while steps are pending."""
    torch.manual_seed(0)
    model = SpinNet().to(DEVICE)
    opt = sgd(model)
    x, static_x = torch.randn(64, 256, device=DEVICE), torch.randn(64, 256, device=DEVICE)
    run_dir = ctx.run_dir("capture")
    watch = _attach(model, run_dir, opt, flush_interval_s=0.25)
    side = torch.cuda.Stream()  # warm-up on a side stream before capturing, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        for _ in range(3):
            model(static_x)
    torch.cuda.current_stream().wait_stream(side)
    pre, post = 6, 6
    for i in range(pre):
        model.spin = ctx.cycles(PENDING_MS) if i == pre - 1 else 0  # the last steps' events pending a while
        train_step(model, opt, x)
    model.spin = 0
    time.sleep(0.3)  # the log thread has polled and found those steps unresolved
    g = torch.cuda.CUDAGraph()
    out: dict[str, Any] = {"run_dir": run_dir, "pre": pre, "post": post, "capture_error": None, "replay_ok": None}
    t0 = time.perf_counter()
    static_out = None
    try:
        with torch.no_grad(), torch.cuda.graph(g):
            static_out = model(static_x)
            time.sleep(HOLD_S)  # the capture stays open while the log thread wakes up several times
    except Exception as exc:
        out["capture_error"] = (f"{type(exc).__name__}: {exc}".splitlines() or ["?"])[0]
    out["capture_s"] = time.perf_counter() - t0
    if out["capture_error"] is None and static_out is not None:
        static_x.normal_()
        for _ in range(3):
            g.replay()
        with torch.no_grad():
            eager = model(static_x)
        torch.cuda.synchronize()
        out["replay_ok"] = bool(torch.allclose(static_out, eager, atol=1e-5))
    for _ in range(post):
        train_step(model, opt, x)
    torch.cuda.synchronize()
    watch.close()
    out["stats"] = _stats(watch)
    return out


def w_bounded_close(ctx: Ctx) -> dict[str, Any]:
    """bounded_close: close() with steps queued behind a 30 s GPU spin."""
    torch.manual_seed(0)
    model = SpinNet().to(DEVICE)
    opt = sgd(model)
    x = torch.randn(64, 256, device=DEVICE)
    run_dir = ctx.run_dir("close")
    watch = _attach(model, run_dir, opt, close_timeout_s=CLOSE_TIMEOUT_S)
    before = 8
    for _ in range(before):
        train_step(model, opt, x)
    torch.cuda.synchronize()
    torch.cuda._sleep(ctx.cycles(BLOCK_S * 1e3))  # right after a step: every later event waits 30 s
    t0 = time.perf_counter()
    after = 3
    for _ in range(after):
        train_step(model, opt, x)
    host_after = time.perf_counter() - t0
    t0 = time.perf_counter()
    watch.close()
    close_s = time.perf_counter() - t0
    return {"run_dir": run_dir, "before": before, "after": after, "host_after_s": host_after,
            "close_s": close_s, "stats": _stats(watch)}  # fmt: skip


class FsdpNet(nn.Module):
    """``layers`` Linear+ReLU blocks (each one FSDP2 unit); the forward first spins ``spin`` cycles."""

    def __init__(self, layers: int, width: int, spin: int = 0):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers))
        self.spin = spin

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spin:
            torch.cuda._sleep(self.spin)
        for block in self.blocks:
            x = block(x)
        return x


@functools.cache
def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(DEVICE, (1,))


def _fsdp2(layers: int, width: int, spin: int = 0, offload: bool = False) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    kw: dict[str, Any] = {"mesh": _mesh()}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy()
    torch.manual_seed(0)
    model = FsdpNet(layers, width, spin)
    for block in model.blocks:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    return model, sgd(model)


def w_fsdp2(ctx: Ctx) -> dict[str, Any]:
    """fsdp2: timing and phases of FSDP2 with and without CPU offload, world size 1."""
    out: dict[str, Any] = {}
    x = torch.randn(64, 512, device=DEVICE)
    for variant in ("gpu", "offload"):
        model, opt = _fsdp2(4, 512, ctx.cycles(FSDP_SPIN_MS), offload=variant == "offload")
        out[f"{variant}_param_device"] = str(next(model.parameters()).device)
        run_dir = ctx.run_dir(f"fsdp2-{variant}")
        watch = _attach(model, run_dir, opt)
        for _ in range(WARM + ctx.steps(20)):
            train_step(model, opt, x)
        torch.cuda.synchronize()
        watch.close()
        out[variant] = run_dir
    return out


def w_fsdp2_host_cost(ctx: Ctx) -> dict[str, Any]:
    """host_cost_fsdp2: host time a step, 32-layer FSDP2, interleaved plain/instrumented blocks."""
    plain, plain_opt = _fsdp2(32, 256)
    inst, inst_opt = _fsdp2(32, 256)
    x = torch.randn(16, 256, device=DEVICE)
    for _ in range(WARM):
        train_step(plain, plain_opt, x)
        train_step(inst, inst_opt, x)
    steps = ctx.steps(15, minimum=10)
    times: dict[str, list[float]] = {"plain": [], "inst": []}

    def block(kind: str) -> None:
        model, opt = (plain, plain_opt) if kind == "plain" else (inst, inst_opt)
        for _ in range(2):
            train_step(model, opt, x)
        torch.cuda.synchronize()
        for _ in range(steps):
            t0 = time.perf_counter()
            train_step(model, opt, x)
            times[kind].append(time.perf_counter() - t0)
        torch.cuda.synchronize()

    for pair in range(6):
        for kind in ("plain", "inst") if pair % 2 == 0 else ("inst", "plain"):
            if kind == "plain":
                block(kind)
            else:
                watch = _attach(inst, ctx.run_dir(f"host-cost-{pair}"), inst_opt)
                block(kind)
                watch.close()
    result = {"times": {k: list(v) for k, v in times.items()}, "steps_per_block": steps}
    watch = _attach(inst, ctx.run_dir("host-cost-profile"), inst_opt)
    profile_block(ctx, "host_cost_fsdp2", lambda: block("inst"))
    watch.close()
    return result


def w_gpu_context(ctx: Ctx) -> dict[str, Any]:
    """gpu_context: a rank's NVML context samples, when the bindings are installed."""
    from stragglerwatch.runtime.context.gpuctx import cuda_uuid, load_nvml

    if load_nvml() is None:
        return {"nvml": False}
    torch.manual_seed(0)
    model = SpinNet().to(DEVICE)
    opt = sgd(model)
    x = torch.randn(64, 256, device=DEVICE)
    run_dir = ctx.run_dir("context")
    watch = _attach(model, run_dir, opt, context_interval_s=1.0)
    end = time.monotonic() + 2.6
    while time.monotonic() < end:
        for _ in range(10):
            train_step(model, opt, x)
        torch.cuda.synchronize()
    watch.close()
    return {"nvml": True, "run_dir": run_dir, "own_uuid": cuda_uuid(ctx.device)}


WORKERS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "sync_async": w_sync_async,
    "late_collective": w_late_collective,
    "exposed_wait": w_exposed_wait,
    "no_sync": w_no_sync,
    "phase_profile": w_phase_profile,
    "straggler": w_straggler,
    "graph_capture": w_graph_capture,
    "bounded_close": w_bounded_close,
    "fsdp2": w_fsdp2,
    "fsdp2_host_cost": w_fsdp2_host_cost,
    "gpu_context": w_gpu_context,
}


# ---------------------------------------------------------------------------------------------
# Driver side: spawns the sub-jobs and judges their figures
# ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SubJobError(RuntimeError):
    pass


class Skip(Exception):
    """A claim that cannot be checked here (not a failure)."""


class Jobs:
    """Runs sub-jobs under ``root``, each bounded in time, within the whole run's time budget."""

    def __init__(self, root: Path, quick: bool, deadline: float):
        self.root = root
        self.quick = quick
        self.deadline = deadline
        self.gpus = torch.cuda.device_count()
        self._count = itertools.count()

    def multi(self) -> tuple[int, str, bool]:
        """(world size, backend, one GPU per rank) of the claims with several ranks."""
        if self.gpus >= 2:
            return min(self.gpus, 8), "nccl", True
        return 2, "gloo", False

    def run(self, worker: str, nprocs: int = 1, backend: str | None = None, own_gpus: bool = False,
            timeout: float = 120.0, hard_exit: bool = False, **params: Any) -> list[dict[str, Any]]:  # fmt: skip
        """Run ``worker`` on ``nprocs`` ranks; their JSON results (raises SubJobError on a failure)."""
        left = self.deadline - time.monotonic()
        if left < 20:
            raise SubJobError(f"not run: the time budget is spent ({left:.0f} s left)")
        timeout = min(timeout, left)
        job = self.root / f"{next(self._count):02d}-{worker}"
        job.mkdir(parents=True)
        spec = {"worker": worker, "world": nprocs, "backend": backend, "port": free_port() if backend else None,
                "own_gpus": own_gpus, "dir": str(job), "params": params, "quick": self.quick,
                "hard_exit": hard_exit}  # fmt: skip
        pctx = mp.start_processes(_entry, args=(spec,), nprocs=nprocs, join=False, start_method="spawn")
        end = time.monotonic() + timeout
        failure = None
        try:
            while not pctx.join(timeout=0.5):
                if time.monotonic() > end:
                    failure = f"sub-job {worker} still running after {timeout:.0f} s: killed"
                    break
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            failure = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        finally:
            _stop(pctx.processes)
        results = []
        for rank in range(nprocs):
            path = job / f"result-{rank}.json"
            results.append(json.loads(path.read_text()) if path.exists() else None)
        errors = [f"rank {r}: {res['error'][:300]}" for r, res in enumerate(results) if res and "error" in res]
        if errors:  # the rank that failed first, before the peers that lost it
            errors.sort(key=lambda e: any(w in e for w in ("Connection closed", "remote worker", "peer")))
            raise SubJobError("; ".join(errors))
        if any(res is None for res in results):
            missing = [r for r, res in enumerate(results) if res is None]
            raise SubJobError(f"{failure or 'sub-job ended'}; no result from rank(s) {missing} (logs in {job})")
        return results  # all ranks wrote theirs: a rank slow to exit afterwards (a spinning GPU) is no failure


def _stop(processes: list[Any]) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    for p in processes:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(5)


@dataclass
class Verdict:
    """A claim's figures (printed and saved) and the reasons it failed (none: PASS)."""

    phrases: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def say(self, phrase: str, **figures: Any) -> None:
        self.phrases.append(phrase)
        self.figures.update(figures)

    def need(self, ok: bool, why: str) -> None:
        if not ok:
            self.failures.append(why)


def steps_of(run_dir: str, first: int = WARM) -> Any:
    """The run's step records from step ``first`` on (a pandas DataFrame)."""
    df = stragglerwatch.load_run(run_dir)
    return df[df["step"] >= first]


def med_ms(df: Any, col: str) -> float:
    return float(df[col].median()) * 1e3 if len(df) else float("nan")


def rank_ms(df: Any, col: str) -> dict[int, float]:
    return {int(r): float(v) * 1e3 for r, v in df.groupby("rank")[col].median().items()}


def near(value: float, expected: float, rel: float, abs_ms: float = 0.0) -> bool:
    return abs(value - expected) <= rel * expected + abs_ms


def check_timing(v: Verdict, df: Any, what: str) -> None:
    kinds = sorted(set(df["timing"]))
    v.need(kinds == ["cuda"], f"{what}: timing {kinds}, not cuda")
    v.need(len(df) > 0, f"{what}: no steps recorded")


def fmt(d: dict[int, float]) -> str:
    return "{" + ", ".join(f"{k}: {val:.2f}" for k, val in sorted(d.items())) + "}"


def c_sync_vs_async(jobs: Jobs) -> Verdict:
    v = Verdict()
    r = jobs.run("sync_async", backend="nccl")[0]
    ref = r["ref_ms"]
    waits = {}
    for variant in ("none", "sync", "async"):
        df = steps_of(r[variant])
        check_timing(v, df, f"loop {variant}")
        waits[variant] = (med_ms(df, "collective_wait_s"), float(df["collective_wait_s"].min()) * 1e3,
                          float(df["collective_wait_s"].max()) * 1e3)  # fmt: skip
    v.say(f"NCCL ws1 collective_wait_s median: none {waits['none'][0]:.3f} ms (max {waits['none'][2]:.3f}), "
          f"sync all_reduce(1 GiB, AVG) {waits['sync'][0]:.3f} ms (its GPU time {ref['sync']:.3f}), "
          f"async {waits['async'][0]:.3f} ms (its GPU time {ref['async']:.3f})",
          ref_ms=ref, collective_wait_ms={k: w[0] for k, w in waits.items()})  # fmt: skip
    v.need(waits["none"][2] < 0.002, f"without a loop collective collective_wait_s reaches {waits['none'][2]:.3f} ms")
    for variant in ("sync", "async"):
        v.need(ref[variant] >= 0.05, f"check invalid: the {variant} reference collective takes only "
                                     f"{ref[variant]:.3f} ms of GPU time")  # fmt: skip
        v.need(waits[variant][1] > 0 and near(waits[variant][0], ref[variant], 0.25, 0.03),
               f"the {variant} collective is not counted as its GPU time ({waits[variant][0]:.3f} ms, "
               f"min {waits[variant][1]:.3f}, vs {ref[variant]:.3f})")  # fmt: skip

    world, backend, own = jobs.multi()
    res = jobs.run("late_collective", nprocs=world, backend=backend, own_gpus=own)[0]
    late_rank = world - 1
    late = rank_ms(steps_of(res["late"]), "collective_wait_s")
    control = rank_ms(steps_of(res["control"]), "collective_wait_s")
    peers = {k: val for k, val in late.items() if k != late_rank}
    v.say(f"{backend} {world} ranks, rank {late_rank}'s GPU {LATE_MS:.0f} ms late for the loss all-reduce: "
          f"collective_wait_s medians {fmt(late)} ms; without the spin {fmt(control)} ms",
          late_collective_wait_ms=late, control_collective_wait_ms=control)  # fmt: skip
    v.need(len(late) == world, f"records of {len(late)} rank(s), not {world}")
    v.need(
        bool(peers) and min(peers.values()) >= 0.7 * LATE_MS,
        f"the peers' wait for the late rank is not counted ({fmt(peers)} ms < {0.7 * LATE_MS:.1f})",
    )
    v.need(late.get(late_rank, 0.0) <= 0.3 * LATE_MS,
           f"the late rank itself shows {late.get(late_rank, float('nan')):.2f} ms of collective wait "
           f"(> {0.3 * LATE_MS:.1f}): its own lateness counted as waiting (host timing?)")  # fmt: skip
    v.need(
        bool(control) and max(control.values()) <= 0.3 * LATE_MS,
        f"without the late spin the ranks still wait {fmt(control)} ms",
    )
    return v


def c_exposed_wait_known(jobs: Jobs) -> Verdict:
    v = Verdict()
    r = jobs.run("exposed_wait", backend="nccl")[0]
    side = steps_of(r["side"])
    side_c = steps_of(r["side-control"])
    hook = steps_of(r["hook"])
    hook_c = steps_of(r["hook-control"])
    for name, df in (("side", side), ("side-control", side_c), ("hook", hook), ("hook-control", hook_c)):
        check_timing(v, df, name)
    cw, cw_c = med_ms(side, "collective_wait_s"), med_ms(side_c, "collective_wait_s")
    aw, aw_c = med_ms(hook, "allreduce_wait_s"), med_ms(hook_c, "allreduce_wait_s")
    v.say(f"side-stream spin {SPIN_MS:.0f} ms before an async all-reduce: collective_wait_s {cw:.2f} ms "
          f"(control {cw_c:.3f}); comm hook spin {SPIN_MS:.0f} ms: allreduce_wait_s {aw:.2f} ms (control "
          f"{aw_c:.3f}; backward_s {med_ms(hook, 'backward_s'):.2f}, collective_wait_s "
          f"{med_ms(hook, 'collective_wait_s'):.2f})",
          collective_wait_ms=cw, collective_wait_control_ms=cw_c, allreduce_wait_ms=aw,
          allreduce_wait_control_ms=aw_c)  # fmt: skip
    v.need(near(cw, SPIN_MS, 0.10), f"collective_wait_s {cw:.2f} ms is not the {SPIN_MS:.0f} ms exposed wait (10 %)")
    v.need(cw_c < 0.1 * SPIN_MS, f"without the spin collective_wait_s is still {cw_c:.2f} ms")
    v.need(near(aw, SPIN_MS, 0.10), f"allreduce_wait_s {aw:.2f} ms is not the hook's {SPIN_MS:.0f} ms wait (10 %)")
    v.need(aw_c < 0.1 * SPIN_MS, f"without the spin allreduce_wait_s is still {aw_c:.2f} ms")
    return v


def c_no_sync_in_hot_path(jobs: Jobs) -> Verdict:
    v = Verdict()
    r = jobs.run("no_sync", backend="nccl")[0]
    blocks = r["blocks"]
    host = {k: statistics.median(b[0] for b in blocks[k]) * 1e6 for k in ("plain", "inst")}
    gpu = statistics.median(b[1] for b in blocks["inst"]) * 1e6
    ratio = host["inst"] / gpu if gpu > 0 else float("inf")
    df = stragglerwatch.load_run(r["sync_debug_run"])
    v.say(f"sync debug mode 'error': plain loop {r['plain_error'] or 'ok'}, instrumented loop "
          f"{r['inst_error'] or 'ok'}, new problems {r['new_problems'] or 'none'}, warnings "
          f"{len(r['log_records'])}, {r['window_written']} of {r['window_steps']} steps written in the window; "
          f"GPU-bound ({GPU_BOUND_MS:.0f} ms a step): host {host['inst']:.0f} us/step instrumented vs "
          f"{host['plain']:.0f} plain, GPU {gpu:.0f} us/step, host/GPU {ratio:.3f}",
          host_us={**host}, gpu_us=gpu, host_gpu_ratio=ratio, plain_error=r["plain_error"],
          inst_error=r["inst_error"], new_problems=r["new_problems"])  # fmt: skip
    v.need(r["plain_error"] is None, f"check invalid: the plain loop itself syncs ({r['plain_error']})")
    v.need(r["inst_error"] is None, f"a synchronisation in the instrumented loop: {r['inst_error']}")
    v.need(not r["new_problems"], f"our hooks or threads failed under the debug mode: {r['new_problems']}")
    v.need(not r["log_records"], f"warnings under the debug mode: {r['log_records'][:3]}")
    v.need(
        r["window_written"] >= r["window_steps"] - 1 and set(df["timing"]) == {"cuda"},
        f"only {r['window_written']} of the {r['window_steps']} steps under the debug mode were written",
    )
    v.need(ratio < 0.2, f"instrumented host time a step is {ratio:.2f} of the GPU's: the host waits for the GPU")
    v.need(
        host["inst"] <= 1.10 * host["plain"] + 200,
        f"instrumented host time {host['inst']:.0f} us/step > 110 % of plain {host['plain']:.0f} + 200 us",
    )
    return v


def kernel_ms_per_range(trace_path: str, names: tuple[str, ...]) -> dict[str, list[float]]:
    """GPU time (ms) of the kernels, copies and memsets launched inside each instance of each
    ``record_function`` range (any thread), from the profiler's chrome trace."""
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    launched: dict[Any, float] = {}
    device: list[tuple[Any, float]] = []
    ranges: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for e in events:
        if e.get("ph") != "X":
            continue
        cat, args = e.get("cat", ""), e.get("args") or {}
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launched[args["correlation"]] = float(e["ts"])
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in args:
            device.append((args["correlation"], float(e.get("dur", 0.0))))
        elif cat == "user_annotation" and e.get("name") in ranges:
            ranges[e["name"]].append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))))
    sums = {n: [0.0] * len(r) for n, r in ranges.items()}
    for corr, dur in device:
        t = launched.get(corr)
        if t is None:
            continue
        for n, spans in ranges.items():
            for i, (a, b) in enumerate(spans):
                if a <= t <= b:
                    sums[n][i] += dur / 1e3
    return sums


def c_phase_accuracy(jobs: Jobs) -> Verdict:
    v = Verdict()
    r = jobs.run("phase_profile")[0]
    df = steps_of(r["run_dir"], first=r["first_step"])
    check_timing(v, df, "profiled run")
    prof = kernel_ms_per_range(r["trace"], ("sw_fwd", "sw_bwd", "sw_opt"))
    parts = []
    for phase, rng in (("forward", "sw_fwd"), ("backward", "sw_bwd"), ("optimizer", "sw_opt")):
        ours = med_ms(df, f"{phase}_s")
        theirs = statistics.median(prof[rng]) if prof[rng] else float("nan")
        parts.append(f"{phase}_s {ours:.3f} ms vs profiler {theirs:.3f} (spin {PHASE_SPIN_MS[phase]:.0f})")
        v.figures[f"{phase}_ms"] = ours
        v.figures[f"{phase}_profiler_ms"] = theirs
        v.need(len(prof[rng]) >= r["steps"] - 1, f"the profiler has {len(prof[rng])} {rng} ranges, not {r['steps']}")
        v.need(
            abs(ours - theirs) <= max(0.10 * theirs, 0.3),
            f"{phase}_s {ours:.3f} ms differs from the profiler's {theirs:.3f} ms by more than 10 % and 0.3 ms",
        )
    v.say("; ".join(parts) + f" (medians of {len(df)} steps)")
    return v


def read_events(run_dir: str) -> list[dict[str, Any]]:
    from stragglerwatch.record.events import read_events as read

    return read(Path(run_dir))[0]


def c_straggler_and_stall(jobs: Jobs) -> Verdict:
    from stragglerwatch.analysis.report import analyze_run

    v = Verdict()
    world, backend, own = jobs.multi()
    r = jobs.run("straggler", nprocs=world, backend=backend, own_gpus=own)[0]
    late_rank = r["late_rank"]
    df = steps_of(r["straggler"], first=r["onset"] + 2)
    fwd, busy = rank_ms(df, "forward_s"), rank_ms(df, "busy_s")
    found = analyze_run(r["straggler"]).report["stragglers"]
    flagged = [(int(s["rank"]), s["cause"]) for s in found]
    details = (
        ", ".join(
            f"rank {s['rank']} {s['cause']} x{float(s['slowdown']):.2f} lost {float(s['lost_seconds']):.2f} s"
            for s in found
        )
        or "nobody"
    )
    v.say(f"{backend} {world} ranks, rank {late_rank}'s GPU {LATE_MS:.0f} ms slower in forward from step "
          f"{r['onset']}: forward_s medians {fmt(fwd)} ms, busy_s {fmt(busy)} ms; analyze flags {details}",
          flagged=flagged, forward_ms=fwd, busy_ms=busy)  # fmt: skip
    v.need(flagged == [(late_rank, "compute")], f"analyze flagged {flagged or 'nobody'}, not [({late_rank}, compute)]")

    events = read_events(r["stall"])
    stalls = sorted({(int(e["rank"]), str(e.get("phase"))) for e in events if e.get("kind") == "stall"})
    named = [sorted(int(x) for x in (e.get("culprit_ranks") or [])) for e in events if e.get("kind") == "diagnosis"]
    hangs = [h.get("culprit_ranks") for h in analyze_run(r["stall"]).report.get("hangs") or []]
    v.say(f"rank {late_rank} asleep {STALL_S:.0f} s on the host (watchdog {WATCHDOG_S:.0f} s): stall events "
          f"(rank, phase) {stalls}, diagnoses' culprits {named}, analyze hangs' culprits {hangs}",
          stalls=stalls, diagnosis_culprits=named, hang_culprits=hangs)  # fmt: skip
    v.need(any(n == [late_rank] for n in named), f"no diagnosis names rank {late_rank} (alone) as culprit")
    v.need(all(set(n) <= {late_rank} for n in named), f"a diagnosis blames another rank: {named}")
    return v


def c_graph_capture(jobs: Jobs) -> Verdict:
    v = Verdict()
    r = jobs.run("graph_capture")[0]
    st = r["stats"]
    df = stragglerwatch.load_run(r["run_dir"])
    have = set(int(s) for s in df["step"])
    pre, post = r["pre"], r["post"]
    missing_pre = sorted(set(range(pre)) - have)
    post_written = len([s for s in have if s >= pre])
    v.say(f"capture {'ok' if r['capture_error'] is None else r['capture_error']} ({r['capture_s']:.2f} s, held "
          f"{HOLD_S:.1f} s), replay matches eager: {r['replay_ok']}; capture_dropped_marks "
          f"{st.get('capture_dropped_marks')}, capture_dropped_steps {st.get('capture_dropped_steps')}, "
          f"unresolved_steps {st.get('unresolved_steps')}; steps written {sorted(have)} of {pre} before and "
          f"{post} after the capture", stats=st, capture_error=r["capture_error"])  # fmt: skip
    v.need(r["capture_error"] is None, f"the capture failed: {r['capture_error']}")
    v.need(r["replay_ok"] is True, "the graph's replay does not match the eager forward")
    v.need("capture_dropped_marks" in st, "stats() has no capture_dropped_marks")
    v.need((st.get("capture_dropped_marks") or 0) >= 1, "no mark dropped, though our forward ran inside the capture")
    v.need(st.get("unresolved_steps") == 0, f"unresolved_steps {st.get('unresolved_steps')}: the log did not resolve")
    v.need(not missing_pre, f"steps pending at the capture were never written: {missing_pre}")
    v.need(post_written >= post - 2, f"only {post_written} steps written after the capture (of {post})")
    v.need(set(df["timing"]) == {"cuda"}, f"timing {sorted(set(df['timing']))}, not cuda")
    return v


HANG_CHILD = r"""
import json, os, signal, sys, time
import torch, torch.distributed as dist
from torch import nn
import stragglerwatch

out = sys.argv[1]
torch.cuda.set_device(0)
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
model = nn.parallel.DistributedDataParallel(nn.Linear(256, 256).cuda())
opt = torch.optim.SGD(model.parameters(), lr=0.01)

def checkpoint(signum, frame):
    open(os.path.join(out, "sigterm-handler-ran"), "w").write("1")
    sys.exit(0)

def told(info):
    open(os.path.join(out, "hang-handler.json"), "w").write(json.dumps(info))

signal.signal(signal.SIGTERM, checkpoint)
watch = stragglerwatch.attach(model, os.path.join(out, "run"), optimizer=opt, on_hang="abort",
                              watchdog_timeout_s=2.0, hang_abort_s=6.0, hang_handler=told)
x = torch.randn(64, 256, device="cuda")
for _ in range(12):
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
torch.cuda._sleep(int(sys.argv[2]))  # the GPU busy: what follows is queued behind it
t = torch.ones(1 << 20, device="cuda")
dist.all_reduce(t)
t.mul_(2)
open(os.path.join(out, "stuck"), "w").write(repr(time.time()))
while True:
    time.sleep(1.0)
"""


def c_hang_policy_nccl(jobs: Jobs) -> Verdict:
    v = Verdict()
    out = jobs.root / "hang-nccl"
    out.mkdir(parents=True)
    env = {k: x for k, x in os.environ.items() if not k.startswith("STRAGGLERWATCH_")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    cycles = int(_calibrate() * 500)  # half a second of GPU time
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", HANG_CHILD, str(out), str(cycles)], env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    took = time.monotonic() - t0
    stuck = float((out / "stuck").read_text()) if (out / "stuck").exists() else None
    told = json.loads((out / "hang-handler.json").read_text()) if (out / "hang-handler.json").exists() else None
    events = [json.loads(line) for f in (out / "run").glob("events-*.jsonl") for line in f.open()]
    actions = [e for e in events if e.get("kind") == "action"]
    ran = (out / "sigterm-handler-ran").exists()
    v.say(f"exit status {proc.returncode} after {took:.1f} s; SIGTERM handler ran: {ran}; hang_handler told "
          f"{told}; action events {[(a.get('backend'), a.get('state_suspect')) for a in actions]}",
          exit_status=proc.returncode, seconds=round(took, 1), sigterm_handler_ran=ran, hang_handler=told)  # fmt: skip
    v.need(stuck is not None, "the job never reached its stall: " + proc.stderr[-300:])
    v.need(proc.returncode == 75, f"exit status {proc.returncode}, not 75")
    v.need(not ran, "the application's SIGTERM handler ran after the decision on NCCL")
    v.need(bool(told) and told.get("backend") == "nccl" and told.get("state_suspect") is True,
           f"hang_handler was told {told}")  # fmt: skip
    v.need(len(actions) == 1 and actions[0].get("state_suspect") is True, f"action events: {actions}")
    return v


def c_bounded_close(jobs: Jobs) -> Verdict:
    v = Verdict()
    r = jobs.run("bounded_close", timeout=60 + BLOCK_S, hard_exit=True)[0]
    st = r["stats"]
    df = stragglerwatch.load_run(r["run_dir"])
    have = set(int(s) for s in df["step"])
    before, after = r["before"], r["after"]
    pending_missing = sorted(set(range(before, before + after)) - have)
    unresolved = st.get("unresolved_steps")
    v.say(f"close() with steps behind a {BLOCK_S:.0f} s GPU spin took {r['close_s']:.2f} s (close_timeout_s "
          f"{CLOSE_TIMEOUT_S:.0f}); unresolved_steps {unresolved}; steps written {sorted(have)}; the {after} steps "
          f"after the spin cost the host {r['host_after_s'] * 1e3:.1f} ms",
          close_s=r["close_s"], unresolved_steps=unresolved, steps_written=sorted(have))  # fmt: skip
    v.need(r["close_s"] <= CLOSE_TIMEOUT_S + 3, f"close() took {r['close_s']:.1f} s > close_timeout_s + 3 s")
    v.need(set(range(before)) <= have, f"steps before the spin were lost: {sorted(set(range(before)) - have)}")
    v.need(
        (unresolved or 0) >= 1 or bool(pending_missing),
        "the steps behind the spin are neither reported unresolved nor missing",
    )
    v.need(r["host_after_s"] < 1.0, f"the steps after the spin took {r['host_after_s']:.1f} s of host time")
    return v


def c_fsdp2(jobs: Jobs) -> Verdict:
    v = Verdict()
    r = jobs.run("fsdp2", backend="nccl")[0]
    for variant in ("gpu", "offload"):
        df = steps_of(r[variant])
        kinds = sorted(set(df["timing"]))
        m = {p: med_ms(df, f"{p}_s") for p in ("forward", "backward", "optimizer", "step")}
        v.say(f"{variant} (parameters on {r[f'{variant}_param_device']}): timing {kinds}, forward_s "
              f"{m['forward']:.2f} ms (spin {FSDP_SPIN_MS:.0f}), backward_s {m['backward']:.3f}, optimizer_s "
              f"{m['optimizer']:.3f}, step_s {m['step']:.2f}, collective_wait_s {med_ms(df, 'collective_wait_s'):.3f}",
              **{f"{variant}_timing": kinds, f"{variant}_ms": m})  # fmt: skip
        v.need(kinds == ["cuda"], f"{variant}: timing {kinds}, not cuda")
        v.need(
            0.9 * FSDP_SPIN_MS <= m["forward"] <= FSDP_SPIN_MS + 3,
            f"{variant}: forward_s {m['forward']:.2f} ms is not the {FSDP_SPIN_MS:.0f} ms forward spin",
        )
        v.need(m["backward"] > 0 and m["optimizer"] > 0 and m["step"] > 0, f"{variant}: a phase is not positive")
    return v


def c_host_cost_fsdp2(jobs: Jobs) -> Verdict:
    v = Verdict()
    r = jobs.run("fsdp2_host_cost", backend="nccl")[0]
    t = r["times"]
    med = {k: statistics.median(t[k]) * 1e6 for k in t}
    mean = {k: statistics.fmean(t[k]) * 1e6 for k in t}
    added, added_mean = med["inst"] - med["plain"], mean["inst"] - mean["plain"]
    v.say(f"32-layer FSDP2, host time a step: plain {med['plain']:.0f} us, instrumented {med['inst']:.0f} us "
          f"(medians; means {mean['plain']:.0f} / {mean['inst']:.0f}): added {added:.0f} us/step "
          f"({added / med['plain'] * 100:.1f} %; mean {added_mean:.0f} us)",
          median_us=med, mean_us=mean, added_us=added, added_mean_us=added_mean)  # fmt: skip
    v.need(
        added < 0.05 * med["plain"] or added < 300,
        f"added {added:.0f} us/step is >= 5 % of the plain step ({med['plain']:.0f} us) and >= 300 us",
    )
    return v


def c_gpu_context(jobs: Jobs) -> Verdict:
    from stragglerwatch.record.context import decode_reasons

    v = Verdict()
    r = jobs.run("gpu_context")[0]
    if not r["nvml"]:
        raise Skip("no NVML bindings (pip install nvidia-ml-py): GPU context not checked")
    ctx = stragglerwatch.load_context(r["run_dir"])
    mine = ctx[ctx["rank"] == 0]
    v.need(not mine.empty, "no context sample of rank 0")
    if mine.empty:
        return v
    last = mine.iloc[-1]
    v.say(f"{len(mine)} samples, {float(mine['sample_s'].median()) * 1e6:.0f} us a sample; GPU {last['gpu_uuid']}, "
          f"SM {float(last['sm_clock_mhz']):.0f}/{float(last['sm_clock_max_mhz']):.0f} MHz, "
          f"{float(last['temperature_c']):.0f} C, reasons {decode_reasons(int(last['clock_reasons']))}",
          samples=len(mine), gpu_uuid=str(last["gpu_uuid"]))  # fmt: skip
    v.need(last["gpu_uuid"] == r["own_uuid"], f"context names GPU {last['gpu_uuid']}, not this rank's {r['own_uuid']}")
    v.need(
        float(last["sm_clock_mhz"]) > 0 and int(last["clock_reasons"]) >= 0 and float(last["temperature_c"]) > 0,
        "the GPU context lacks the SM clock, the clock event reasons or the temperature",
    )
    return v


@dataclass(frozen=True)
class Claim:
    check: Callable[[Jobs], Verdict]
    summary: str


CLAIMS: dict[str, Claim] = {
    "sync_vs_async": Claim(
        c_sync_vs_async, "sync and async collectives are both collective_wait_s (NCCL ws1; several ranks, one late)"
    ),
    "exposed_wait_known": Claim(
        c_exposed_wait_known, "a known exposed wait shows within 10 % in collective_wait_s and allreduce_wait_s"
    ),
    "no_sync_in_hot_path": Claim(
        c_no_sync_in_hot_path, "no CUDA sync under sync debug mode; GPU-bound loop's host time stays plain"
    ),
    "phase_accuracy": Claim(
        c_phase_accuracy, "forward/backward/optimizer times match torch.profiler within 10 % or 0.3 ms"
    ),
    "straggler_and_stall": Claim(
        c_straggler_and_stall, "a GPU-slow rank is flagged (compute); a host stall names its culprit"
    ),
    "graph_capture": Claim(
        c_graph_capture, "a CUDA graph capture with steps pending succeeds; marks dropped, log resolves"
    ),
    "fsdp2": Claim(c_fsdp2, "FSDP2 with and without CPU offload gets CUDA timing and right phases"),
    "host_cost_fsdp2": Claim(c_host_cost_fsdp2, "added host time a step on a 32-layer FSDP2 model < 5 % or < 300 us"),
    "hang_policy_nccl": Claim(
        c_hang_policy_nccl, "on NCCL the hang policy exits 75 without the SIGTERM handler; hang_handler told suspect"
    ),
    "gpu_context": Claim(c_gpu_context, "NVML context samples name the rank's own GPU (SKIP without NVML)"),
    "bounded_close": Claim(c_bounded_close, "close() returns within close_timeout_s + 3 s behind a 30 s GPU spin"),
}  # bounded_close last: its sub-job leaves the GPU spinning until its process is gone


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    listing = "\n".join(f"  {name:<20} {c.summary}" for name, c in CLAIMS.items())
    p = argparse.ArgumentParser(
        prog="gpu_check.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Check stragglerwatch's CUDA timing on this machine's GPUs: one line PASS/FAIL per claim, "
        "then a summary;\nexit status 1 if a claim failed, 0 without CUDA (nothing checked). Each claim runs "
        "its own spawned\nsub-jobs (NCCL at world size 1; several ranks over gloo on one GPU, or over NCCL on "
        "several GPUs).\nThe module docstring says how each claim would fail if the implementation were wrong.",
        epilog=f"claims (in the order they run):\n{listing}\n\nexamples:\n  python benchmarks/gpu_check.py\n"
        "  python benchmarks/gpu_check.py --only sync_vs_async,graph_capture --out /tmp/gpu-check",
    )
    p.add_argument("--only", metavar="CLAIM[,CLAIM]", help="run only these claims (comma-separated)")
    p.add_argument("--out", metavar="DIR", help="write figures.json and figures.csv here, and keep the run dirs "
                   "and sub-job logs under DIR/runs-*")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="about half the steps per run (rougher medians)")
    p.add_argument("--profile", action="store_true", help="the host-cost claims also profile an instrumented "
                   "block (cProfile) and write where its host time goes beside their sub-job's logs")  # fmt: skip
    p.add_argument("--budget", type=float, default=480.0, metavar="S",
                   help="the most seconds the whole check may take (default 480): a claim whose sub-job would "
                        "start later FAILs as not run")  # fmt: skip
    args = p.parse_args(argv)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in CLAIMS]
        if unknown:
            p.error(f"unknown claim(s) {', '.join(unknown)}; known: {', '.join(CLAIMS)}")
        args.claims = [n for n in CLAIMS if n in names]
    else:
        args.claims = list(CLAIMS)
    return args


def write_figures(out: Path, header: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps({**header, "claims": rows}, indent=2, default=str))
    with open(out / "figures.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["claim", "result", "figure", "value"])
        for row in rows:
            for key, value in row["figures"].items():
                w.writerow([row["claim"], row["result"], key, json.dumps(value, default=str)])
            if not row["figures"]:
                w.writerow([row["claim"], row["result"], "", ""])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.profile:
        os.environ[PROFILE_ENV] = "1"  # the spawned sub-jobs inherit it
    if not torch.cuda.is_available():
        print(NO_CUDA_MESSAGE)
        return 0
    logging.basicConfig(level=logging.ERROR)
    started = time.monotonic()
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="runs-" if out else "gpu-check-", dir=out))
    jobs = Jobs(root, args.quick, started + args.budget)
    header = {"device": torch.cuda.get_device_name(0), "gpus": jobs.gpus, "torch": torch.__version__,
              "stragglerwatch": stragglerwatch.__version__, "quick": args.quick, "runs": str(root)}  # fmt: skip
    print(f"gpu_check: {header['device']} x {jobs.gpus}, torch {torch.__version__}, stragglerwatch "
          f"{stragglerwatch.__version__}; {len(args.claims)} claim(s)", flush=True)  # fmt: skip
    rows, passed, failed = [], 0, 0
    try:
        for name in args.claims:
            t0 = time.monotonic()
            try:
                verdict = CLAIMS[name].check(jobs)
                result = "FAIL" if verdict.failures else "PASS"
                line = f"{result} {name}: " + "; ".join(verdict.phrases)
                if verdict.failures:
                    line += " -- FAILED: " + "; ".join(verdict.failures)
            except Skip as exc:
                verdict, result, line = Verdict(), "SKIP", f"SKIP {name}: {exc}"
            except Exception as exc:
                verdict, result = Verdict(), "FAIL"
                line = f"FAIL {name}: {type(exc).__name__}: " + (str(exc).strip().splitlines() or [""])[0]
                verdict.failures.append(line)
            passed += result == "PASS"
            failed += result == "FAIL"
            print(f"{line} [{time.monotonic() - t0:.0f} s]", flush=True)
            rows.append({"claim": name, "result": result, "seconds": round(time.monotonic() - t0, 1),
                         "figures": verdict.figures, "failures": verdict.failures, "line": line})  # fmt: skip
    finally:
        if out:
            write_figures(out, {**header, "seconds": round(time.monotonic() - started, 1)}, rows)
        else:
            shutil.rmtree(root, ignore_errors=True)
    print(f"gpu_check: {passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
