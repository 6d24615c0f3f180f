"""The context stream of a run dir: one row per rank and sample of its host and GPU context.

Design: beside each rank's step log (``rank-NNNNN.arrows``), the context sampler
(``sampler.py``) appends Arrow IPC record batches with :data:`CONTEXT_SCHEMA` to
``context-NNNNN.arrows``, compacted to ``context-NNNNN.parquet`` at close like the step log. Its
schema has its own version (``CONTEXT_VERSION``, ``MAJOR.MINOR``: readers accept any minor of
their major and fill a column an older minor lacks with its empty value). :func:`load_context`
reads every rank's stream back; files that are foreign, damaged or of another major version are
skipped (or read up to the damage) with a :class:`~stragglerwatch.record.steplog.RunDirWarning`.

Units: ratios are 0..1 (pressure: CPU, memory and, from 1.1, I/O; steal, run-queue wait, utilisation),
rates are per second over the interval since the rank's previous sample (``interval_s``), counters (ECC, PCIe replays,
NVLink errors, XID events) are cumulative as the device reports them, NaN is "not known here".
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from stragglerwatch.record import arrowcols
from stragglerwatch.record.steplog import RunDirWarning, compact_stream, log_files, read_arrow_stream
from stragglerwatch.record.streams import read_segment, segment_path, version_problem

if TYPE_CHECKING:  # a DataFrame only for who reads it: the training process never imports pandas
    import pandas as pd

CONTEXT_VERSION = "1.1"  # 1.1 added io_pressure
CONTEXT_KEY = b"stragglerwatch.context_version"
CONTEXT_NAME = re.compile(r"^context-(\d+)(?:\.(\d+))?\.(arrows|parquet)$")

_F, _I, _S = pa.float64(), pa.int32(), pa.string()
_FIELDS = [
    ("rank", _I), ("time", _F), ("interval_s", _F), ("sample_s", _F),
    # host: the machine, the rank's CPUs, its training (main) thread, its process, its children
    ("cpu_pressure", _F), ("memory_pressure", _F), ("load1", _F), ("cpus", _I), ("steal", _F),
    ("cores_busy", _F), ("affinity", _S), ("affinity_cpus", _I), ("run_delay", _F), ("invol_switches", _F),
    ("cpu_time", _F), ("workers", _I), ("workers_cpu_time", _F), ("workers_invol_switches", _F),
    ("swap_used_bytes", _F), ("mem_available_bytes", _F), ("io_pressure", _F),
    # GPU (gpu = -1: none): NVML index and UUID, as DCGM labels them
    ("gpu", _I), ("gpu_uuid", _S), ("sm_clock_mhz", _F), ("sm_clock_max_mhz", _F), ("clock_reasons", pa.int64()),
    ("temperature_c", _F), ("power_w", _F), ("power_limit_w", _F), ("gpu_util", _F), ("ecc_uncorrected", _F),
    ("ecc_corrected", _F), ("pcie_replays", _F), ("nvlink_errors", _F), ("xid_events", pa.int64()), ("xid", _I),
]  # fmt: skip
CONTEXT_SCHEMA = pa.schema(_FIELDS, metadata={CONTEXT_KEY: CONTEXT_VERSION.encode()})
COLUMNS = tuple(CONTEXT_SCHEMA.names)
#: A column's value where it is not known (also for columns an older minor version lacks).
EMPTY = {f.name: ("" if f.type == _S else (-1 if f.name in ("gpu", "clock_reasons") else 0))
         if not pa.types.is_floating(f.type) else float("nan") for f in CONTEXT_SCHEMA}  # fmt: skip


def context_path(run_dir: Path, rank: int) -> Path:
    """A fresh segment name for this rank's context (a second attach appends a segment)."""
    return segment_path(run_dir, "context", rank)


def rows_to_batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    """Sample rows (dicts; a missing key is its empty value) as one record batch."""
    return arrowcols.batch([[r.get(f.name, EMPTY[f.name]) for r in rows] for f in CONTEXT_SCHEMA], CONTEXT_SCHEMA)


def _problem(schema: pa.Schema) -> str | None:
    problem = version_problem(schema, CONTEXT_KEY, CONTEXT_VERSION, "context")
    return problem


def read_stream(path: Path, quiet: bool = False) -> pa.Table | None:
    """A context stream's readable batches (up to a batch cut short by a crash)."""
    warn = (lambda m: None) if quiet else (lambda m: warnings.warn(m, RunDirWarning, stacklevel=4))
    try:
        return read_arrow_stream(path, _problem, warn, "samples")
    except FileNotFoundError:  # compacted by its rank's close() meanwhile
        return None


def compact(stream: Path) -> None:
    """The stream as Parquet, crash-safe (as the step log's: temporary name, fsync, rename)."""
    compact_stream(stream, lambda p: read_stream(p, quiet=True))


def _read(path: Path) -> pa.Table | None:
    return read_segment(path, _problem, read_stream)


def context_files(run_dir: Path) -> list[Path]:
    return log_files(run_dir, CONTEXT_NAME)


def read_file(path: Path) -> pa.Table | None:
    """One context file's readable samples (a stream up to a batch cut short, or a compacted segment)."""
    return _read(path)


def as_schema(table: pa.Table, where: Path | str = "") -> pa.Table | None:
    """Samples read from a context file as :data:`CONTEXT_SCHEMA`'s columns (a column an older minor version
    lacks filled with its empty value); None, with a warning, when they cannot be."""
    for field in CONTEXT_SCHEMA:
        if field.name not in table.column_names:  # an older minor version
            table = table.append_column(field, pa.array([EMPTY[field.name]] * table.num_rows, type=field.type))
    try:
        return table.select(list(COLUMNS)).cast(CONTEXT_SCHEMA)
    except (pa.ArrowException, ValueError) as exc:
        warnings.warn(f"{where}: skipped: not readable as context ({exc})", RunDirWarning, stacklevel=3)
        return None


def schema_problem(schema: pa.Schema) -> str | None:
    """Why a context stream of ``schema`` cannot be read here (None: it can)."""
    return _problem(schema)


def load_context(run_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """Every rank's context samples of a run dir, sorted by rank and time (:data:`COLUMNS`);
    an empty frame with those columns when the run has none (an older run, or sampling was off)."""
    path = Path(run_dir)
    tables = []
    for f in context_files(path) if path.is_dir() else []:
        table = _read(f)
        if table is None or not table.num_rows:
            continue
        table = as_schema(table, f)
        if table is not None:
            tables.append(table)
    if not tables:
        return CONTEXT_SCHEMA.empty_table().to_pandas()
    frame = pa.concat_tables(tables).to_pandas()
    frame = frame[np.isfinite(frame["time"])]
    return frame.sort_values(["rank", "time"], kind="stable").reset_index(drop=True)


#: NVML's clock event reasons (``nvmlClocksEventReason*``, formerly ``nvmlClocksThrottleReason*``),
#: values as in nvml.h and the nvidia-ml-py bindings.
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


#: Reasons that hold the clock below what the work asks for (idle and display settings do not).
SLOWDOWNS = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown",
             "sync_boost", "applications_clocks_setting")  # fmt: skip


def decode_reasons(mask: int) -> list[str]:
    """The names of the clock event reasons set in ``mask`` (unknown bits as ``0x...``)."""
    if mask is None or mask < 0:
        return []
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])
