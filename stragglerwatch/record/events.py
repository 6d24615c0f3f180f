"""The events file of a rank, ``events-NNNNN.jsonl``: stalls, diagnoses, recoveries and shutdowns,
one JSON object a line. :class:`EventFile` appends (flushed at once, each write bounded in time: a
stalled filesystem costs the watchdog at most :data:`BOUNDED_WRITE_S`), :func:`read_events` reads a
run's events back (a damaged line is skipped and counted), :func:`latest_stall` reads a rank's latest
stall from the file's tail.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

#: The most a write of an event waits when the training thread makes it (close, SIGTERM, an exception).
BOUNDED_WRITE_S = 1.0


class EventFile:
    """Append-only JSON Lines file of a rank's events, flushed and synced at every write.

    A write with ``timeout_s`` (one made on the training thread) runs on a thread of its own and
    is waited for at most that long; while a write that did not return is still stuck (a
    filesystem that does not answer), later ones are counted as errors, not waited for."""

    def __init__(self, path: Path):
        self.path = path
        self.errors = 0
        self._lock = threading.Lock()
        self._stuck: threading.Thread | None = None

    def write(self, event: dict[str, Any], timeout_s: float | None = None) -> None:
        line = json.dumps(event, default=str) + "\n"
        if timeout_s is None:
            self._append(line)
            return
        if self._stuck is not None and self._stuck.is_alive():
            self.errors += 1
            return
        writer = threading.Thread(target=self._append, args=(line,), name="stragglerwatch-event-write", daemon=True)
        writer.start()
        writer.join(timeout_s)
        if writer.is_alive():
            self._stuck = writer
            self.errors += 1

    def _append(self, line: str) -> None:
        with self._lock:
            try:
                with open(self.path, "a", encoding="utf-8") as f:
                    f.write(line)
                    f.flush()
                    os.fsync(f.fileno())
            except OSError:
                self.errors += 1


def read_events(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """Every event of a run dir, and how many lines could not be read (skipped)."""
    events, bad = [], 0
    for path in sorted(run_dir.glob("events-*.jsonl")):
        try:
            lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            bad += 1
            continue
        for line in lines:
            if not line.strip():
                continue  # a blank line holds nothing to lose
            try:
                ev = json.loads(line)
            except ValueError:
                bad += 1  # a line cut by a kill, or garbage
                continue
            if isinstance(ev, dict) and "kind" in ev and "rank" in ev:
                events.append(ev)
            else:
                bad += 1
    return events, bad


def latest_stall(path: Path, tail_bytes: int = 1 << 20) -> dict[str, Any] | None:
    """The last ``stall`` event in an events file (without its stacks), its ``diagnosis`` and whether
    a ``recovery`` followed; None when the file holds none. Reads at most the last ``tail_bytes``."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            f.seek(max(0, size - tail_bytes))
            data = f.read()
    except OSError:
        return None
    lines = data.split(b"\n")
    if size > tail_bytes:
        lines = lines[1:]  # cut in the middle
    events = []
    for line in lines:
        if b'"stall' not in line and b'"diagnosis"' not in line and b'"recovery"' not in line:
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            events.append(ev)
    stalls = [e for e in events if e.get("kind") == "stall"]
    if not stalls:
        return None
    stall = stalls[-1]
    sid = stall.get("id")
    out = {k: stall.get(k) for k in ("id", "step", "phase", "since", "detected_at", "waited_s", "threshold_s")}
    diagnosis = [e for e in events if e.get("kind") == "diagnosis" and e.get("stall_id") == sid]
    out["diagnosis"] = (
        {k: diagnosis[-1].get(k) for k in ("culprit_ranks", "victim_ranks", "silent_ranks", "basis", "evidence",
                                           "hang_step", "hang_phase", "mismatch_suspected")}  # fmt: skip
        if diagnosis
        else None
    )
    recovery = [e for e in events if e.get("kind") == "recovery" and e.get("stall_id") == sid]
    out["recovered"] = bool(recovery)
    out["stalled_s"] = recovery[-1].get("stalled_s") if recovery else None
    return out
