"""The event log: writing, crash safety, and reading bad run dirs with clear messages."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import fake_step

from stragglerwatch import RunDirError, RunDirWarning, load_run
from stragglerwatch.cli.commands import main as cli_main
from stragglerwatch.record.schema import RUN_COLUMNS, SCHEMA_VERSION
from stragglerwatch.record.steplog import log_path
from stragglerwatch.runtime.output.writer import EventLogWriter


def write_steps(
    run_dir: Path, rank: int, n: int, busy: float = 0.01, close: bool = True, attach: int = 0
) -> EventLogWriter:
    w = EventLogWriter(log_path(run_dir, rank), rank, wall_anchor=1e9, flush_interval_s=60, attach=attach)
    t = 100.0
    for s in range(n):
        m = fake_step(s, t, busy=busy)
        w.submit(m)
        t = m.end
    if close:
        w.close()
    else:
        w.flush()
    return w


def test_roundtrip_and_compaction(make_run) -> None:
    run = make_run(2)
    write_steps(run, 0, 5)
    write_steps(run, 1, 5, busy=0.02)
    assert sorted(p.name for p in run.glob("rank-*.parquet")) == ["rank-00000.parquet", "rank-00001.parquet"]
    assert not list(run.glob("*.arrows")), "close() compacts the stream into Parquet"
    df = load_run(run)
    assert list(df.columns) == list(RUN_COLUMNS)
    assert df.groupby("rank")["step"].agg(list).to_dict() == {0: list(range(5)), 1: list(range(5))}
    assert set(df["world_size"]) == {2}
    assert df.groupby("rank")["busy_s"].median().round(4).to_dict() == {0: 0.01, 1: 0.02}
    assert (df["step_s"] - df["busy_s"]).round(6).eq(0.005).all()
    meta = pq.read_schema(run / "rank-00000.parquet").metadata
    assert meta[b"stragglerwatch.schema_version"] == SCHEMA_VERSION.encode()


def test_duckdb_reads_the_logs(make_run) -> None:
    duckdb = pytest.importorskip("duckdb")
    run = make_run(2)
    write_steps(run, 0, 4)
    write_steps(run, 1, 4)
    rows = duckdb.sql(
        f"select rank, count(*) from read_parquet('{run}/rank-*.parquet') group by rank order by rank"
    ).fetchall()
    assert rows == [(0, 4), (1, 4)]


def test_open_stream_is_readable_while_running(make_run) -> None:
    run = make_run(1)
    w = write_steps(run, 0, 7, close=False)
    assert (run / "rank-00000.arrows").exists()
    assert len(load_run(run)) == 7
    w.close()


def test_truncated_stream_keeps_complete_batches(make_run) -> None:
    run = make_run(1)
    w = EventLogWriter(log_path(run, 0), 0, 0.0, flush_interval_s=60)
    t = 0.0
    for batch in range(3):
        for s in range(4):
            m = fake_step(batch * 4 + s, t)
            w.submit(m)
            t = m.end
        w.flush()
    path = run / "rank-00000.arrows"
    size = path.stat().st_size
    with open(path, "r+b") as f:  # cut the last batch in half, as a kill mid-write would
        f.truncate(size - 200)
    with pytest.warns(RunDirWarning, match=r"rank-00000.arrows: truncated after 8 steps"):
        df = load_run(run)
    assert df["step"].tolist() == list(range(8))


def test_foreign_and_other_version_files_are_named_and_skipped(make_run) -> None:
    run = make_run(3)
    write_steps(run, 0, 3)
    (run / "rank-00001.arrows").write_bytes(b"this is not arrow at all")
    other = pa.schema([("rank", pa.int32())], metadata={b"stragglerwatch.schema_version": b"9.0"})
    pq.write_table(pa.table({"rank": [2]}, schema=other), run / "rank-00002.parquet")
    with pytest.warns(RunDirWarning) as record:
        df = load_run(run)
    messages = " | ".join(str(w.message) for w in record)
    assert "rank-00001.arrows: skipped: not an Arrow stream" in messages
    assert "rank-00002.parquet: skipped: schema version 9.0" in messages
    assert "no steps from rank(s) 1, 2 of 3" in messages
    assert df["rank"].unique().tolist() == [0]


def test_missing_run_meta_warns_and_infers_world(make_run) -> None:
    run = make_run(2)
    write_steps(run, 0, 2)
    write_steps(run, 1, 2)
    (run / "run.json").unlink()
    with pytest.warns(RunDirWarning, match="run.json: missing"):
        df = load_run(run)
    assert set(df["world_size"]) == {2}


def test_not_a_run_dir(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="not a directory"):
        load_run(tmp_path / "nope")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(RunDirError, match="not a stragglerwatch run dir"):
        load_run(tmp_path)


def test_empty_run_has_columns_and_no_rows(make_run) -> None:
    run = make_run(2)
    df = load_run(run)
    assert len(df) == 0 and list(df.columns) == list(RUN_COLUMNS)


def test_write_failure_is_one_line_and_a_counter(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    w = EventLogWriter(blocker / "rank-00000.arrows", 0, 0.0, flush_interval_s=60)
    w.submit(fake_step(0, 0.0))
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        w.flush()
        w.submit(fake_step(1, 1.0))
        w.flush()  # second failure: counted, not said again
        w.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "stragglerwatch"]
    assert len(lines) == 1 and "cannot write" in lines[0] and "\n" not in lines[0]
    assert w.write_errors >= 2 and w.dropped_steps == 2 and w.steps_written == 0


def test_second_attach_in_same_run_dir_appends_a_segment(make_run) -> None:
    run = make_run(1)
    write_steps(run, 0, 2)
    assert log_path(run, 0).name == "rank-00000.1.arrows"
    write_steps(run, 0, 3, attach=1)  # what a second attach() in the process writes
    df = load_run(run)
    assert not df.duplicated(["rank", "restart", "attach", "step"]).any()
    assert df.groupby("attach")["step"].agg(list).to_dict() == {0: [0, 1], 1: [0, 1, 2]}


def test_cli_summary_and_errors(make_run, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    run = make_run(3)
    for rank in range(3):
        write_steps(run, rank, 6, busy=0.03 if rank == 1 else 0.01)
    assert cli_main(["summary", str(run)]) == 0
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if s.split()[:1] == ["1"])
    assert "3.00x" in line
    assert cli_main(["summary", str(run), "--format", "json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 3 and data["steps"] == 6
    assert max(data["ranks"], key=lambda r: r["busy_vs_peers"])["rank"] == 1
    # one figure, one name: summary's rows are analyze's report's, the same numbers
    assert cli_main(["analyze", str(run), "--format", "json"]) == 0
    assert data["ranks"] == json.loads(capsys.readouterr().out)["ranks"]
    assert cli_main(["summary", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("stragglerwatch: error:") and len(err.strip().splitlines()) == 1
    # a run dir of garbage is bad input, as analyze has it: exit 2, its files named
    for f in [*run.glob("rank-*.arrows"), *run.glob("rank-*.parquet")]:
        f.write_bytes(b"garbage")
    assert cli_main(["summary", str(run)]) == 2
    assert cli_main(["analyze", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("empty run (no step recorded yet)"), err


def test_stream_compacted_while_listing_is_read_from_parquet(make_run) -> None:
    from stragglerwatch.record.steplog import _read_log

    run = make_run(1)
    w = write_steps(run, 0, 4, close=False)
    stream = run / "rank-00000.arrows"
    w.close()  # compacts: the stream a reader listed a moment ago is gone
    assert not stream.exists()
    table = _read_log(stream, ["rank", "step"])
    assert table is not None and table.num_rows == 4
