"""The code-sample stream of a run dir: where in the code each rank's training thread was.

Design: the code sampler (``codesampler.py``) counts, per window of a few seconds, how often the
training thread was seen at each code location in each phase; each window becomes rows of
:data:`CODE_SCHEMA` appended to ``code-NNNNN.arrows`` and compacted to Parquet at close, as the
context stream is (``context.py``). A row: the window (``t0``..``t1``, Unix seconds; the steps
``step0``..``step1`` it saw), the phase the probes were in, the location (``site``: the innermost
frame of the user's own code, as ``path:line function``; ``leaf``: the innermost frame of all,
which may be a library's), whether the thread was inside a native call there (``native``: Python
cannot see further), the samples at that key and all samples of the window (``total``).
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from stragglerwatch.record import arrowcols
from stragglerwatch.record.steplog import RunDirWarning, compact_stream, log_files, read_arrow_stream
from stragglerwatch.record.streams import read_segment, segment_path, version_problem

if TYPE_CHECKING:  # a DataFrame only for who reads it: the training process never imports pandas
    import pandas as pd

CODE_VERSION = "1.0"
CODE_KEY = b"stragglerwatch.code_version"
CODE_NAME = re.compile(r"^code-(\d+)(?:\.(\d+))?\.(arrows|parquet)$")
CODE_SCHEMA = pa.schema(
    [
        ("rank", pa.int32()), ("t0", pa.float64()), ("t1", pa.float64()), ("step0", pa.int64()),
        ("step1", pa.int64()), ("phase", pa.string()), ("site", pa.string()), ("leaf", pa.string()),
        ("native", pa.bool_()), ("samples", pa.int32()), ("total", pa.int32()),
    ],
    metadata={CODE_KEY: CODE_VERSION.encode()},
)  # fmt: skip
COLUMNS = tuple(CODE_SCHEMA.names)


def code_path(run_dir: Path, rank: int) -> Path:
    """A fresh segment name for this rank's code samples (a second attach appends a segment)."""
    return segment_path(run_dir, "code", rank)


def rows_to_batch(rows: list[dict[str, Any]]) -> pa.RecordBatch:
    return arrowcols.batch([[r[f.name] for r in rows] for f in CODE_SCHEMA], CODE_SCHEMA)


def _problem(schema: pa.Schema) -> str | None:
    problem = version_problem(schema, CODE_KEY, CODE_VERSION, "code-sample")
    missing = [n for n in COLUMNS if n not in schema.names]
    return problem or (f"missing columns {missing}" if missing else None)


def read_stream(path: Path, quiet: bool = False) -> pa.Table | None:
    """A code-sample stream's readable batches (up to a batch cut short by a crash)."""
    warn = (lambda m: None) if quiet else (lambda m: warnings.warn(m, RunDirWarning, stacklevel=4))
    return read_arrow_stream(path, _problem, warn, "code samples")


def compact(stream: Path) -> None:
    compact_stream(stream, lambda p: _quiet_read(p))


def _quiet_read(path: Path) -> pa.Table | None:
    try:
        return read_stream(path, quiet=True)
    except FileNotFoundError:
        return None


def _read(path: Path) -> pa.Table | None:
    return read_segment(path, _problem, read_stream)


def load_code(run_dir: str | os.PathLike[str], ranks: Iterable[int] | None = None) -> pd.DataFrame:
    """The code-sample rows of a run dir (:data:`COLUMNS`), of every rank or of ``ranks`` (only
    their files are read); empty (with those columns) when there are none (an older run, or
    sampling was off)."""
    path = Path(run_dir)
    wanted = None if ranks is None else {int(r) for r in ranks}
    tables = []
    for f in log_files(path, CODE_NAME) if path.is_dir() else []:
        match = CODE_NAME.match(f.name)
        if wanted is not None and (match is None or int(match.group(1)) not in wanted):
            continue
        table = _read(f)
        if table is not None and table.num_rows:
            tables.append(table.select(list(COLUMNS)))
    if not tables:
        return CODE_SCHEMA.empty_table().to_pandas()
    return pa.concat_tables(tables).to_pandas().sort_values(["rank", "t0"], kind="stable").reset_index(drop=True)
