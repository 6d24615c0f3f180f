"""The one record schema every part reads: a rank's anatomy of one optimizer step.

Design: the hot path never builds these records. Probes only append raw time
marks (see ``timing``); the event-log thread turns resolved marks into
``StepRecord`` tuples with :func:`stragglerwatch.runtime.capture.timing.anatomy` and writes them
as Arrow record batches with :data:`STEP_SCHEMA`. ``load_run`` returns the same
columns plus ``world_size``.

Versioning: ``SCHEMA_VERSION`` is ``MAJOR.MINOR``. Readers accept any minor
version of their major (new columns are additive) and refuse other majors; a
column an older minor version lacks is derived from what it has
(:func:`upgrade`). 1.1 added ``collective_wait_s``, ``eval_s`` and ``comm_wait_s``:
before it, the gradient all-reduce was the only communication subtracted. 1.2 added
``restart`` and ``attach``: a record is identified by (rank, restart, attach, step). 1.3 added the
``gap_*_s`` columns: the time no probe timed, by where in the step it lies (older logs read NaN). 1.4
added ``work`` and ``work_unit``: the work the rank did in the step (elements or tokens of its training
micro-batches, or what the loop noted), which tells load imbalance from a straggler, and
``work_elements``: the elements of those micro-batches' input shapes, padding included, which the
compute follows under dynamic padding (never replaced by what the loop noted); older logs read NaN,
"" and NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pyarrow as pa

from stragglerwatch.record import arrowcols

SCHEMA_VERSION = "1.4"
SCHEMA_MAJOR = SCHEMA_VERSION.split(".")[0]
META_KEY = b"stragglerwatch.schema_version"

#: The phases that partition a step. ``allreduce_wait``: DDP's exposed gradient all-reduce;
#: ``collective_wait``: every other collective the step blocked in (DDP's buffer broadcast,
#: SyncBatchNorm, the loop's own); ``eval``: evaluation passes (forwards without grad).
PHASES = ("data_wait", "forward", "backward", "allreduce_wait", "collective_wait", "eval", "optimizer", "other")
#: Column name of each phase's duration.
PHASE_COLUMNS = tuple(f"{p}_s" for p in PHASES)
#: The phases that are communication: ``comm_wait_s`` is their sum, and busy time excludes them.
COMM_PHASES = ("allreduce_wait", "collective_wait")
#: Phases that are not the rank's own training work: excluded from busy time.
NOT_BUSY_PHASES = (*COMM_PHASES, "eval")
#: Where in a step the time no probe timed lies (it is ``other``, or the data wait inferred from the
#: gap before the first forward when no fetch is timed): before a forward (the step's start, the
#: end of a micro-batch's backward), between a forward and its backward, between the last backward
#: and the optimizer, after an optimizer step.
GAPS = ("before_forward", "forward_backward", "backward_optimizer", "after_optimizer")
#: Column name of each gap's seconds.
GAP_COLUMNS = tuple(f"gap_{g}_s" for g in GAPS)
#: How each gap is said in reports.
GAP_TEXT = {
    "before_forward": "before the forward",
    "forward_backward": "between forward and backward",
    "backward_optimizer": "between backward and the optimizer",
    "after_optimizer": "after the optimizer",
}


class StepRecord(NamedTuple):
    """One rank's step. Durations in seconds; ``start_time`` in Unix seconds."""

    rank: int
    step: int
    start_time: float
    data_wait_s: float
    forward_s: float
    backward_s: float
    allreduce_wait_s: float
    collective_wait_s: float
    eval_s: float
    optimizer_s: float
    other_s: float
    step_s: float
    busy_s: float  # step_s - comm_wait_s - eval_s: the straggler signal
    comm_wait_s: float  # all exposed communication: allreduce_wait_s + collective_wait_s
    micro_batches: int
    timing: str  # "host" or "cuda": which clock measured the compute phases
    bucket_index: list[int]
    bucket_ready_s: list[float]  # seconds after step start when each bucket's grads were ready
    bucket_allreduce_s: list[float]  # seconds from bucket ready to its all-reduce done
    restart: int = 0  # torchrun's restart count of the worker group (TORCHELASTIC_RESTART_COUNT)
    attach: int = 0  # the process's earlier attach() calls: steps count from 0 again at each
    gap_before_forward_s: float = 0.0  # untimed time before a forward (data wait when no fetch is timed)
    gap_forward_backward_s: float = 0.0  # untimed time between a forward's end and the backward
    gap_backward_optimizer_s: float = 0.0  # untimed time between the backward and the optimizer
    gap_after_optimizer_s: float = 0.0  # untimed time after an optimizer step
    work: float = float("nan")  # units of work in the step, summed over its training micro-batches; NaN: not measured
    work_unit: str = ""  # "elements", "tokens" or the unit the loop noted; "" when not measured
    work_elements: float = float("nan")  # elements of the training micro-batches' input shapes; NaN: not measured


STEP_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32()),
        pa.field("step", pa.int64()),
        pa.field("start_time", pa.float64()),
        *(pa.field(c, pa.float64()) for c in PHASE_COLUMNS),
        pa.field("step_s", pa.float64()),
        pa.field("busy_s", pa.float64()),
        pa.field("comm_wait_s", pa.float64()),
        pa.field("micro_batches", pa.int32()),
        pa.field("timing", pa.string()),
        pa.field("bucket_index", pa.list_(pa.int32())),
        pa.field("bucket_ready_s", pa.list_(pa.float64())),
        pa.field("bucket_allreduce_s", pa.list_(pa.float64())),
        pa.field("restart", pa.int32()),
        pa.field("attach", pa.int32()),
        *(pa.field(c, pa.float64()) for c in GAP_COLUMNS),
        pa.field("work", pa.float64()),
        pa.field("work_unit", pa.string()),
        pa.field("work_elements", pa.float64()),
    ],
    metadata={META_KEY: SCHEMA_VERSION.encode()},
)

assert tuple(STEP_SCHEMA.names) == StepRecord._fields  # noqa: S101 - schema and record must agree

#: Columns of ``load_run``'s frame (the record plus ``world_size``).
RUN_COLUMNS = (*StepRecord._fields, "world_size")


def records_to_batch(records: list[StepRecord]) -> pa.RecordBatch:
    """Columnar batch of records, in the order given."""
    columns = list(zip(*records, strict=True)) if records else [() for _ in StepRecord._fields]
    return arrowcols.batch(columns, STEP_SCHEMA)


def schema_compatible(schema: pa.Schema) -> str | None:
    """None when a file with this schema can be read, else the reason it cannot."""
    try:
        return _compatible(schema)
    except (UnicodeDecodeError, ValueError, TypeError) as exc:  # a damaged schema block
        return f"unreadable schema ({type(exc).__name__})"


def _compatible(schema: pa.Schema) -> str | None:
    meta = schema.metadata or {}
    version = meta.get(META_KEY)
    if version is None:
        return "not a stragglerwatch step log (no schema version)"
    major = version.decode(errors="replace").split(".")[0]
    if major != SCHEMA_MAJOR:
        return f"schema version {version.decode(errors='replace')} (this reader: {SCHEMA_VERSION})"
    present = set(schema.names)  # a list built again at every access
    missing = [n for n in STEP_SCHEMA.names if n not in present and n not in _DERIVED]
    if missing:
        return f"missing columns {missing}"
    return None


#: Columns added after 1.0, and how a file without them is read: before 1.1 only the
#: gradient all-reduce was subtracted, and evaluation was not told apart; before 1.2 a
#: run had one attempt; before 1.3 where the untimed time lay was not recorded (NaN: unknown); before
#: 1.4 the work of a step was not measured.
_DERIVED = {
    "collective_wait_s": lambda t: pa.array(np.zeros(t.num_rows)),
    "eval_s": lambda t: pa.array(np.zeros(t.num_rows)),
    "comm_wait_s": lambda t: t["allreduce_wait_s"],
    "restart": lambda t: pa.array(np.zeros(t.num_rows, dtype=np.int32)),
    "attach": lambda t: pa.array(np.zeros(t.num_rows, dtype=np.int32)),
    **{c: (lambda t: pa.array(np.full(t.num_rows, np.nan))) for c in GAP_COLUMNS},
    "work": lambda t: pa.array(np.full(t.num_rows, np.nan)),
    "work_unit": lambda t: pa.repeat(pa.scalar("", pa.string()), t.num_rows),
    "work_elements": lambda t: pa.array(np.full(t.num_rows, np.nan)),
}


def upgrade(table: pa.Table, names: list[str]) -> pa.Table:
    """``table`` (of any readable minor version) with the columns ``names``, in that order."""
    have = set(table.column_names)
    for name in names:
        if name not in have:
            table = table.append_column(STEP_SCHEMA.field(name), _DERIVED[name](table))
    return table if table.column_names == list(names) else table.select(names)


def read_columns(file_names: list[str], wanted: list[str]) -> list[str]:
    """The columns to read from a file with ``file_names`` to derive ``wanted``."""
    need = set(wanted)
    if "comm_wait_s" in need and "comm_wait_s" not in file_names:
        need.add("allreduce_wait_s")
    return [n for n in file_names if n in need]
