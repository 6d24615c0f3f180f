"""The step log read back: :func:`load_run` (a run dir into one frame), the readers underneath it
(``run_files``, ``read_log``, ``conform``, ``world_size``), the unit of a run's ``work`` column
(``work_unit``), and the compaction of a stream into Parquet (``compact_stream``).

A rank's log is ``rank-NNNNN.arrows`` (an Arrow IPC stream, one record batch a flush, while the rank
runs; written by ``stragglerwatch.runtime.output.writer``) and ``rank-NNNNN.parquet`` once compacted (written
to a temporary name and renamed atomically), so finished runs are read natively by DuckDB and Spark.
A batch cut in half by a crash is detected and dropped with a warning; a damaged or foreign file is
skipped with a :class:`RunDirWarning`, never a traceback.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from stragglerwatch.record.rundir import MAX_RANKS, RUN_META, read_run_meta
from stragglerwatch.record.schema import (
    RUN_COLUMNS,
    STEP_SCHEMA,
    read_columns,
    schema_compatible,
    upgrade,
)

if TYPE_CHECKING:  # a DataFrame only for who reads it: the training process never imports pandas
    import pandas as pd

LOG_NAME = re.compile(r"^rank-(\d+)(?:\.(\d+))?\.(arrows|parquet)$")


class RunDirError(Exception):
    """A path that cannot be read as a run dir; the message is one line for the user."""


class RunDirWarning(UserWarning):
    """A file of a run dir that was skipped or read only in part."""


def log_path(run_dir: Path, rank: int) -> Path:
    """A fresh segment name for this rank (a second attach in the same run dir appends a segment)."""
    base = f"rank-{rank:05d}"
    n = 0
    while True:
        stem = base if n == 0 else f"{base}.{n}"
        if not (run_dir / f"{stem}.arrows").exists() and not (run_dir / f"{stem}.parquet").exists():
            return run_dir / f"{stem}.arrows"
        n += 1


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def compact_stream(stream_path: Path, read: Callable[[Path], pa.Table | None] | None = None) -> None:
    """The stream as Parquet, crash-safe: written under a temporary name and fsynced, renamed,
    the directory fsynced, and only then the stream removed. A crash at any point leaves the
    stream, the Parquet file, or both (readers prefer the Parquet file); never neither.
    ``read``: the stream's reader (default the step log's)."""
    table = read(stream_path) if read is not None else _read_stream(stream_path, quiet=True)
    if table is None:
        return
    final = stream_path.with_suffix(".parquet")
    tmp = final.with_name(final.name + ".tmp")
    pq.write_table(table, tmp)
    _fsync_path(tmp)
    os.replace(tmp, final)
    _fsync_path(final.parent)
    stream_path.unlink()


# -- reading ---------------------------------------------------------------


def _warn(message: str) -> None:
    warnings.warn(message, RunDirWarning, stacklevel=3)


def read_arrow_stream(
    path: Path, check: Callable[[pa.Schema], str | None], warn: Callable[[str], None], noun: str = "steps"
) -> pa.Table | None:
    """The readable batches of an Arrow IPC stream (up to a batch cut short by a crash); None for a
    stream ``check`` refuses (its message is warned) or that is not one. FileNotFoundError passes."""
    batches = []
    try:
        # memory-mapped: batches point into the file, so a damaged length can never make the
        # reader allocate more than the file holds
        with pa.memory_map(str(path), "r") as src:
            reader = pa.ipc.open_stream(src)
            problem = check(reader.schema)
            if problem:
                warn(f"{path}: skipped: {problem}")
                return None
            try:
                for batch in reader:
                    batch.validate(full=True)  # a batch whose bytes were damaged is where the readable part ends
                    batches.append(batch)
            except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
                warn(f"{path}: truncated after {sum(len(b) for b in batches)} {noun} (rank killed?): {exc}")
            return pa.Table.from_batches(batches, schema=reader.schema)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError, EOFError, ValueError) as exc:
        if path.stat().st_size == 0:
            return None  # created, nothing flushed yet
        warn(f"{path}: skipped: not an Arrow stream ({exc})")
        return None


def _read_stream(path: Path, quiet: bool = False, warn: Callable[[str], None] = _warn) -> pa.Table | None:
    return read_arrow_stream(path, schema_compatible, (lambda message: None) if quiet else warn)


def _read_log(path: Path, columns: list[str], warn: Callable[[str], None] = _warn) -> pa.Table | None:
    if path.suffix == ".parquet":
        return _read_parquet(path, columns, warn)
    try:
        return _read_stream(path, warn=warn)
    except FileNotFoundError:  # compacted to Parquet by its rank's close() while we listed the dir
        twin = path.with_suffix(".parquet")
        return _read_parquet(twin, columns, warn) if twin.exists() else None


def _read_parquet(path: Path, columns: list[str] | None = None, warn: Callable[[str], None] = _warn
                  ) -> pa.Table | None:  # fmt: skip
    try:
        with pq.ParquetFile(path) as log:  # its footer parsed once (``read_table`` would again, and cost more)
            file_schema = log.schema_arrow
            problem = schema_compatible(file_schema)
            if problem:
                warn(f"{path}: skipped: {problem}")
                return None
            wanted = read_columns(file_schema.names, columns) if columns is not None else None
            table = log.read(columns=wanted)
    except (pa.ArrowException, OSError, ValueError) as exc:
        warn(f"{path}: skipped: unreadable Parquet ({exc})")
        return None
    return table


def log_files(run_dir: Path, pattern: re.Pattern[str] = LOG_NAME) -> list[Path]:
    """The step logs of a run dir (a segment compacted to Parquet is read once); ``pattern``: the
    file names of another stream (its group 3 the suffix)."""
    return [Path(run_dir) / name for name in log_names(run_dir, pattern)]


def log_names(run_dir: str | os.PathLike[str], pattern: re.Pattern[str] = LOG_NAME) -> list[str]:
    """:func:`log_files`' names, sorted (a live view lists thousands every update: Path objects cost 10x)."""
    found: dict[str, str] = {}
    for name in sorted(os.listdir(run_dir)):
        match = pattern.match(name)
        if match:
            stem = name.rsplit(".", 1)[0]
            if match.group(3) == "parquet" or stem not in found:
                found[stem] = name
    return sorted(found.values())


@dataclass
class RunLogs:
    """The readable step logs of a run dir, as Arrow tables (one or more per rank)."""

    path: Path
    world_size: int
    tables: list[pa.Table]
    schema: pa.Schema


def log_columns(columns: Sequence[str] | None) -> list[str]:
    """The step-log columns to read for ``columns`` (``rank`` and ``step`` always; None: all)."""
    names = list(STEP_SCHEMA.names)
    if columns is None:
        return names
    unknown = sorted(set(columns) - set(RUN_COLUMNS))
    if unknown:
        raise ValueError(f"unknown columns {unknown}")
    return [n for n in names if n in ("rank", "step") or n in columns]


def read_log(f: Path, names: list[str], warn: Callable[[str], None] = _warn) -> pa.Table | None:
    """One step log's readable records with the columns ``names`` (validated, upgraded to this
    schema, damaged ranks dropped), or None; every problem is one ``warn`` line."""
    return conform(_read_log(f, names, warn), names, f, warn)


@functools.lru_cache(maxsize=32)
def _schema(names: tuple[str, ...]) -> pa.Schema:
    return pa.schema([STEP_SCHEMA.field(n) for n in names])


def conform(table: pa.Table | None, names: list[str], f: Path, warn: Callable[[str], None] = _warn) -> pa.Table | None:
    """A table read from the step log ``f`` with the columns ``names`` of this schema (upgraded, cast,
    damaged ranks dropped), or None when it has no record it can give."""
    if table is None or not table.num_rows:
        return None
    schema = _schema(tuple(names))
    try:
        table = upgrade(table, names)
        if not table.schema.equals(schema):  # a log of this version already is (a cast would copy it)
            table = table.cast(schema)
    except (pa.ArrowException, ValueError, KeyError) as exc:
        warn(f"{f}: skipped: its columns cannot be read as a step log ({exc})")
        return None
    lo, hi = pc.min_max(table["rank"]).values()  # one pass where every rank is in range (the usual log)
    if lo.as_py() is not None and lo.as_py() >= 0 and hi.as_py() < MAX_RANKS:
        return table
    valid = pc.and_(pc.greater_equal(table["rank"], 0), pc.less(table["rank"], MAX_RANKS))
    if not pc.all(valid).as_py():
        warn(f"{f}: {table.num_rows - pc.sum(valid).as_py()} record(s) skipped: rank out of range (damaged)")
        table = table.filter(valid)
    return table


def run_files(run_dir: str | os.PathLike[str]) -> tuple[Path, dict | None, list[Path]]:
    """A run dir's path, its run metadata and its step logs (raises ``RunDirError``)."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RunDirError(f"{path}: not a directory")
    meta = read_run_meta(path)
    files = log_files(path)
    if meta is None and not files:
        raise RunDirError(f"{path}: not a stragglerwatch run dir (no {RUN_META}, no rank-*.arrows/.parquet)")
    if meta is None:
        _warn(f"{path / RUN_META}: missing or unreadable; world size taken from the ranks' step logs")
    return path, meta, files


def world_size(path: Path, meta: dict | None, ranks: set[int], warn: Callable[[str], None] = _warn) -> int:
    """The run's world size (from its metadata, else the logs); warns of ranks with no steps."""
    world = int(meta["world_size"]) if meta else (max(ranks) + 1 if ranks else 0)
    present = {r for r in ranks if r < world}
    if world > len(present) and ranks:
        first = list(itertools.islice((r for r in range(world) if r not in present), 10))
        more = world - len(present) - len(first)
        shown = ", ".join(map(str, first)) + (f" and {more} more" if more else "")
        warn(f"{path}: no steps from rank(s) {shown} of {world}")
    return world


def read_logs(
    run_dir: str | os.PathLike[str],
    columns: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RunLogs:
    """Read (and validate) every step log of a run dir; see :func:`load_run`."""
    path, meta, files = run_files(run_dir)
    names = log_columns(columns)
    tables = []
    ranks: set[int] = set()
    for i, f in enumerate(files):
        table = read_log(f, names)
        if table is not None:
            tables.append(table)
            ranks.update(pc.unique(table["rank"]).to_pylist())
        if progress:
            progress(i + 1, len(files))
    world = world_size(path, meta, ranks)
    return RunLogs(path, world, tables, pa.schema([STEP_SCHEMA.field(n) for n in names]))


def load_run(
    run_dir: str | os.PathLike[str],
    columns: Sequence[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> pd.DataFrame:
    """One row per (rank, restart, attach, step) of a run dir: the step anatomy plus ``world_size``.
    Steps count from 0 in each attempt (``restart``, ``attach``); ``analyze`` numbers them on.

    ``columns`` limits what is read (``rank`` and ``step`` always are): the
    per-bucket list columns are costly in pandas for large runs. ``progress`` is
    called as ``progress(files_read, files_total)``.

    Raises :class:`RunDirError` for a path that is not a run dir; files that are
    truncated, foreign or of another schema version are skipped or read in part
    with a :class:`RunDirWarning` that names them.
    """
    logs = read_logs(run_dir, columns, progress)
    frame = (pa.concat_tables(logs.tables) if logs.tables else logs.schema.empty_table()).to_pandas()
    frame["world_size"] = logs.world_size
    order = [c for c in ("restart", "attach", "step", "rank") if c in frame.columns]
    frame = frame.sort_values(order, kind="stable").reset_index(drop=True)
    return frame[[c for c in RUN_COLUMNS if c in frame.columns]]


def _units(f: Path) -> pa.Array | None:
    """The ``work_unit`` column of one step log, read alone (a stream's batches are not validated:
    a damaged one ends the read); None when it has none."""
    try:
        if f.suffix == ".parquet":
            schema = pq.read_schema(f)
            if schema_compatible(schema) or "work_unit" not in schema.names:
                return None
            return pq.read_table(f, columns=["work_unit"])["work_unit"].combine_chunks()
        chunks = []
        with pa.memory_map(str(f), "r") as src:
            reader = pa.ipc.open_stream(src)
            if schema_compatible(reader.schema) or "work_unit" not in reader.schema.names:
                return None
            try:
                chunks += [batch.column("work_unit") for batch in reader]
            except (pa.ArrowException, OSError, EOFError, ValueError):
                pass  # cut short by a crash: what came before counts
        return pa.concat_arrays(chunks) if chunks else None
    except FileNotFoundError:  # compacted to Parquet while we listed the dir
        twin = f.with_suffix(".parquet")
        return _units(twin) if f.suffix == ".arrows" and twin.exists() else None
    except (pa.ArrowException, OSError, EOFError, ValueError):
        return None


def work_unit(run_dir: str | os.PathLike[str]) -> str | None:
    """The unit of the run's ``work`` column: the most common non-empty ``work_unit`` of its step
    logs (only that column is read), None when no step's work was measured (or no log is readable)."""
    path = Path(run_dir)
    if not path.is_dir():
        return None
    counts: dict[str, int] = {}
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # Arrow reads without the GIL
        read = list(pool.map(_units, log_files(path)))
    for units in read:
        if units is not None:
            count_units(units, counts)
    return most_common_unit(counts)


def count_units(units: pa.Array | pa.ChunkedArray, counts: dict[str, int]) -> None:
    """Add the non-empty values of a ``work_unit`` column to ``counts``."""
    for row in pc.value_counts(units).to_pylist():
        if row["values"]:
            counts[row["values"]] = counts.get(row["values"], 0) + row["counts"]


def most_common_unit(counts: dict[str, int]) -> str | None:
    """The unit most records named (:func:`count_units`), the greater name on a tie; None: none named one."""
    return max(counts, key=lambda u: (counts[u], u)) if counts else None
