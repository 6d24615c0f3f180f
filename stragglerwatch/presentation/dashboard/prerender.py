"""The page's content made ahead of the page's next refresh.

A flush reaches the page after the source's next poll, the source's update, the page's next refresh and the
figures. Made at the refresh, the figures (a few tenths of a second at thousands of ranks) come on top of the wait
for it; made as soon as the source holds the new analysis, for the rank the page last showed of that source, they
are ready when the page asks, or being made, and the page waits for them instead of making them again. Sources no
page asked for in :data:`KEEP_S` are no longer followed, and the thread ends when none is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from stragglerwatch.presentation.dashboard.sources import Snapshot

#: A source no page asked for in this long is no longer followed.
KEEP_S = 60.0
#: How often the thread looks at the followed sources' snapshots (a comparison of version numbers).
LOOK_S = 0.02


class Prerender:
    """``make(snapshot, rank)`` (``app.render``) of each followed source's newest snapshot, made on a thread of its
    own as soon as the source holds it."""

    def __init__(self, make: Callable[[Snapshot, Any], dict[str, Any]], look_s: float = LOOK_S,
                 keep_s: float = KEEP_S) -> None:  # fmt: skip
        self._make, self._look_s, self._keep_s = make, look_s, keep_s
        self._lock = threading.Lock()
        self._made: dict[str, tuple[tuple[int, Any], Future]] = {}  # per source: the content's key and its making
        self._asked: dict[str, tuple[Any, Any, float]] = {}  # per source: the source, the rank asked, when
        self._thread: threading.Thread | None = None

    def content(self, source: Any, snapshot: Snapshot, rank: Any) -> dict[str, Any]:
        """``make(snapshot, rank)``: the one made ahead where it is of this snapshot's version and this rank (waited
        for while it is being made), else made here; ``source`` (its ``label`` and ``snapshot()``) is then
        followed, for this rank."""
        with self._lock:
            self._asked[source.label] = (source, rank, time.monotonic())
            made, mine = self._claim(source.label, (snapshot.version, rank))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stragglerwatch-dashboard-prerender",
                                                daemon=True)  # fmt: skip
                self._thread.start()
        if mine:
            self._fill(source.label, made, snapshot, rank)
        return made.result()

    def made(self, label: str) -> tuple[tuple[int, Any], Future] | None:
        """The newest content of a source (its key, ``(version, rank)``, and its making), if any."""
        with self._lock:
            return self._made.get(label)

    def _claim(self, label: str, key: tuple[int, Any]) -> tuple[Future, bool]:
        """The making of ``key``'s content, and whether it is the caller's to make (under the lock)."""
        held = self._made.get(label)
        if held is not None and held[0] == key:
            return held[1], False
        future: Future = Future()
        self._made[label] = (key, future)
        return future, True

    def _fill(self, label: str, future: Future, snapshot: Snapshot, rank: Any) -> None:
        try:
            future.set_result(self._make(snapshot, rank))
        except Exception as exc:  # the page shows the callback's error, as if made there; the next ask tries again
            future.set_exception(exc)
            with self._lock:
                if self._made.get(label, (None, None))[1] is future:
                    del self._made[label]

    def _run(self) -> None:
        while True:
            time.sleep(self._look_s)
            with self._lock:
                now = time.monotonic()
                for label in [k for k, (_, _, at) in self._asked.items() if now - at > self._keep_s]:
                    del self._asked[label]
                    self._made.pop(label, None)
                if not self._asked:
                    self._thread = None
                    return
                followed = list(self._asked.values())
            for source, rank, _ in followed:
                snapshot = source.snapshot()
                with self._lock:
                    made, mine = self._claim(source.label, (snapshot.version, rank))
                if mine:
                    self._fill(source.label, made, snapshot, rank)
