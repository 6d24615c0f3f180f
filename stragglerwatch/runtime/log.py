"""Runtime messages: the ``stragglerwatch`` logger, one line each, rate-limited per kind.

Design: a problem of ours at run time (a disk that fills, a port in use, a store that does
not answer) must reach the user once, as one line, and then be counted, not repeated every
second from a background thread. :class:`Problems` is one watched model's reporter: the
first message of a kind is logged, later ones within ``every_s`` are only counted, and the
next one logged says how many were not. Nothing here raises.
"""

from __future__ import annotations

import logging
import threading
import time

LOGGER = logging.getLogger("stragglerwatch")


class Problems:
    """Logs each kind of problem at most once per ``every_s`` seconds and counts them all."""

    def __init__(self, logger: logging.Logger = LOGGER, every_s: float = 60.0):
        self.logger = logger
        self.every_s = every_s
        self.counts: dict[str, int] = {}
        self._last: dict[str, float] = {}
        self._unsaid: dict[str, int] = {}
        self._lock = threading.Lock()

    def report(self, kind: str, message: str, level: int = logging.WARNING, key: str | None = None) -> None:
        """Count a problem of ``kind``; log ``message`` unless one of its kind (of its ``key`` within the kind,
        where given: two bad settings are two problems to say) was logged lately."""
        limit = kind if key is None else f"{kind}:{key}"
        with self._lock:
            now = time.monotonic()
            last = self._last.get(limit)
            if last is not None and now - last < self.every_s:
                self._unsaid[limit] = self._unsaid.get(limit, 0) + 1
                self.counts[kind] = self.counts.get(kind, 0) + 1
                return
            self._last[limit] = now
            unsaid = self._unsaid.pop(limit, 0)
        try:
            more = f" ({unsaid} more since the last message)" if unsaid else ""
            self.logger.log(level, "stragglerwatch: %s%s", message, more)
        except Exception:  # a broken logging handler of the application's is not our business
            pass
        finally:  # counted once said: whoever sees the count (``stats()``) finds its line logged
            with self._lock:
                self.counts[kind] = self.counts.get(kind, 0) + 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())
