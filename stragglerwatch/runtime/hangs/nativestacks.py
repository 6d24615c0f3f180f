"""Stacks of a rank stuck in native code while it holds the GIL: then no Python thread runs, so
:class:`NativeStacks` keeps ``faulthandler`` armed on a timer that a thread of its own re-arms twice a
second; when the timer fires (that thread could not run for a whole timeout), every thread's stack goes
to ``stacks-NNNNN.txt``. What :meth:`NativeStacks.collect` returns says when each dump was written:
faulthandler's first line of a dump, ``Timeout (0:00:04)!``, gets ``dumped at <Unix seconds>``
appended (``analysis.hangs`` matches a dump to its stall by it).

faulthandler's dump reads the threads' frames without the GIL. That is safe only while the GIL is held
elsewhere (every Python frame then stands still); while Python code runs, a frame it reads may be
freed under it, and the process dies (SIGSEGV: a deep call stack popped meanwhile does it). So the timer
must never fire while Python runs: it is re-armed by a thread that does nothing else, which only a held
GIL (or a process given no CPU for the whole timeout) keeps from running, and it fires once per arming.
"""

from __future__ import annotations

import faulthandler
import os
import threading
from pathlib import Path
from typing import Any

#: How faulthandler's dump begins: ``Timeout (0:00:04)!`` (the timeout it was armed with).
HEADER = "Timeout ("
#: How often the keeper thread re-arms the timer (at most: a quarter of the timeout if that is shorter).
REARM_S = 0.5


class NativeStacks:
    """Stacks of a rank stuck in native code holding the GIL, where no Python thread can run.

    :meth:`arm` sets the timeout (the watchdog's stall threshold and more) and starts a thread that
    re-arms ``faulthandler.dump_traceback_later`` every :data:`REARM_S` (or a quarter of the timeout,
    if shorter). If that thread cannot run for a whole timeout (the GIL is held), faulthandler's C
    thread writes every thread's stack to ``stacks-NNNNN.txt``, once; the thread arms it again as soon
    as it runs. It used to be re-armed by the watchdog's own loop, which a slow look at the rank
    (``/proc`` of a compile's many children) or a blocking store call could hold up for longer than the
    timeout while the training thread ran Python: the dump then raced it, and a rank died compiling.
    ``collect`` returns what the dumps added, each one stamped with when it was written, once the rank
    runs again; if it never does, the file is the evidence.

    A fork must not happen while the timer is armed: faulthandler's timer thread does not exist
    in the child, and the child's exit (which cancels the timer) would wait for it forever. So
    :meth:`before_fork` disarms it (holding the lock that arming takes, across the fork) and
    :meth:`after_fork_in_parent` arms it again."""

    def __init__(self, path: Path):
        self.path = path
        self._file: Any = None
        self._timeout_s: float | None = None  # the timer armed now, if any
        self._wanted: tuple[float, bool] | None = None  # what the keeper re-arms: (timeout, exit); None: paused
        self._seen = 0  # the file's bytes collected so far
        self._marks: list[tuple[int, float]] = []  # (the file's size, its modification time) after each dump
        self._lock = threading.Lock()
        self._rearm = False  # armed when a fork began: armed again after it, in the parent
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self.rearms = 0

    def arm(self, timeout_s: float, exit: bool = False) -> None:
        """Dump every thread's stack if no Python thread could run for ``timeout_s``; with ``exit``, then end
        the process with status 1 (faulthandler's): for ``on_hang="abort"``, a rank stuck in native code
        holding the GIL cannot run anything of ours, and would otherwise wait for its launcher's SIGKILL.
        Kept armed from now on (:meth:`pause` or :meth:`cancel` end that)."""
        with self._lock:
            if self._file is None:
                self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - faulthandler writes to its fd
                self._seen = self.path.stat().st_size
            changed = self._wanted != (timeout_s, exit) or self._timeout_s is None
            self._wanted = (timeout_s, exit)
            if changed:
                self._set()
            if self._keeper is None or not self._keeper.is_alive():
                self._stop.clear()
                self._keeper = threading.Thread(target=self._keep, name="stragglerwatch-native-stacks", daemon=True)
                self._keeper.start()

    def _set(self) -> None:
        """Arm faulthandler's timer as wanted (the lock held): a fresh timeout from now."""
        if self._wanted is None:
            return
        self._mark()
        timeout_s, exit = self._wanted
        faulthandler.dump_traceback_later(timeout_s, repeat=False, file=self._file, exit=exit)
        self._timeout_s = timeout_s
        self.rearms += 1

    def _keep(self) -> None:
        """The keeper thread: re-arm while wanted. It does nothing else, so only a held GIL delays it."""
        while True:
            wanted = self._wanted
            interval = REARM_S if wanted is None else min(REARM_S, wanted[0] / 4)
            if self._stop.wait(interval):
                return
            try:
                with self._lock:
                    if self._wanted is not None and not self._stop.is_set():
                        self._set()
            except Exception:  # the file closed under us (cancel): nothing of ours to dump to
                return

    def collect(self) -> str | None:
        """What the dumps added since the last look, each stamped with when it was written; None: nothing."""
        if self._file is None:
            return None
        with self._lock:
            self._mark()
            marks, self._marks = self._marks, []
        if not marks or marks[-1][0] <= self._seen:
            return None
        end = marks[-1][0]
        with open(self.path, "rb") as f:
            f.seek(self._seen)
            data = f.read(end - self._seen)
        start, self._seen = self._seen, end
        return stamp(data, [(o - start, at) for o, at in marks])

    def _mark(self) -> None:
        """Note the file's end and when it was written, if a dump added to it (the lock held): one timer
        writes one dump, and this is looked at before each arming, so each mark ends one dump."""
        if self._file is None:
            return
        st = os.fstat(self._file.fileno())  # the open file: no path lookup on the run dir's filesystem
        last = self._marks[-1][0] if self._marks else self._seen
        if st.st_size > last:
            self._marks.append((st.st_size, st.st_mtime))

    def _disarm(self) -> None:
        if self._timeout_s is not None:
            faulthandler.cancel_dump_traceback_later()
            self._timeout_s = None

    def pause(self) -> None:
        """Disarm until the next ``arm`` (while the watchdog thread waits on purpose)."""
        with self._lock:
            self._wanted = None
            self._disarm()

    def cancel(self) -> None:
        self._stop.set()
        with self._lock:
            self._wanted = None
            self._disarm()
            if self._file is not None:
                self._file.close()
                self._file = None
        keeper = self._keeper
        if keeper is not None and keeper is not threading.current_thread():
            keeper.join(timeout=2.0)

    def before_fork(self) -> None:
        self._lock.acquire()
        self._rearm = self._timeout_s is not None
        self._disarm()

    def after_fork_in_parent(self) -> None:
        try:
            if self._rearm and self._file is not None:
                self._set()
        finally:
            self._lock.release()

    def after_fork_in_child(self) -> None:
        self._wanted = None  # the keeper thread is not in the child: nothing re-arms there
        self._lock.release()  # the child's copy, held by the thread that forked: this one


def stamp(data: bytes, marks: list[tuple[int, float]]) -> str:
    """``data`` (faulthandler's dumps) as text with ``dumped at <Unix seconds>`` on each dump's first line:
    a dump was written when the file was last modified before the first mark past its header (``marks``:
    the offsets into ``data`` where a dump ended, with that time). A piece before the first header (the
    end of a dump read in part last time) is left as it is."""
    out: list[str] = []
    offset, k = 0, 0
    for raw in data.splitlines(keepends=True):
        line = raw.decode("utf-8", errors="replace")
        if line.startswith(HEADER) and marks:
            while k < len(marks) - 1 and marks[k][0] <= offset:
                k += 1
            end = "\n" if line.endswith("\n") else ""
            line = f"{line.rstrip()} dumped at {marks[k][1]:.3f}{end}"
        out.append(line)
        offset += len(raw)
    return "".join(out)
