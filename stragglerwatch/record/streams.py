"""Appending record batches to a rank's Arrow IPC stream in the run dir, for the samplers.

Design: a stream is opened at its first batch, under a fresh segment name (a second attach, or a
stream deleted under us, starts a new segment); each batch is flushed at once, so a crash loses
only what was not handed over yet; ``finish`` closes the stream and compacts it to Parquet (as the
step log is, ``eventlog.compact_stream``). A failure of ours closes the stream and is reported
through ``fail`` (one line, a counter: the sampler decides); the next batch tries a new segment.
Not thread-safe: the caller holds its own lock.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stragglerwatch.record.steplog import RunDirWarning


def version_problem(schema: pa.Schema, key: bytes, version: str, noun: str) -> str | None:
    """None when a stream of ``schema`` can be read by a reader of ``version`` (``MAJOR.MINOR``, kept
    in the metadata under ``key``; any minor of its major), else why not."""
    try:
        found = (schema.metadata or {}).get(key)
        if found is None:
            return f"not a stragglerwatch {noun} stream (no {noun} schema version)"
        text = found.decode(errors="replace")
    except (UnicodeDecodeError, ValueError, TypeError) as exc:
        return f"unreadable schema ({type(exc).__name__})"
    if text.split(".")[0] != version.split(".")[0]:
        return f"{noun} schema version {text} (this reader: {version})"
    return None


def segment_path(run_dir: Path, prefix: str, rank: int) -> Path:
    """A fresh segment name ``<prefix>-NNNNN[.k].arrows`` for a rank's stream (a second attach, or a
    stream deleted under us, appends a segment; a compacted segment keeps its name taken)."""
    n = 0
    while True:
        stem = f"{prefix}-{rank:05d}" + (f".{n}" if n else "")
        if not (run_dir / f"{stem}.arrows").exists() and not (run_dir / f"{stem}.parquet").exists():
            return run_dir / f"{stem}.arrows"
        n += 1


class SegmentAppender:
    """Batches of ``schema`` appended to ``new_path()``'s stream (opened at the first batch)."""

    def __init__(self, new_path: Callable[[], Path], schema: pa.Schema, fail: Callable[[str], None]):
        self._new_path = new_path
        self._schema = schema
        self._fail = fail
        self._file: Any = None
        self._writer: pa.RecordBatchStreamWriter | None = None
        self.path: Path | None = None

    @property
    def file(self) -> Any:
        """The open stream's file object (None when none is open)."""
        return self._file

    def append(self, batch: pa.RecordBatch) -> None:
        try:
            if self._writer is not None and self.path is not None and not self.path.exists():
                self._abandon()  # deleted under us: a new segment
            if self._writer is None:
                self.path = self._new_path()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = open(self.path, "wb")  # noqa: SIM115 - lives as long as the sampler
                self._writer = pa.ipc.new_stream(self._file, self._schema)
            self._writer.write_batch(batch)
            self._file.flush()
        except Exception as exc:
            self._abandon()
            self._fail(f"cannot write {self.path}: {type(exc).__name__}: {exc}")

    def finish(self, compact: Callable[[Path], None]) -> None:
        """Close the stream and compact it; raises what compaction raises."""
        if self._writer is None:
            return
        path = self.path
        self._writer.close()
        self._file.close()
        self._writer = self._file = None
        if path is not None:
            compact(path)

    def _abandon(self) -> None:
        for closable in (self._writer, self._file):
            try:
                if closable is not None:
                    closable.close()
            except Exception:
                pass
        self._writer = self._file = None


def read_segment(
    path: Path, problem: Callable[[pa.Schema], str | None], read_stream: Callable[[Path], pa.Table | None]
) -> pa.Table | None:
    """One segment of a sampler's stream, as an Arrow stream (``read_stream``) or as the Parquet
    file it was compacted to (meanwhile, perhaps); None, with a warning, for a file ``problem``
    refuses or that cannot be read."""
    if path.suffix == ".arrows":
        try:
            return read_stream(path)
        except FileNotFoundError:  # compacted while the dir was listed
            path = path.with_suffix(".parquet")
    try:
        reason = problem(pq.read_schema(path))
        if reason:
            warnings.warn(f"{path}: skipped: {reason}", RunDirWarning, stacklevel=3)
            return None
        return pq.read_table(path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        warnings.warn(f"{path}: skipped: unreadable Parquet ({exc})", RunDirWarning, stacklevel=3)
        return None
