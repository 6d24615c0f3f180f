"""``attach()``: put the probes on a model and start this rank's event log.

Design: ``attach`` validates first (so a refused model leaves nothing behind),
then writes the run metadata, starts the log thread and registers the hooks.
Everything it registered is remembered in the returned :class:`Watch`, whose
``close()`` removes it again. The one exception is DDP's communication hook,
which PyTorch cannot unregister: after ``close()`` it is a pass-through to the
wrapped hook, at the cost of one attribute check per bucket.

When the model's communication cannot be seen (a wrapper we do not know,
compiled autograd; or found while training: outputs without a gradient, no
communication at all), ``attach`` warns once and the reason goes into the
rank's metadata (``busy_unavailable``), where ``analyze`` and the dashboard
find it and say so instead of "no straggler".
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .eventlog import EventLogWriter, log_path
from .exporter import Exporter, RankCollector, RankMetrics
from .probes import StepProbe, TimedIterable, cuda_mark
from .runinfo import RunInfo, discover, write_meta, write_rank_meta
from .shadows import time_buffer_sync, time_forward
from .taps import tap_collectives, tap_scaler
from .timing import resolve_cuda
from .watchdog import EventFile, PeerBoard, ShutdownHooks, Watchdog

CommHook = tuple[Any, Callable[[Any, Any], torch.futures.Future]]


def _disabled_by_env() -> bool:
    return os.environ.get("STRAGGLERWATCH_DISABLE", "").strip().lower() not in ("", "0", "false", "no")


def _model_device(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


#: Model classes whose communication stragglerwatch does not see yet (by class name: none is imported).
UNSEEN_WRAPPERS = {
    "FullyShardedDataParallel": "FSDP (FullyShardedDataParallel): its all-gathers and reduce-scatters are not timed",
    "FSDPModule": "FSDP2 (fully_shard): its all-gathers and reduce-scatters are not timed",
    "DeepSpeedEngine": "DeepSpeed: its communication is not timed",
    "OptimizedModule": "a torch.compile'd module: the communication inside compiled code is not seen",
}


def unseen_communication(model: torch.nn.Module) -> str | None:
    """Why the model's communication cannot be timed, when that is known at attach time."""
    for cls in type(model).__mro__:
        if cls.__name__ in UNSEEN_WRAPPERS:
            return UNSEEN_WRAPPERS[cls.__name__]
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and getattr(getattr(dynamo, "config", None), "compiled_autograd", False):
        return "compiled autograd is enabled: the gradient all-reduce wait is not seen"
    return None


def _check_comm_hook_free(model: torch.nn.Module) -> None:
    if isinstance(model, DistributedDataParallel) and model._comm_hooks:
        raise RuntimeError(
            "stragglerwatch: bucket_timings needs DDP's communication hook, but this model already has one "
            "and PyTorch allows only one. Call attach() before register_comm_hook() and pass yours as "
            "attach(model, comm_hook=(state, hook)), or leave bucket_timings off (no comm hook needed)."
        )


class Watch:
    """Handle on a watched model: ``wrap`` a loader, ``close`` when done (or use ``with``)."""

    def __init__(
        self,
        info: RunInfo | None = None,
        probe: StepProbe | None = None,
        writer: EventLogWriter | None = None,
        handles: list[Any] | None = None,
        watchdog: Watchdog | None = None,
        wall_anchor: float = 0.0,
        exporter: Exporter | None = None,
        unavailable: Callable[[], list[str]] | None = None,
    ):
        self._exporter = exporter
        self._unavailable = unavailable
        self.info = info
        self._probe = probe
        self._writer = writer
        self._handles = handles or []
        self._watchdog = watchdog
        self._shutdown = ShutdownHooks(watchdog) if watchdog is not None else None
        self._wall_anchor = wall_anchor
        self._closed = probe is None
        if watchdog is not None:
            watchdog.start()

    @property
    def enabled(self) -> bool:
        return not self._closed

    @property
    def run_dir(self) -> Path | None:
        return self.info.run_dir if self.info else None

    @property
    def steps(self) -> int:
        """Optimizer steps recorded so far on this rank."""
        return self._probe.steps if self._probe else 0

    def stats(self) -> dict[str, Any]:
        """Counters: steps written/dropped, write errors, watchdog timeouts by phase, whether the
        rank is stalled now, the wall-clock time the last step ended, and why busy time cannot be
        measured (``busy_unavailable``; empty when it can)."""
        w, wd, p = self._writer, self._watchdog, self._probe
        last = p.last_step_end if p is not None else None
        return {
            "steps_written": w.steps_written if w else 0,
            "dropped_steps": w.dropped_steps if w else 0,
            "write_errors": (w.write_errors if w else 0) + (wd.events.errors if wd else 0),
            "exporter_errors": self._exporter.errors if self._exporter else 0,
            "metrics_port": self._exporter.port if self._exporter and self._exporter.server else None,
            "watchdog_timeouts": dict(wd.timeouts_by_phase) if wd else {},
            "stalled": bool(wd and wd.stalled),
            "last_step_timestamp": None if last is None else self._wall_anchor + last,
            "busy_unavailable": self._unavailable() if self._unavailable else [],
        }

    def wrap(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """Time every ``next()`` on ``iterable`` as data wait (exactly, instead of the
        gap before the first forward). Returns a re-iterable wrapper."""
        if self._probe is None or self._closed:
            return iterable
        return self._probe.wrap(iterable)

    def flush(self) -> None:
        """Write every finished step now (the log thread also does so every second)."""
        if self._writer is not None and not self._closed:
            self._writer.flush()

    def close(self) -> None:
        """Remove the hooks, write the remaining steps and finish the log. Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        if self._probe is not None:
            self._probe.enabled = False
            self._probe.finish_pending()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog.record("closed")
        if self._shutdown is not None:
            self._shutdown.remove()
        if self._writer is not None:
            self._writer.close()
        if self._exporter is not None:
            self._exporter.close()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.info is None:
            return "Watch(disabled)"
        state = "closed" if self._closed else "open"
        return f"Watch(run={self.info.run_id!r}, rank={self.info.rank}, steps={self.steps}, {state})"


def _start_exporter(
    info: RunInfo,
    writer: EventLogWriter,
    watchdog: Watchdog | None,
    port: int | None,
    addr: str | None,
    unavailable: Callable[[], list[str]],
) -> Exporter | None:
    env_port = os.environ.get("STRAGGLERWATCH_PROMETHEUS_PORT", "").strip()
    if port is None and env_port:
        try:
            port = int(env_port)
        except ValueError:
            warnings.warn(f"stragglerwatch: STRAGGLERWATCH_PROMETHEUS_PORT={env_port!r} is not a port", stacklevel=3)
    if port is None:
        return None
    metrics = RankMetrics()
    writer.observers.append(metrics.observe)
    collector = RankCollector(metrics, info, watchdog, errors=lambda: writer.write_errors, unavailable=unavailable)
    sd_dir = os.environ.get("STRAGGLERWATCH_SD_DIR") or None
    return Exporter(
        collector,
        port + info.local_rank,
        addr or os.environ.get("STRAGGLERWATCH_PROMETHEUS_ADDR") or "0.0.0.0",
        Path(sd_dir) if sd_dir else None,
    )


class _UnavailableNotes:
    """Writes the reasons the probe found during training into the rank's metadata (log thread)."""

    def __init__(self, info: RunInfo, rank_meta: dict[str, Any], probe: StepProbe):
        self.info, self.rank_meta, self.probe = info, rank_meta, probe
        self.written = 0  # of the probe's reasons

    def __call__(self, records: list[Any]) -> None:
        reasons = list(self.probe.unavailable.values())
        if len(reasons) == self.written:
            return
        self.written = len(reasons)
        known = self.rank_meta.setdefault("busy_unavailable", [])
        known += [r for r in reasons if r not in known]
        write_rank_meta(self.info, self.rank_meta)

    def reasons(self) -> list[str]:
        """Every reason known now (attach time and training), for the exporter."""
        known = list(self.rank_meta.get("busy_unavailable", []))
        return known + [r for r in self.probe.unavailable.values() if r not in known]


def attach(
    model: torch.nn.Module,
    run_dir: str | os.PathLike[str] | None = None,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    watchdog_timeout_s: float | None = None,
    prometheus_port: int | None = None,
    enabled: bool = True,
    comm_hook: CommHook | None = None,
    bucket_timings: bool = False,
    role: str | None = None,
    prometheus_addr: str | None = None,
    flush_interval_s: float = 1.0,
) -> Watch:
    """Record this rank's step anatomy for ``model`` (a DDP module, or a plain module
    in one process) into ``run_dir`` (default ``$STRAGGLERWATCH_RUN_DIR`` or
    ``./stragglerwatch-runs/<run id>``), without changing the training loop.

    ``optimizer``: whose ``step()`` ends a training step; by default the last
    optimizer to step in an iteration, learned from the first one (every
    optimizer's ``step()`` is timed as optimizer either way). ``bucket_timings``: also record each gradient
    bucket's ready time and all-reduce duration, through a DDP communication
    hook that wraps the all-reduce (costs host time per bucket; see the README).
    ``comm_hook``: ``(state, hook)`` of your own DDP communication hook, to be
    registered and timed by stragglerwatch (implies ``bucket_timings``).
    Without either, DDP's built-in all-reduce and any hook already registered
    are left alone. ``role``: this rank's peer group (e.g. ``"stage3"`` of a
    pipeline): ranks are compared only with ranks of the same role.
    ``watchdog_timeout_s``: seconds without progress before the watchdog records
    a stall and names the culprit; None (default) adapts to the job (10x the
    median step, at least 10 s; 60 s until a few steps are done); 0 turns the
    watchdog off. ``prometheus_port`` (or ``$STRAGGLERWATCH_PROMETHEUS_PORT``):
    serve ``/metrics`` on ``port + local_rank``, bound to ``prometheus_addr``
    (``$STRAGGLERWATCH_PROMETHEUS_ADDR``, default all interfaces), and publish a
    file_sd target in the run dir (or ``$STRAGGLERWATCH_SD_DIR``).
    ``enabled=False`` or ``STRAGGLERWATCH_DISABLE=1`` returns a no-op :class:`Watch`.
    """
    if not enabled or _disabled_by_env():
        return Watch()
    is_ddp = isinstance(model, DistributedDataParallel)
    bucket_timings = is_ddp and (bucket_timings or comm_hook is not None)
    if bucket_timings:
        _check_comm_hook_free(model)
    info = discover(run_dir)
    on_gpu = _model_device(model).type == "cuda"
    timing = "cuda" if on_gpu else "host"
    config = {
        "flush_interval_s": flush_interval_s,
        "watchdog_timeout_s": watchdog_timeout_s,
        "prometheus_port": prometheus_port,
        "ddp": is_ddp,
        "bucket_timings": bucket_timings,
    }
    rank_meta: dict[str, Any] = {"device": str(_model_device(model)), "timing": timing, "role": role}
    unseen = unseen_communication(model)
    if unseen is not None:
        rank_meta["busy_unavailable"] = [unseen]
        warnings.warn(f"stragglerwatch: busy time unavailable: {unseen}", stacklevel=2)
    try:
        write_meta(info, config, rank_meta)
        path = log_path(info.run_dir, info.rank)
    except OSError as exc:
        warnings.warn(f"stragglerwatch: cannot write run dir {info.run_dir} ({exc}); not recording", stacklevel=2)
        return Watch()
    wall_anchor = time.time() - time.perf_counter()
    writer = EventLogWriter(
        path,
        info.rank,
        wall_anchor,
        timing=timing,
        resolve=resolve_cuda if on_gpu else None,
        flush_interval_s=flush_interval_s,
    )
    syncing = (lambda: model.require_backward_grad_sync) if is_ddp else None
    probe = StepProbe(
        writer.submit,
        cuda_mark if on_gpu else None,
        syncing,
        ender=id(optimizer) if optimizer is not None else None,
        expect_comm=info.world_size > 1 and not is_ddp and unseen is None,
        on_unavailable=lambda reason: warnings.warn(f"stragglerwatch: busy time unavailable: {reason}", stacklevel=4),
    )
    handles: list[Any] = time_forward(model, probe)
    if is_ddp:
        handles.append(time_buffer_sync(model, probe))
    handles.append(register_optimizer_step_pre_hook(probe.on_optimizer_pre))
    handles.append(register_optimizer_step_post_hook(probe.on_optimizer_post))
    handles += [tap_collectives(probe), tap_scaler(probe)]
    handles = [h for h in handles if h is not None]
    watchdog = None
    if watchdog_timeout_s is None or watchdog_timeout_s > 0:
        board = PeerBoard(info.run_id, info.rank, info.world_size) if info.world_size > 1 else None
        watchdog = Watchdog(
            probe,
            EventFile(info.run_dir / f"events-{info.rank:05d}.jsonl"),
            info.rank,
            info.world_size,
            board,
            timeout_s=watchdog_timeout_s,
            wall_anchor=wall_anchor,
            flush=lambda: writer.flush(lock_timeout_s=1.0),
        )
    notes = _UnavailableNotes(info, rank_meta, probe)
    writer.observers.append(notes)
    exporter = _start_exporter(info, writer, watchdog, prometheus_port, prometheus_addr, notes.reasons)
    watch = Watch(info, probe, writer, handles, watchdog, wall_anchor, exporter, notes.reasons)
    if bucket_timings:
        state, inner = comm_hook if comm_hook is not None else (model.process_group, None)
        try:
            model.register_comm_hook(None, probe.comm_hook(inner, state))
        except RuntimeError as exc:
            watch.close()
            raise RuntimeError(
                f"stragglerwatch: cannot add its DDP communication hook ({exc}); "
                "attach before registering any comm hook and pass yours as attach(model, comm_hook=(state, hook))"
            ) from None
    atexit.register(watch.close)  # a strong reference: `attach(model)` as a bare statement records too
    return watch


__all__ = ["Watch", "attach", "TimedIterable"]
