"""The one record schema every part reads: a rank's anatomy of one optimizer step.

Design: the hot path never builds these records. Probes only append raw time
marks (see ``timing``); the event-log thread turns resolved marks into
``StepRecord`` tuples with :func:`stragglerwatch.timing.anatomy` and writes them
as Arrow record batches with :data:`STEP_SCHEMA`. ``load_run`` returns the same
columns plus ``world_size``.

Versioning: ``SCHEMA_VERSION`` is ``MAJOR.MINOR``. Readers accept any minor
version of their major (new columns are additive) and refuse other majors.
"""

from __future__ import annotations

from typing import NamedTuple

import pyarrow as pa

SCHEMA_VERSION = "1.0"
SCHEMA_MAJOR = SCHEMA_VERSION.split(".")[0]
META_KEY = b"stragglerwatch.schema_version"

#: The phases that partition a step, in timeline order.
PHASES = ("data_wait", "forward", "backward", "allreduce_wait", "optimizer", "other")
#: Column name of each phase's duration.
PHASE_COLUMNS = tuple(f"{p}_s" for p in PHASES)


class StepRecord(NamedTuple):
    """One rank's step. Durations in seconds; ``start_time`` in Unix seconds."""

    rank: int
    step: int
    start_time: float
    data_wait_s: float
    forward_s: float
    backward_s: float
    allreduce_wait_s: float
    optimizer_s: float
    other_s: float
    step_s: float
    busy_s: float
    micro_batches: int
    timing: str  # "host" or "cuda": which clock measured the compute phases
    bucket_index: list[int]
    bucket_ready_s: list[float]  # seconds after step start when each bucket's grads were ready
    bucket_allreduce_s: list[float]  # seconds from bucket ready to its all-reduce done


STEP_SCHEMA = pa.schema(
    [
        pa.field("rank", pa.int32()),
        pa.field("step", pa.int64()),
        pa.field("start_time", pa.float64()),
        *(pa.field(c, pa.float64()) for c in PHASE_COLUMNS),
        pa.field("step_s", pa.float64()),
        pa.field("busy_s", pa.float64()),
        pa.field("micro_batches", pa.int32()),
        pa.field("timing", pa.string()),
        pa.field("bucket_index", pa.list_(pa.int32())),
        pa.field("bucket_ready_s", pa.list_(pa.float64())),
        pa.field("bucket_allreduce_s", pa.list_(pa.float64())),
    ],
    metadata={META_KEY: SCHEMA_VERSION.encode()},
)

assert tuple(STEP_SCHEMA.names) == StepRecord._fields  # noqa: S101 - schema and record must agree

#: Columns of ``load_run``'s frame (the record plus ``world_size``).
RUN_COLUMNS = (*StepRecord._fields, "world_size")


def records_to_batch(records: list[StepRecord]) -> pa.RecordBatch:
    """Columnar batch of records, in the order given."""
    columns = list(zip(*records, strict=True)) if records else [() for _ in StepRecord._fields]
    return pa.RecordBatch.from_arrays(
        [pa.array(col, type=f.type) for col, f in zip(columns, STEP_SCHEMA, strict=True)],
        schema=STEP_SCHEMA,
    )


def schema_compatible(schema: pa.Schema) -> str | None:
    """None when a file with this schema can be read, else the reason it cannot."""
    meta = schema.metadata or {}
    version = meta.get(META_KEY)
    if version is None:
        return "not a stragglerwatch step log (no schema version)"
    major = version.decode(errors="replace").split(".")[0]
    if major != SCHEMA_MAJOR:
        return f"schema version {version.decode(errors='replace')} (this reader: {SCHEMA_VERSION})"
    missing = [n for n in STEP_SCHEMA.names if n not in schema.names]
    if missing:
        return f"missing columns {missing}"
    return None
