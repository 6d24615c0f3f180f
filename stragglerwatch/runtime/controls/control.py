"""Runtime control of a watched rank, and its live state: :class:`Controls` (``Watch.controls``).

Design: three settings can change while the job runs, without a restart, each through the one
thing that already reads it, so nothing new runs in the training thread's hot path:

- ``recording`` (on/off): :attr:`StepProbe.recording`; the training thread applies it at the next
  step end (``probes.py``), so no step is ever cut; steps while off are counted, not recorded;
- ``watchdog_timeout_s`` (seconds, or ``auto`` for the adaptive threshold): ``Watchdog.timeout_s``,
  read at every poll (0.2 s). A watchdog turned off at attach (``0``) has no thread to turn on;
- ``flush_interval_s``: :meth:`EventLogWriter.set_flush_interval` wakes the log thread's current
  wait, which then counts the new interval from its start.

:func:`parse_settings` validates (one line per bad setting; the command line uses it too) and
:meth:`Controls.apply` applies all or nothing, logs one line per change in the ``stragglerwatch``
logger and counts them. Two ways reach it: PyTorch's debug server (``debugserver.py``) and, where
torch has none, the run dir's control file: ``stragglerwatch control RUN_DIR --set K=V`` appends a
numbered request to ``control.json`` (versioned; the latest 50 kept); one rank per host looks at the
file once per ``control_interval_s`` (one ``stat``) and relays it to the others through a node-local
copy (``noderelay.py``); every rank's :class:`ControlFile` thread applies the requests that are new
since it attached and addressed to it, and writes what it did to ``control-ack-NNNNN.json``, which
``stragglerwatch control RUN_DIR`` reads back. Requests made before a rank attached are not applied
to it (a restarted job does not replay old commands).

:meth:`Controls.state` is the rank's live view: where the training thread is (step, phase,
seconds in it), the last steps' figures, the watchdog's current stall and its diagnosis (read from
the rank's events file), the settings in force and the counters. Nothing here imports torch.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from stragglerwatch.record.events import latest_stall
from stragglerwatch.record.rundir import RunInfo
from stragglerwatch.runtime.controls.controlspec import VERSION, clean, parse_settings, show
from stragglerwatch.runtime.log import Problems

if TYPE_CHECKING:
    from stragglerwatch.runtime.capture.probes import StepProbe
    from stragglerwatch.runtime.controls.controlfile import ControlFile
    from stragglerwatch.runtime.hangs.watchdog import Watchdog
    from stragglerwatch.runtime.output.writer import EventLogWriter


class Watched(Protocol):
    """What the controls reach of the :class:`~stragglerwatch.runtime.watch.Watch` they belong to (a
    protocol: the watch imports this module, so this module does not import the watch)."""

    info: RunInfo | None
    problems: Problems
    _probe: StepProbe | None
    _writer: EventLogWriter | None
    _watchdog: Watchdog | None


# -- the watchdog's latest stall, from the rank's events file -------------------------------------------


# -- the controls ---------------------------------------------------------------------------------------


def _torch_debug_server_running() -> bool:
    """Whether the job already started torch's own debug server (``start_debug_server``) in this process."""
    import sys

    mod = sys.modules.get("torch.distributed.debug")
    return getattr(mod, "_WORKER_SERVER", None) is not None


class Controls:
    """Runtime control and live state of one watched rank (``Watch.controls``). Thread-safe."""

    def __init__(self, watch: Watched):
        self._watch = watch
        self._lock = threading.Lock()
        self.changes = 0  # settings changed at run time
        self.rejected = 0  # requests refused (nothing of them applied)
        self._recent: deque[tuple[int, float, float]] = deque(maxlen=50)  # (step, step_s, busy_s) written
        self._stall_cache: tuple[Any, dict[str, Any] | None] = (None, None)
        self._file: ControlFile | None = None
        self.debug_server: Any = None  # debugstack.DebugServer, when started
        self._closed = False

    @property
    def problems(self) -> Problems:
        return self._watch.problems

    @property
    def rank(self) -> int | None:
        return self._watch.info.rank if self._watch.info is not None else None

    @property
    def info(self) -> RunInfo | None:
        """The watched rank's identity and run dir (``None`` when attach was disabled)."""
        return self._watch.info

    # -- starting and stopping (attach, close) ----------------------------------------------------------
    def start(self, control_interval_s: float = 1.0, debug_server_port: int | None = None,
              debug_server_host: str | None = None) -> None:  # fmt: skip
        """Follow the steps written, poll the control file, and start the debug server when asked
        (opt-in). Never raises: a failure is one line and a counter."""
        watch = self._watch
        if watch._writer is not None:
            watch._writer.observers.append(self._observe)
        info = watch.info
        if info is None:
            return
        if control_interval_s:
            try:
                from stragglerwatch.runtime.controls.controlfile import ControlFile

                self._file = ControlFile(self, info.run_dir, info.rank, control_interval_s, self.problems,
                                         run_id=info.run_id)
                self._file.start()
            except Exception as exc:
                self.problems.report("control", f"control file: cannot follow it ({type(exc).__name__}: {exc})")
        if debug_server_port is None and not _torch_debug_server_running():
            return  # opt-in: nothing registered in torch, no port
        try:
            from stragglerwatch.runtime.controls import debugserver, debugstack

            debugserver.register(self)  # the worker handler, for our debug server or the user's own
            if debug_server_port is not None:
                self.debug_server = debugstack.start(self, port=debug_server_port,
                                                     host=debug_server_host or "127.0.0.1")  # fmt: skip
        except Exception as exc:
            self.problems.report("debug-server", f"debug server: {type(exc).__name__}: {exc}; training goes on")

    def close(self) -> None:
        """Stop the control-file thread and the debug server (``Watch.close``)."""
        self._closed = True
        if self._watch._probe is not None:  # a probe paused now must never resume after close
            self._watch._probe.recording = False
        for part in (self._file, self.debug_server):
            if part is not None:
                try:
                    part.close()
                except Exception as exc:
                    self.problems.report("close", f"close: {type(part).__name__}: {type(exc).__name__}: {exc}")
        try:
            from stragglerwatch.runtime.controls import debugserver

            debugserver.unregister(self)
        except Exception:
            pass

    def _observe(self, records: list[Any]) -> None:
        for r in records:
            self._recent.append((int(r.step), float(r.step_s), float(r.busy_s)))

    # -- settings -------------------------------------------------------------------------------------
    @property
    def watched(self) -> bool:
        w = self._watch
        return w.enabled and w._probe is not None and not self._closed

    def settings(self) -> dict[str, Any]:
        """The settings in force: ``recording`` (wanted) and ``recording_now`` (applied at a step end),
        the watchdog's (``watchdog_timeout_s``: None is adaptive; ``watchdog_threshold_s``: the value in
        force now), ``flush_interval_s``."""
        w = self._watch
        probe, wd, writer = w._probe, w._watchdog, w._writer
        out: dict[str, Any] = {
            "recording": bool(probe.recording) if probe is not None else False,
            "recording_now": bool(probe is not None and probe.enabled and not probe.paused),
            "watchdog": "off (turned off at attach)" if wd is None else ("adaptive" if not wd.timeout_s else "fixed"),
            "watchdog_timeout_s": 0 if wd is None else (wd.timeout_s or None),
            "watchdog_threshold_s": None,
            "flush_interval_s": writer.flush_interval_s if writer is not None else None,
        }
        if wd is not None:
            try:
                out["watchdog_threshold_s"] = round(float(wd.threshold()), 3)
            except Exception:  # the deque of recent steps changed while read: ask again next time
                pass
        return out

    def apply(self, settings: Mapping[str, Any], source: str = "api") -> dict[str, Any]:
        """Validate ``settings`` (e.g. ``{"watchdog_timeout_s": "3", "recording": "off"}``) and apply
        them all, or none when any is wrong. Returns ``applied`` (the new values), ``errors`` (one line
        each) and ``settings`` (all of them now). Never raises."""
        try:
            return self._apply(settings, source)
        except Exception as exc:  # a bug of ours must not reach the caller's thread (a server, the loop)
            self.problems.report("control", f"runtime control failed: {type(exc).__name__}: {exc}")
            return {"applied": {}, "errors": [f"internal error: {type(exc).__name__}: {exc}"], "settings": {}}

    def _apply(self, settings: Mapping[str, Any], source: str) -> dict[str, Any]:
        values, errors = parse_settings(settings)
        w = self._watch
        if not self.watched:
            errors = ["this rank is not watched (attach was disabled or failed, or the Watch is closed)"]
        elif "watchdog_timeout_s" in values and w._watchdog is None:
            errors.append("the watchdog was turned off at attach (watchdog_timeout_s=0) and cannot be turned on "
                          "at run time: attach with watchdog_timeout_s=None (adaptive) or a number of seconds")
        rank = w.info.rank if w.info is not None else "?"
        with self._lock:
            if errors:
                self.rejected += 1
                self.problems.report("control", f"rank {rank}: runtime control refused ({source}): {'; '.join(errors)}")
                return {"applied": {}, "errors": errors, "settings": self.settings()}
            before = self.settings()
            for key, value in values.items():
                if key == "recording":
                    w._probe.recording = value  # type: ignore[union-attr]
                elif key == "watchdog_timeout_s":
                    w._watchdog.timeout_s = value  # type: ignore[union-attr]
                elif key == "flush_interval_s":
                    w._writer.set_flush_interval(value)  # type: ignore[union-attr]
                self.changes += 1
                old = before["watchdog_timeout_s"] if key == "watchdog_timeout_s" else before.get(key)
                when = " (from the next step end)" if key == "recording" else ""
                self.problems.logger.log(logging.WARNING, "stragglerwatch: rank %s: %s %s -> %s%s (runtime control, "
                                         "%s)", rank, key, show(key, old), show(key, value), when, source)  # fmt: skip
            return {"applied": {k: values[k] for k in values}, "errors": [], "settings": self.settings()}

    # -- the live state -------------------------------------------------------------------------------
    def _stall_state(self) -> dict[str, Any]:
        wd = self._watch._watchdog
        if wd is None:
            return {"watchdog": False, "stalled": False, "stalls": 0, "latest": None}
        path = wd.events.path
        try:
            st = path.stat()
            key = (st.st_size, st.st_mtime_ns)
        except OSError:
            key = None
        cached_key, latest = self._stall_cache
        if key is not None and key != cached_key:
            latest = latest_stall(path)
            self._stall_cache = (key, latest)
        return {"watchdog": True, "stalled": bool(wd.stalled), "stalls": sum(wd.timeouts_by_phase.values()),
                "latest": latest}  # fmt: skip

    def _recent_figures(self) -> dict[str, Any] | None:
        recent = list(self._recent)
        if not recent:
            return None
        steps, step_s, busy_s = zip(*recent, strict=True)
        ratios = [b / s for s, b in zip(step_s, busy_s, strict=True) if s > 0]
        return {"steps": len(recent), "first_step": steps[0], "last_step": steps[-1],
                "step_s_median": statistics.median(step_s), "busy_s_median": statistics.median(busy_s),
                "busy_share_median": statistics.median(ratios) if ratios else None}  # fmt: skip

    def state(self) -> dict[str, Any]:
        """This rank's live state as one JSON-ready dict (no NaN): identity, where the training thread
        is (``step``, ``phase``, ``phase_s`` seconds in it), ``latest`` (the last step written) and
        ``recent`` (medians of the last 50 written), ``stall`` (stalled now; the latest stall and its
        diagnosis: culprit and victim ranks), ``settings``, ``stats`` (``Watch.stats()``), the
        collectives issued per process group, and the counts of runtime changes."""
        w = self._watch
        info = w.info
        out: dict[str, Any] = {"schema": "stragglerwatch-state", "version": VERSION, "time": time.time(),
                               "pid": os.getpid(), "watched": self.watched}  # fmt: skip
        if info is not None:
            out.update(run_id=info.run_id, rank=info.rank, world_size=info.world_size, host=info.host,
                       restart=info.restart, attach=info.attach)  # fmt: skip
        probe = w._probe
        if probe is not None:
            step, phase, since = probe.where
            out.update(step=step, phase=phase, phase_s=round(time.perf_counter() - since, 3),
                       phase_since=w._wall_anchor + since, steps=probe.steps)  # fmt: skip
        out["latest"] = w.latest()
        out["recent"] = self._recent_figures()
        out["stall"] = self._stall_state()
        out["settings"] = self.settings()
        out["stats"] = w.stats()
        try:
            from stragglerwatch.runtime.hangs.peers import collective_counts

            out["collectives"] = collective_counts() if probe is not None else {}
        except Exception:
            out["collectives"] = {}
        server = self.debug_server
        out["controls"] = {"changes": self.changes, "rejected": self.rejected,
                           "control_file": self._file.describe() if self._file is not None else None,
                           "debug_server": server.describe() if server is not None else None}  # fmt: skip
        return clean(out)
