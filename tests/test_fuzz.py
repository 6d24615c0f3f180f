"""Property-based fuzzing of every reader and parser: whatever the input, a reader returns, skips
and names what it cannot read, or raises its one documented error; never anything else."""

from __future__ import annotations

import io
import os
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import stragglerwatch
from stragglerwatch.evidence.torchlogs import parse_files, parse_lines
from stragglerwatch.evidence.traces import REQUIRED, TraceError, analyze_trace, read_meta
from stragglerwatch.record.events import read_events
from stragglerwatch.record.rundir import read_rank_meta, read_run_meta
from stragglerwatch.record.schema import STEP_SCHEMA, StepRecord, records_to_batch
from stragglerwatch.record.steplog import RunDirError

FUZZ = settings(
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", 60)),  # more, and FUZZ_RANDOM=1, to explore
    derandomize=not os.environ.get("FUZZ_RANDOM"),  # in CI the same examples every run: no flake
    database=None,  # nothing written into the working tree
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
REAL_LOG = Path(__file__).parent / "data" / "pytorch-logs" / "real-excerpts.log"


def record(step: int) -> StepRecord:
    return StepRecord(0, step, 1e9, *([0.001] * 8), 0.01, 0.01, 0.0, 1, "host", [], [], [])


def valid_stream() -> bytes:
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, STEP_SCHEMA) as writer:
        for k in range(3):
            writer.write_batch(records_to_batch([record(3 * k + i) for i in range(3)]))
    return sink.getvalue()


STREAM = valid_stream()


def mutated(data: bytes) -> st.SearchStrategy[bytes]:
    """``data`` cut short, with bytes flipped, or with garbage spliced in."""
    cut = st.integers(0, len(data)).map(lambda n: data[:n])
    flips = st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(0, 255)), min_size=1, max_size=8).map(
        lambda fs: bytes(_flip(bytearray(data), fs))
    )
    splice = st.tuples(st.integers(0, len(data)), st.binary(max_size=64)).map(
        lambda t: data[: t[0]] + t[1] + data[t[0] :]
    )
    return st.one_of(cut, flips, splice, st.binary(max_size=512))


def _flip(buf: bytearray, flips: list[tuple[int, int]]) -> bytearray:
    for i, v in flips:
        buf[i] = v
    return buf


def load_quietly(run: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            df = stragglerwatch.load_run(run)
        except RunDirError:
            return
    assert df["step"].notna().all()


@FUZZ
@given(stream=mutated(STREAM), meta=st.binary(max_size=200))
def test_step_log_and_metadata(stream: bytes, meta: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "rank-00000.arrows").write_bytes(stream)
        (run / "rank-00001.parquet").write_bytes(stream[: len(stream) // 2])
        (run / "run.json").write_bytes(meta)
        (run / "rank-00000.json").write_bytes(meta[::-1])
        load_quietly(run)
        assert read_run_meta(run) is None or isinstance(read_run_meta(run), dict)
        assert isinstance(read_rank_meta(run), dict)


@FUZZ
@given(lines=st.lists(st.one_of(st.text(max_size=120), st.binary(max_size=120).map(lambda b: b.decode("latin-1"))),
                      max_size=20))  # fmt: skip
def test_events_jsonl(lines: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "events-00000.jsonl").write_text("\n".join(lines), encoding="utf-8", errors="surrogateescape")
        events, bad = read_events(run)
        assert all(isinstance(e, dict) and "kind" in e and "rank" in e for e in events)
        assert len(events) + bad <= sum(1 for line in "\n".join(lines).splitlines() if line.strip()), "each line once"


REAL_LINES = REAL_LOG.read_text().splitlines()


@FUZZ
@given(lines=st.lists(st.one_of(st.text(max_size=200), st.sampled_from(REAL_LINES),
                                st.tuples(st.sampled_from(REAL_LINES), st.integers(0, 300), st.text(max_size=8)).map(
                                    lambda t: t[0][: t[1]] + t[2] + t[0][t[1]:])), max_size=30))  # fmt: skip
def test_pytorch_logs(lines: list[str]) -> None:
    parsed = parse_lines(lines)
    assert parsed.lines == len(lines) and parsed.skipped <= len(lines)
    parsed.first_failure()
    with tempfile.NamedTemporaryFile("wb", suffix=".log", delete=False) as f:
        f.write("\n".join(lines).encode("utf-8", "surrogatepass") + bytes(range(256)))
    parse_files([f.name])


columns = st.fixed_dictionaries({
    "dp_rank": st.lists(st.integers(-2, 3), min_size=1, max_size=24),
    "stage": st.lists(st.integers(-1, 3), min_size=1, max_size=24),
    "rank": st.lists(st.integers(-1, 8), min_size=1, max_size=24),
    "step": st.lists(st.integers(0, 3), min_size=1, max_size=24),
    "optype": st.lists(st.sampled_from(["forward-compute", "backward-compute", "optimizer", "send-forward",
                                        "recv-backward", "all-gather", "x"]), min_size=1, max_size=24),
    "start_ts": st.lists(st.one_of(st.floats(-1e3, 1e6), st.just(float("nan"))), min_size=1, max_size=24),
    "duration": st.lists(st.one_of(st.floats(-1.0, 1e3), st.sampled_from([float("nan"), float("inf")])),
                         min_size=1, max_size=24),
    "seq_id": st.lists(st.integers(0, 5), min_size=1, max_size=24),
})  # fmt: skip


@FUZZ
@given(cols=columns, drop=st.sets(st.sampled_from(REQUIRED), max_size=2), meta=st.text(max_size=120))
def test_traces_and_meta(cols: dict[str, list], drop: set[str], meta: str) -> None:
    n = min(len(v) for v in cols.values())
    frame = pd.DataFrame({k: np.array(v[:n]) for k, v in cols.items() if k not in drop})
    with tempfile.TemporaryDirectory() as tmp:
        trace, meta_path = Path(tmp) / "trace.parquet", Path(tmp) / "meta.yaml"
        frame.to_parquet(trace)
        meta_path.write_text(meta + "\ndp_size: 2\npp_size: 2\nworld_size: 4\n")
        try:
            analyze_trace(trace, meta_path)
        except TraceError:
            pass
        (Path(tmp) / "bad.yaml").write_text(meta)
        try:
            read_meta(Path(tmp) / "bad.yaml")
        except TraceError:
            pass


def test_fuzzers_reach_both_outcomes() -> None:
    """The generators are not all rejected: a clean stream reads whole, a cut one in part."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        (run / "rank-00000.arrows").write_bytes(STREAM)
        assert len(stragglerwatch.load_run(run)) == 9
        (run / "rank-00000.arrows").write_bytes(STREAM[: len(STREAM) - 40])
        with pytest.warns(stragglerwatch.RunDirWarning, match="truncated"):
            assert 0 < len(stragglerwatch.load_run(run)) < 9


def test_damaged_rank_or_world_size_cannot_exhaust_memory(tmp_path: Path) -> None:
    """Found by the fuzzer: a damaged rank (or world size) made the reader list every rank up to it."""
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, STEP_SCHEMA) as writer:
        writer.write_batch(records_to_batch([record(0), record(1)._replace(rank=2**31 - 1)]))
    (tmp_path / "rank-00000.arrows").write_bytes(sink.getvalue())
    (tmp_path / "run.json").write_text('{"world_size": 1000000000000, "run_id": "x"}')
    with pytest.warns(stragglerwatch.RunDirWarning, match="rank out of range"):
        df = stragglerwatch.load_run(tmp_path)
    assert df["rank"].tolist() == [0] and read_run_meta(tmp_path) is None
