"""``attach()``: put the probes on a model and start this rank's event log.

Design: ``attach`` resolves its settings (:class:`~stragglerwatch.runtime.config.Config`) and
validates first (so a refused model leaves nothing behind), then writes the run metadata,
starts the log thread and registers the hooks. Everything it registered is remembered in
the returned :class:`Watch`, whose ``close()`` removes it again; ``atexit`` holds the
Watch, so ``attach(model)`` as a bare statement records and closes at exit too. The one
exception is DDP's communication hook, which PyTorch cannot unregister: after ``close()``
it is a pass-through to the wrapped hook, at the cost of one attribute check per bucket.

Never harm training: a mistake in the call (an unknown setting, a comm hook conflict,
attach before ``init_process_group``) raises at attach time, before training; any other
failure of ours, then or later, is one line in the ``stragglerwatch`` logger and a
counter, and training goes on (unwatched, if attach itself failed).

What the model is (DDP, FSDP2, compiled: ``models.py``) decides which hooks go on
(``shadows.py``). When the model's communication cannot be seen (``coverage.py``) the reason
goes into the rank's metadata (``busy_unavailable``), where ``analyze`` and the dashboard find it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import numbers
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from stragglerwatch.record.events import BOUNDED_WRITE_S, EventFile
from stragglerwatch.record.rundir import RunInfo
from stragglerwatch.record.steplog import log_path
from stragglerwatch.runtime.actions.hangabort import HangAbort, exit_now, restart_caveat
from stragglerwatch.runtime.actions.stragglerpolicy import StragglerPolicy
from stragglerwatch.runtime.capture.collectives import CollectiveLog
from stragglerwatch.runtime.capture.coverage import UnavailableNotes, coverage_notes, refusal, unseen_communication
from stragglerwatch.runtime.capture.datamark import DataMark, mark_fetch
from stragglerwatch.runtime.capture.devices import CaptureGate, CudaMarks, compute_device, device_progress
from stragglerwatch.runtime.capture.models import LateStageRole, ModelInfo, inspect_model, pipeline_role, pipeline_stage
from stragglerwatch.runtime.capture.probes import StepProbe, TimedIterable
from stragglerwatch.runtime.capture.shadows import (
    time_as_forward,
    time_buffer_sync,
    time_fetch,
    time_forward,
    time_fsdp_waits,
)
from stragglerwatch.runtime.capture.taps import CallFallback, tap_collectives, tap_scaler
from stragglerwatch.runtime.capture.timing import resolve_cuda
from stragglerwatch.runtime.capture.work import DeviceCounts
from stragglerwatch.runtime.config import CODE_HZ, Config
from stragglerwatch.runtime.context.codemetrics import CodeCollector
from stragglerwatch.runtime.context.codesampler import CodeSampler
from stragglerwatch.runtime.context.ctxmetrics import ContextCollector
from stragglerwatch.runtime.context.sampler import ContextSampler
from stragglerwatch.runtime.controls.control import Controls
from stragglerwatch.runtime.hangs.nativestacks import NativeStacks
from stragglerwatch.runtime.hangs.peers import PeerBoard
from stragglerwatch.runtime.hangs.shutdown import ShutdownHooks
from stragglerwatch.runtime.hangs.watchdog import Watchdog
from stragglerwatch.runtime.identity import AttachError, discover, write_meta
from stragglerwatch.runtime.log import LOGGER, Problems
from stragglerwatch.runtime.output.exporter import Exporter, RankCollector, RankMetrics
from stragglerwatch.runtime.output.writer import EventLogWriter

CommHook = tuple[Any, Callable[[Any, Any], torch.futures.Future]]


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _check_comm_hook_free(model: DistributedDataParallel) -> None:
    if model._comm_hooks:
        raise AttachError(
            "stragglerwatch: bucket_timings needs DDP's communication hook, but this model already has one "
            "(registered by register_comm_hook(), or by Accelerate's DistributedDataParallelKwargs(comm_hook=...)) "
            "and PyTorch allows only one. Leave bucket_timings off (nothing else needs a comm hook), or call "
            "attach() before register_comm_hook() and pass yours as attach(model, comm_hook=(state, hook))."
        )


class Watch:
    """Handle on a watched model: ``wrap`` a loader, ``close`` when done (or use ``with``)."""

    def __init__(self, info: RunInfo | None = None, problems: Problems | None = None, wall_anchor: float = 0.0):
        self.info = info
        self.problems = problems or Problems()
        self._wall_anchor = wall_anchor
        self._probe: StepProbe | None = None
        self._writer: EventLogWriter | None = None
        self._watchdog: Watchdog | None = None
        self._shutdown: ShutdownHooks | None = None
        self._exporter: Exporter | None = None
        self._context: ContextSampler | None = None
        self._code: CodeSampler | None = None
        self._collectives: CollectiveLog | None = None  # multi-rank: PyTorch's record of the collectives
        self._notes: UnavailableNotes | None = None
        self._controls: Controls | None = None
        self._policy: StragglerPolicy | None = None  # rank 0 with ``on_straggler``
        self._marks: CudaMarks | None = None  # CUDA timing: the probe's clock
        self._gate: CaptureGate | None = None  # CUDA timing: no event query of ours during a graph capture
        self._events: EventFile | None = None  # this rank's events (the watchdog's, or close's own)
        self._handles: list[Any] = []
        self._last: Any = None  # the latest step record written
        self._closed = info is None

    @property
    def enabled(self) -> bool:
        return not self._closed

    @property
    def run_dir(self) -> Path | None:
        return self.info.run_dir if self.info else None

    @property
    def steps(self) -> int:
        """Optimizer steps taken so far on this rank (recorded, or counted while recording was off)."""
        return self._probe.steps if self._probe else 0

    @property
    def controls(self) -> Controls:
        """Runtime control of this rank without a restart (``recording``, ``watchdog_timeout_s``,
        ``flush_interval_s``: ``controls.apply({"watchdog_timeout_s": "3"})``) and its live state
        (``controls.state()``); see ``control.py``."""
        if self._controls is None:
            self._controls = Controls(self)
        return self._controls

    def stats(self) -> dict[str, Any]:
        """Counters: steps written/dropped, write errors, watchdog timeouts by phase, whether the
        rank is stalled now, the wall-clock time the last step ended, why busy time cannot be
        measured (``busy_unavailable``; empty when it can), and our own failures by kind."""
        w, wd, p = self._writer, self._watchdog, self._probe
        last = p.last_step_end if p is not None else None
        return {
            "steps_written": w.steps_written if w else 0,
            "dropped_steps": w.dropped_steps if w else 0,
            "capture_dropped_marks": self._marks.dropped if self._marks else 0,
            "capture_gate_timeouts": self._gate.waited_out if self._gate else 0,
            "capture_dropped_steps": w.capture_dropped_steps if w else 0,
            "stale_dropped_steps": w.stale_dropped_steps if w else 0,
            "unresolvable_dropped_steps": w.unresolvable_dropped_steps if w else 0,
            "unresolved_steps": len(w.unresolved) if w else 0,
            "dropped_marks": p.dropped_marks if p is not None else 0,
            "write_errors": (w.write_errors if w else 0) + (wd.events.errors if wd else 0),
            "exporter_errors": self._exporter.errors if self._exporter else 0,
            "metrics_port": self._exporter.port if self._exporter and self._exporter.server else None,
            "watchdog_timeouts": dict(wd.timeouts_by_phase) if wd else {},
            "actions": self._actions(),
            "stalled": bool(wd and wd.stalled),
            "last_step_timestamp": None if last is None else self._wall_anchor + last,
            "busy_unavailable": self._notes.reasons() if self._notes else [],
            "work_notes": list(p.work_notes.values()) if p is not None else [],
            "context_samples": self._context.samples if self._context else 0,
            "code_samples": self._code.samples if self._code else 0,
            "collectives": self._collectives.stats() if self._collectives else None,
            "problems": dict(self.problems.counts),
        }

    def _actions(self) -> dict[str, int]:
        """The policies' actions taken by this rank, by kind (``abort``, ``straggler``)."""
        out = dict(self._watchdog.actions) if self._watchdog is not None else {}
        if self._policy is not None and self._policy.acted:
            out["straggler"] = len(self._policy.acted)
        return out

    def wrap(self, iterable: Iterable[Any]) -> Iterable[Any]:
        """Time every ``next()`` on ``iterable`` as data wait (exactly, instead of the
        gap before the first forward). Returns a re-iterable wrapper."""
        if self._probe is None or self._closed:
            return iterable
        if self._notes is not None:  # its settings, for the report's advice
            self._notes.note_loader(iterable)
        return self._probe.wrap(iterable)

    def data(self, fetch: Any = None) -> Any:
        """Mark where the loop fetches its batches, for loops without a ``DataLoader``: time
        inside is data wait wherever it happens in the step (also between forward and backward).
        ``get_batch = watch.data(get_batch)`` wraps a fetch function; ``with watch.data(): x, y =
        next(it)`` marks a block; an iterable (a loader) is wrapped as by :meth:`wrap`. Once a fetch
        is marked, the gap before the first forward is no longer taken for data wait. On a closed or
        disabled handle: ``fetch`` unchanged, or a context manager that does nothing."""
        probe = self._probe if not self._closed else None
        if fetch is None:
            return DataMark(probe)
        if probe is None:
            return fetch
        if callable(fetch):
            return mark_fetch(probe, fetch)
        if hasattr(fetch, "__iter__"):
            return self.wrap(fetch)
        raise TypeError(f"watch.data() marks a fetch function, a loader or a with-block, not {type(fetch).__name__}")

    def note_work(self, n: float, unit: str = "tokens") -> None:
        """Add ``n`` units of work (tokens, samples, ...: a Python number) to the current step. In a
        step where the loop calls it, the noted total replaces the work counted from what the
        training forwards receive (the elements of their main input, or the ones of its
        ``attention_mask``), with ``unit`` as the step's ``work_unit`` (``work_elements``, the
        elements of their inputs' shapes, stays as counted). Work per step tells load
        imbalance (ranks given different work) from a straggler (slow for the same work). Called
        before the first step, it counts toward the first. Never raises: a bad ``n`` or ``unit`` (a
        tensor, negative, NaN) is one line in the ``stragglerwatch`` logger and is ignored."""
        probe = self._probe if not self._closed else None
        if probe is None:
            return
        try:
            probe.note_work(_work_count(n), _work_unit(unit))
        except Exception as exc:
            self.problems.report("note-work", f"watch.note_work({type(n).__name__}, {type(unit).__name__}) ignored: "
                                 f"{exc}")  # fmt: skip

    def latest(self) -> dict[str, float] | None:
        """This rank's latest step written to the log: ``step``, and in seconds ``step_s``, ``busy_s``,
        ``comm_wait_s`` and ``data_wait_s`` (no other phase), and ``busy_share`` (busy over step time); or None
        before the first write (steps are written every flush interval)."""
        last = self._last
        if last is None:
            return None
        figures = {k: float(getattr(last, k)) for k in ("step", "step_s", "busy_s", "comm_wait_s", "data_wait_s")}
        figures["busy_share"] = last.busy_s / last.step_s if last.step_s > 0 else float("nan")
        return figures

    def step(self) -> None:
        """End the current step here, for a loop whose steps no ``torch.optim`` optimizer ends (a
        hand-written update, an unusual framework). From the first call on, only these calls end
        steps (call it once before the loop to have it so from the first step); optimizer steps are
        still timed as optimizer. Cheap (a few clock reads)."""
        if self._probe is not None and not self._closed:
            self._probe.mark_step()

    def time_data(self, obj: Any, begin: str, end: str | None = None) -> None:
        """For integrations: time as data wait what happens between calls of ``obj.<begin>()``
        and ``obj.<end>()`` (a framework's fetch callbacks), or inside ``obj.<begin>()`` (its
        fetch method) when ``end`` is None; undone by ``close()``."""
        if self._probe is not None and not self._closed:
            self._handles += time_fetch(obj, begin, end, self._probe)

    def time_forward(self, obj: Any, name: str, module: torch.nn.Module) -> None:
        """For integrations: time calls of ``obj.<name>()`` as forward passes (a framework's
        training step that computes the loss without calling the watched model's forward);
        ``module``'s train/eval mode tells training from evaluation. Undone by ``close()``."""
        if self._probe is not None and not self._closed:
            self._handles.append(time_as_forward(obj, name, module, self._probe))

    def note_unavailable(self, key: str, reason: str) -> None:
        """For integrations: part of the signal cannot be measured in this loop, and why."""
        if self._probe is not None and not self._closed:
            self._probe.note_unavailable(key, reason)

    def _observe(self, records: list[Any]) -> None:
        if records:
            self._last = records[-1]

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Have the log thread write every finished step now (it also does so every flush interval);
        waits at most ``timeout_s``, and not again while a write that made it give up has not
        returned. True when the steps were written."""
        if self._writer is not None and not self._closed:
            return self._writer.request_flush(timeout_s)
        return False

    def close(self) -> None:
        """Remove the hooks, write the remaining steps and finish the log. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is None or self._watchdog.exit_status is None:  # else the exit hook ends the process
            atexit.unregister(self._at_exit)
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self._controls is not None:
            steps.append(("stop the runtime controls", self._controls.close))
        if self._policy is not None:
            steps.append(("stop the straggler policy", self._policy.stop))
        if self._probe is not None:
            self._probe.enabled = False
            steps.append(("finish the last step", self._probe.finish_pending))
        steps += [(f"remove {type(h).__name__}", h.remove) for h in self._handles]
        if self._watchdog is not None:
            steps += [("stop the watchdog", self._watchdog.stop), ("record", lambda: self._watchdog.record("closed"))]
        if self._shutdown is not None:
            steps.append(("restore the signal handlers", self._shutdown.remove))
        if self._writer is not None:
            steps += [("finish the step log", self._writer.close), ("record", self._record_unresolved)]
        if self._collectives is not None:
            steps.append(("copy the last collectives", self._collectives.read))
        if self._context is not None:
            steps.append(("finish the context stream", self._context.close))
        if self._code is not None:
            steps.append(("finish the code samples", self._code.close))
        if self._exporter is not None:
            steps.append(("stop the exporter", self._exporter.close))
        for what, step in steps:
            try:
                step()
            except Exception as exc:
                self.problems.report("close", f"close: could not {what}: {type(exc).__name__}: {exc}")
        self._handles.clear()

    def _at_exit(self) -> None:
        """The interpreter's exit hook: close, and where the hang policy is ending this rank through the
        application's SIGTERM handler (which replaced ours and may exit with 0), end with its status."""
        self.close()
        status = self._watchdog.exit_status if self._watchdog is not None else None
        if status is not None and not threading.main_thread().is_alive():  # at exit, not a handler's close()
            LOGGER.warning("stragglerwatch: hang policy: this rank ends with exit status %d", status)
            exit_now(status)

    def _record_unresolved(self) -> None:
        """Steps the GPU had not finished when close stopped waiting: said, not lost silently."""
        steps = self._writer.unresolved if self._writer is not None else []
        if not steps or self._events is None or self.info is None:
            return
        self._events.write({"kind": "unresolved", "rank": self.info.rank, "step": steps[0], "phase": "close",
                            "steps": steps[:1000], "count": len(steps), "detected_at": time.time(),
                            "reason": "their CUDA events had not completed within close_timeout_s"},
                           timeout_s=BOUNDED_WRITE_S)  # fmt: skip
        self.problems.report("close", f"close: {len(steps)} step(s) from step {steps[0]} not recorded: the GPU "
                             "had not finished them within close_timeout_s (stuck behind a collective?)")  # fmt: skip

    def _in_forked_child(self) -> None:
        """A fork of the watched process (a DataLoader worker, a fork ``Pool``, ``os.fork()``): ours is
        inert there from its first instruction. Signal handler, wakeup fd and excepthook go back to
        what they were before us; no thread of ours runs there (threads do not survive a fork) and
        none is started; nothing is written, flushed or closed into the parent's files: the child's
        copies of our descriptors are pointed at /dev/null, so that even its exit flushes nowhere."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self._at_exit)
        if self._probe is not None:
            self._probe.enabled = False
        if self._shutdown is not None:
            self._shutdown.forked()
        for h in self._handles:  # the child's own copies of our taps and shadows: plain methods again
            try:
                h.remove()
            except Exception:
                pass
        self._handles.clear()
        files = [getattr(self._writer, "_file", None), getattr(self._context, "file", None),
                 getattr(self._code, "file", None)]
        native = getattr(self._watchdog, "native", None)
        if native is not None:  # disarmed before the fork (NativeStacks.before_fork): only its file is left
            files.append(native._file)
        server = getattr(self._exporter, "server", None)
        files.append(getattr(server, "socket", None))
        _point_at_devnull(files)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.info is None:
            return "Watch(disabled)"
        state = "closed" if self._closed else "open"
        return f"Watch(run={self.info.run_id!r}, rank={self.info.rank}, steps={self.steps}, {state})"


def _work_count(n: Any) -> float:
    """``n`` as a count of work, or ValueError (a tensor is refused: reading one may wait for the GPU)."""
    if isinstance(n, torch.Tensor):
        raise ValueError("a tensor: pass a Python number (reading a CUDA tensor would wait for the GPU)")
    if isinstance(n, bool) or not isinstance(n, numbers.Real):
        raise ValueError(f"not a number ({type(n).__name__})")
    value = float(n)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"not a finite count >= 0 ({value})")
    return value


def _work_unit(unit: Any) -> str:
    if not isinstance(unit, str) or not unit.strip() or len(unit) > 64:
        raise ValueError("the unit must be a non-empty string of at most 64 characters")
    return unit.strip()


def _point_at_devnull(files: list[Any]) -> None:
    fds = []
    for f in files:
        try:
            if f is not None:
                fds.append(f.fileno())
        except Exception:
            continue
    if not fds:
        return
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in fds:
            try:
                os.dup2(devnull, fd)
            except OSError:
                pass
    finally:
        os.close(devnull)


def _at_fork(ref: weakref.ReferenceType[Watch], when: str) -> None:
    """``os.register_at_fork``'s hooks of one Watch (a weak reference: a closed Watch is not kept)."""
    watch = ref()
    if watch is None or watch._closed:
        return
    native = getattr(watch._watchdog, "native", None)
    try:
        if when == "before" and native is not None:
            native.before_fork()
        elif when == "parent" and native is not None:
            native.after_fork_in_parent()
        elif when == "child":
            if native is not None:
                native.after_fork_in_child()
            watch._in_forked_child()
    except Exception:
        pass


def attach(
    model: torch.nn.Module,
    run_dir: str | os.PathLike[str] | None = None,
    *,
    config: Config | None = None,
    **settings: Any,
) -> Watch:
    """Record this rank's step anatomy for ``model`` (a DDP module, or a plain module in one
    process) into ``run_dir``, without changing the training loop.

    Settings are the fields of :class:`~stragglerwatch.runtime.config.Config`, given as ``config=`` or
    as keyword arguments (which win), e.g. ``optimizer``, ``watchdog_timeout_s``,
    ``prometheus_port``, ``role``, ``bucket_timings``, ``comm_hook``, ``flush_interval_s``;
    some also come from ``STRAGGLERWATCH_*`` environment variables. ``enabled=False`` or
    ``STRAGGLERWATCH_DISABLE=1`` returns an inert :class:`Watch`; so does a model it does not
    support (DeepSpeed's engine), after one line in the ``stragglerwatch`` logger.

    Raises :class:`~stragglerwatch.runtime.config.ConfigError` or
    :class:`~stragglerwatch.runtime.identity.AttachError` (one line each) for a mistake in the call;
    never for a failure of ours.
    """
    problems = Problems()
    cfg = Config.resolve(config, problems=problems, run_dir=run_dir, **settings)
    if not cfg.enabled:
        return Watch()
    try:
        parts = inspect_model(model)
    except Exception as exc:
        problems.report("attach", f"cannot watch this model ({type(exc).__name__}: {exc}); training goes on unwatched")
        return Watch()
    refused = refusal(model, parts.target)
    if refused is not None:  # before the run dir: a refused model leaves nothing behind
        problems.report("attach", refused)
        return Watch(problems=problems)
    if parts.ddp is not None and (cfg.bucket_timings or cfg.comm_hook is not None):
        _check_comm_hook_free(parts.ddp)
    if cfg.timing == "cuda" and not torch.cuda.is_available():
        raise AttachError("stragglerwatch: timing='cuda', but this process has no CUDA device (use 'auto' or 'host')")
    info = discover(cfg.run_dir, cfg.run_id, scope=type(parts.target or model).__qualname__)
    watch = Watch(info, problems, wall_anchor=time.time() - time.perf_counter())
    try:
        _assemble(watch, parts, cfg)
    except AttachError:
        watch.close()
        raise
    except Exception as exc:
        watch.close()
        problems.report("attach", f"cannot watch this model ({type(exc).__name__}: {exc}); training goes on unwatched")
        return Watch()
    if info.rank == 0:
        _say_where(info)
    atexit.register(watch._at_exit)  # a strong reference: `attach(model)` as a bare statement records too
    ref = weakref.ref(watch)
    os.register_at_fork(before=functools.partial(_at_fork, ref, "before"),
                        after_in_parent=functools.partial(_at_fork, ref, "parent"),
                        after_in_child=functools.partial(_at_fork, ref, "child"))  # fmt: skip
    return watch


def _say_where(info: RunInfo) -> None:
    """Rank 0's one line at attach: where the run is recorded and how to analyse it. To the ``stragglerwatch``
    logger where it shows INFO, else to stderr (the logger's default shows warnings only)."""
    line = (f"stragglerwatch: recording run {info.run_id} (rank 0 of {info.world_size}) to {info.run_dir}; "
            f"analyse it with: stragglerwatch analyze {info.run_dir}")  # fmt: skip
    if LOGGER.isEnabledFor(logging.INFO) and LOGGER.hasHandlers():
        LOGGER.info(line)
    else:
        print(line, file=sys.stderr, flush=True)


def _assemble(watch: Watch, parts: ModelInfo, cfg: Config) -> None:
    """Start the log, the watchdog and the exporter and register the hooks, each kept on ``watch``: the
    one place where the runtime's sub-packages meet (capture, output, hangs, actions, context, controls)."""
    info = watch.info
    if info is None:
        raise RuntimeError("no run identity")
    model, ddp = parts.outer, parts.ddp
    device = compute_device(model, parts.mesh, ddp)
    on_gpu = cfg.timing == "cuda" or (cfg.timing in (None, "auto") and device.type == "cuda")
    rank_meta, write_metadata = _metadata(watch, parts, cfg, device, on_gpu)
    probe = _start_capture(watch, parts, cfg, on_gpu, write_metadata, rank_meta)
    _start_hangs(watch, cfg, probe)
    _start_samplers(watch, cfg, device, probe)
    if cfg.prometheus_port is not None:
        _start_exporter(watch, cfg)
    _hook(watch, parts, cfg, probe, on_gpu)
    if watch._watchdog is not None:
        watch._shutdown = ShutdownHooks(watch._watchdog)
        watch._watchdog.start()
    for sampler in (watch._context, watch._code, watch._policy):
        if sampler is not None:
            sampler.start()
    watch.controls.start(cfg.control_interval_s, cfg.debug_server_port, cfg.debug_server_host)


def _metadata(watch: Watch, parts: ModelInfo, cfg: Config, device: torch.device, on_gpu: bool
              ) -> tuple[dict[str, Any], Callable[[], None]]:  # fmt: skip
    """The run's and this rank's metadata, written now; the rank's dict and a writer for it."""
    info, problems = watch.info, watch.problems
    assert info is not None
    model, is_ddp = parts.outer, parts.ddp is not None
    settings = {"flush_interval_s": cfg.flush_interval_s, "fsync_interval_s": cfg.fsync_interval_s,
                "watchdog_timeout_s": cfg.watchdog_timeout_s, "prometheus_port": cfg.prometheus_port,
                "prometheus_mode": cfg.prometheus_mode or "full", "ddp": is_ddp, "fsdp2": parts.fsdp2,
                "compiled": parts.compiled, "bucket_timings": _bucket_timings(parts, cfg),
                "context_interval_s": cfg.context_interval_s,
                "code_sample_hz": CODE_HZ if cfg.code_sample_hz is None else cfg.code_sample_hz}  # fmt: skip
    role = cfg.role if cfg.role is not None else pipeline_role(pipeline_stage(*parts.modules()), parts.mesh)
    rank_meta: dict[str, Any] = {"device": str(device), "timing": "cuda" if on_gpu else "host", "role": role}
    unseen = unseen_communication(parts.target or model, device.type)
    coverage = coverage_notes(parts.target or model, parts.compiled, info.world_size)
    if coverage:
        rank_meta["coverage"] = coverage
    if unseen is not None:
        rank_meta["busy_unavailable"] = [unseen]
        problems.report("unavailable", f"busy time unavailable: {unseen}")

    def write_metadata() -> None:
        write_meta(info, settings, rank_meta)

    try:
        write_metadata()
    except OSError as exc:
        raise RuntimeError(f"cannot write run dir {info.run_dir} ({exc})") from None
    return rank_meta, write_metadata


def _bucket_timings(parts: ModelInfo, cfg: Config) -> bool:
    return parts.ddp is not None and (cfg.bucket_timings or cfg.comm_hook is not None)


def _start_capture(watch: Watch, parts: ModelInfo, cfg: Config, on_gpu: bool, write_metadata: Callable[[], None],
                   rank_meta: dict[str, Any]) -> StepProbe:  # fmt: skip
    """The step log thread (``output``), the probe that feeds it and what observes its records
    (``capture``: the reasons busy time cannot be measured, PyTorch's record of the collectives)."""
    info, problems = watch.info, watch.problems
    assert info is not None
    model, ddp = parts.outer, parts.ddp
    timing = "cuda" if on_gpu else "host"
    gate = watch._gate = CaptureGate().install() if on_gpu else None
    if gate is not None:
        watch._handles.append(gate)
        watch._marks = CudaMarks(gate)
    writer = watch._writer = EventLogWriter(
        log_path(info.run_dir, info.rank), info.rank, watch._wall_anchor, timing=timing,
        resolve=resolve_cuda if on_gpu else None, flush_interval_s=cfg.flush_interval_s,
        fsync_interval_s=cfg.fsync_interval_s, restart=info.restart, attach=info.attach, problems=problems,
        on_reopen=write_metadata, gate=gate.quiet if gate else None, close_timeout_s=cfg.close_timeout_s,
    )  # fmt: skip
    probe = watch._probe = StepProbe(
        writer.submit,
        watch._marks.mark if watch._marks is not None else None,
        (lambda: ddp.require_backward_grad_sync) if ddp is not None else None,
        ender=id(cfg.optimizer) if cfg.optimizer is not None else None,
        params={id(p) for p in model.parameters()},
        expect_comm=info.world_size > 1 and ddp is None and "busy_unavailable" not in rank_meta,
        on_unavailable=lambda reason: problems.report("unavailable", f"busy time unavailable: {reason}"),
        problems=problems,
        device_counts=DeviceCounts(gate) if gate is not None else None,
    )
    notes = watch._notes = UnavailableNotes(info, rank_meta, probe)
    writer.observers += [notes, watch._observe]
    if cfg.role is None and rank_meta.get("role") is None:  # a pipeline stage built after attach
        writer.observers.append(LateStageRole(parts, rank_meta, write_metadata))
    if info.world_size > 1:  # the arrival order at every collective, from PyTorch's own record, off this thread
        watch._collectives = CollectiveLog(info.run_dir / f"collectives-{info.rank:05d}.jsonl", lambda: probe.thread,
                                           ids=(info.restart, info.attach), problems=problems)  # fmt: skip
        writer.observers.append(watch._collectives)
    watch._events = EventFile(info.run_dir / f"events-{info.rank:05d}.jsonl")
    return probe


def _start_hangs(watch: Watch, cfg: Config, probe: StepProbe) -> None:
    """The watchdog (``hangs``), with the hang policy (``actions``) when asked for, and the straggler
    policy's thread on rank 0."""
    info, problems, writer = watch.info, watch.problems, watch._writer
    assert info is not None and writer is not None and watch._events is not None
    gate = watch._gate
    if cfg.watchdog_timeout_s is None or cfg.watchdog_timeout_s > 0:
        native = NativeStacks(info.run_dir / f"stacks-{info.rank:05d}.txt") if cfg.native_stacks else None
        watch._watchdog = Watchdog(
            probe, watch._events, info.rank, info.world_size,
            PeerBoard(info.run_id, info.rank, info.world_size) if info.world_size > 1 else None,
            timeout_s=cfg.watchdog_timeout_s, wall_anchor=watch._wall_anchor,
            flush=lambda: writer.request_flush(1.0), native=native,
            ids={"restart": info.restart, "attach": info.attach}, problems=problems,
            fr_path=info.run_dir / f"flightrec-{info.rank:05d}.pkl",
            device=_device_reader(probe, gate) if gate is not None else None,
            abort=_hang_abort(watch, cfg) if cfg.on_hang == "abort" else None,
            replays=(lambda: gate.replays) if gate is not None else None, silent_s=cfg.hang_silent_s,
        )  # fmt: skip
    caveat = restart_caveat(os.environ) if cfg.on_hang == "abort" else None
    if caveat is not None and info.local_rank == 0:
        problems.report("config", caveat)
    if cfg.straggler_actions() and info.rank == 0:
        watch._policy = StragglerPolicy(
            info.run_dir, cfg.act_rule(), cfg.straggler_actions(), watch._events, info.world_size,
            exclude_file=Path(cfg.exclude_file) if cfg.exclude_file else None, interval_s=cfg.policy_interval_s,
            problems=problems, ids={"restart": info.restart, "attach": info.attach},
            window_steps=cfg.straggler_window_steps, expire_s=cfg.exclude_expire_s,
        )  # fmt: skip


def _start_samplers(watch: Watch, cfg: Config, device: torch.device, probe: StepProbe) -> None:
    """The host and GPU context sampler and the code sampler (``context``)."""
    info, problems = watch.info, watch.problems
    assert info is not None
    if cfg.context_interval_s:
        gpu = _cuda_index(device) if device.type == "cuda" else None
        watch._context = ContextSampler(info.run_dir, info.rank, interval_s=cfg.context_interval_s, gpu_index=gpu,
                                        problems=problems)  # fmt: skip
    code_hz = CODE_HZ if cfg.code_sample_hz is None else cfg.code_sample_hz
    if code_hz:
        watch._code = CodeSampler(info.run_dir, info.rank, probe.sampled, hz=code_hz, problems=problems)


def _start_exporter(watch: Watch, cfg: Config) -> None:
    """This rank's Prometheus exporter (``output``) and the collectors of the samplers."""
    info, problems, writer, notes = watch.info, watch.problems, watch._writer, watch._notes
    assert info is not None and writer is not None and notes is not None
    metrics = RankMetrics()
    writer.observers.append(metrics.observe)
    lean = cfg.prometheus_mode == "lean"
    policy = None
    if cfg.on_hang == "abort" or watch._policy is not None:
        def policy() -> tuple[dict[str, int], list[dict[str, Any]]]:
            return watch._actions(), list(watch._policy.acted) if watch._policy is not None else []
    collector = RankCollector(metrics, info, watch._watchdog, errors=lambda: writer.write_errors,
                              unavailable=notes.reasons, lean=lean, policy=policy)  # fmt: skip
    watch._exporter = Exporter(collector, int(cfg.prometheus_port) + info.local_rank,  # type: ignore[arg-type]
                               cfg.prometheus_addr or "0.0.0.0", Path(cfg.sd_dir) if cfg.sd_dir else None,
                               problems)  # fmt: skip
    if watch._code is not None:
        watch._exporter.registry.register(CodeCollector(watch._code, info.run_id, info.rank))
    if watch._context is not None:
        watch._exporter.registry.register(ContextCollector(watch._context, info.run_id, info.rank, info.host,
                                                           lean=lean))  # fmt: skip


def _hook(watch: Watch, parts: ModelInfo, cfg: Config, probe: StepProbe, on_gpu: bool) -> None:
    """The hooks on the model, its optimizers and the collectives (``capture``), kept for ``close()``."""
    handles = watch._handles
    handles += time_forward(parts, probe)
    handles.append(time_buffer_sync(parts, probe))
    if parts.fsdp2 and on_gpu:
        handles += time_fsdp_waits(parts, probe)
    handles.append(register_optimizer_step_pre_hook(probe.on_optimizer_pre))
    handles.append(register_optimizer_step_post_hook(probe.on_optimizer_post))
    taps = tap_collectives(probe)  # where the thread blocks for a collective
    if taps is not None:
        def overlaid(names: list[str]) -> None:
            watch.problems.report("coverage", f"the process group's {', '.join(names)} were wrapped after attach: "
                                  "collectives are now also bracketed where torch.distributed calls them")  # fmt: skip

        fallback = CallFallback(taps, probe, overlaid)
        probe.step_hooks.append(fallback)
        handles += [taps, fallback]
    handles.append(tap_scaler(probe))  # steps GradScaler skipped
    handles[:] = [h for h in handles if h is not None]
    if _bucket_timings(parts, cfg):
        ddp = parts.ddp
        assert ddp is not None
        state, inner = cfg.comm_hook if cfg.comm_hook is not None else (ddp.process_group, None)
        try:
            ddp.register_comm_hook(None, probe.comm_hook(inner, state))
        except RuntimeError as exc:
            raise AttachError(
                f"stragglerwatch: cannot add its DDP communication hook ({exc}); "
                "attach before registering any comm hook and pass yours as attach(model, comm_hook=(state, hook))"
            ) from None


def _hang_abort(watch: Watch, cfg: Config) -> Callable[[Watchdog], HangAbort]:
    """``on_hang="abort"``'s policy for the watchdog: it signals through our SIGTERM handler."""

    def terminate() -> str:
        return watch._shutdown.terminate() if watch._shutdown is not None else "none (our handler is not installed)"

    def make(watchdog: Watchdog) -> HangAbort:
        return HangAbort(cfg.hang_abort_s, terminate, watchdog._stop, handler=cfg.hang_handler)

    return make


def _device_reader(probe: StepProbe, gate: CaptureGate) -> Callable[[], dict[str, Any] | None]:
    """Where this rank's GPU is (for the watchdog, at a stall), never while a capture is open."""

    def read() -> dict[str, Any] | None:
        trail = list(probe.device_trail or ())
        with gate.quiet() as may_query:
            if not may_query:
                return {"step": trail[-1][1] if trail else None, "phase": "unknown (a CUDA graph capture is open)"}
            return device_progress(trail)

    return read


__all__ = ["Watch", "attach", "TimedIterable"]
