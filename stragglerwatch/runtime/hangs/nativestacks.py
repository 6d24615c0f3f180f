"""Stacks of a rank stuck in native code while it holds the GIL: then no Python thread runs, the
watchdog's included, so :class:`NativeStacks` keeps ``faulthandler`` armed on a timer that the watchdog
re-arms while it can; when the timer fires, every thread's stack goes to ``stacks-NNNNN.txt``, and again
every period for as long as the watchdog cannot run. What :meth:`NativeStacks.collect` returns says when
each dump was written: faulthandler's first line of a dump, ``Timeout (0:00:04)!``, gets
``dumped at <Unix seconds>`` appended (``analysis.hangs`` matches a dump to its stall by it).
"""

from __future__ import annotations

import faulthandler
import os
import threading
import time
from pathlib import Path
from typing import Any

#: How faulthandler's dump begins: ``Timeout (0:00:04)!`` (the timeout it was armed with).
HEADER = "Timeout ("


class NativeStacks:
    """Stacks of a rank stuck in native code holding the GIL, where no Python thread can run.

    The watchdog thread re-arms ``faulthandler.dump_traceback_later`` about once a second with a
    timeout of its stall threshold; if it cannot run that long (the GIL is held), faulthandler's
    C thread writes every thread's stack to ``stacks-NNNNN.txt``, and again each timeout after that
    (``repeat``) until the watchdog runs and re-arms it: one dump does not leave the rank without a
    timer, so a hold that begins before the watchdog ran again (after an earlier hold, or a machine
    too loaded to run it) is dumped too. ``collect`` returns what the dumps added, each one stamped
    with when it was written, once the rank runs again; if it never does, the file is the evidence.

    A fork must not happen while the timer is armed: faulthandler's timer thread does not exist
    in the child, and the child's exit (which cancels the timer) would wait for it forever. So
    :meth:`before_fork` disarms it (holding the lock that arming takes, across the fork) and
    :meth:`after_fork_in_parent` arms it again."""

    def __init__(self, path: Path):
        self.path = path
        self._file: Any = None
        self._armed_at = -1e9
        self._timeout_s: float | None = None  # the timer armed now, if any
        self._period = 0.0  # the timeout of the last timer armed: the time between its dumps
        self._exit = False  # the timer also ends the process (``on_hang="abort"``)
        self._seen = 0
        self._lock = threading.Lock()
        self._rearm: float | None = None

    def arm(self, timeout_s: float, exit: bool = False) -> None:
        """Dump every thread's stack if not armed again within ``timeout_s``; with ``exit``, then end the
        process with status 1 (faulthandler's): for ``on_hang="abort"``, a rank stuck in native code holding
        the GIL cannot run anything of ours, and would otherwise wait for its launcher's SIGKILL."""
        with self._lock:
            now = time.monotonic()
            if now - self._armed_at < 1.0:
                return
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - faulthandler writes to its fd
                self._seen = self.path.stat().st_size
            faulthandler.dump_traceback_later(timeout_s, repeat=not exit, file=self._file, exit=exit)
            self._armed_at, self._timeout_s, self._exit, self._period = now, timeout_s, exit, timeout_s

    def collect(self) -> str | None:
        """What the dumps added since the last look, each stamped with when it was written; None: nothing."""
        if self._file is None:
            return None
        st = os.fstat(self._file.fileno())  # the open file: no path lookup on the run dir's filesystem
        if st.st_size <= self._seen:
            return None
        with open(self.path, "rb") as f:
            f.seek(self._seen)
            data = f.read(st.st_size - self._seen)  # up to the size whose modification time is st_mtime
        self._seen += len(data)
        return stamp(data.decode("utf-8", errors="replace"), st.st_mtime, self._period)

    def _disarm(self) -> None:
        if self._timeout_s is not None:
            faulthandler.cancel_dump_traceback_later()
            self._armed_at, self._timeout_s = -1e9, None

    def pause(self) -> None:
        """Disarm until the next ``arm`` (while the watchdog thread waits on purpose)."""
        with self._lock:
            self._disarm()

    def cancel(self) -> None:
        with self._lock:
            self._disarm()
            if self._file is not None:
                self._file.close()
                self._file = None

    def before_fork(self) -> None:
        self._lock.acquire()
        self._rearm = self._timeout_s
        self._disarm()

    def after_fork_in_parent(self) -> None:
        try:
            if self._rearm is not None and self._file is not None:
                faulthandler.dump_traceback_later(self._rearm, repeat=not self._exit, file=self._file, exit=self._exit)
                self._armed_at, self._timeout_s = time.monotonic(), self._rearm
        finally:
            self._lock.release()

    def after_fork_in_child(self) -> None:
        self._lock.release()  # the child's copy, held by the thread that forked: this one


def stamp(text: str, last_at: float, period: float) -> str:
    """``text`` (faulthandler's dumps) with ``dumped at <Unix seconds>`` on each dump's first line. The
    last dump ended at ``last_at`` (the file's modification time); one timer writes one dump each
    ``period`` seconds, so the one before it was written ``period`` earlier, and so on. A piece before
    the first header (the end of a dump read in part last time) is left as it is."""
    lines = text.splitlines(keepends=True)
    heads = [i for i, line in enumerate(lines) if line.startswith(HEADER)]
    for n, i in enumerate(heads):
        at = last_at - (len(heads) - 1 - n) * period
        end = "\n" if lines[i].endswith("\n") else ""
        lines[i] = f"{lines[i].rstrip()} dumped at {at:.3f}{end}"
    return "".join(lines)
