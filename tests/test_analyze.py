"""``stragglerwatch analyze`` and ``simulate`` through the CLI, on real 4-rank gloo runs and simulated runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EXAMPLE, analyze_json, launch

from stragglerwatch.cli.commands import main as cli


def check_contract(report: dict, world: int) -> None:
    for key in ("world_size", "steps", "job_slowdown", "lost_seconds", "stragglers", "hangs", "ranks"):
        assert key in report
    assert report["world_size"] == world and len(report["ranks"]) == world
    assert report["hangs"] == []
    for s in report["stragglers"]:
        assert {"rank", "cause", "slowdown", "first_step", "last_step", "lost_seconds"} <= set(s)


@pytest.mark.distributed
def test_real_compute_straggler(compute_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = analyze_json(compute_run, capsys)
    check_contract(report, 4)
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(2, "compute")]
    s = report["stragglers"][0]
    assert abs(s["first_step"] - 10) <= 10 and s["detected_step"] <= 10 + 30
    assert s["slowdown"] > 1.5 and s["lost_seconds"] > 0.3
    assert report["job_slowdown"] > 1.2
    assert [r["flagged"] for r in report["ranks"]] == [False, False, True, False]
    # the code sampler (on by default) names the injection: the slow autograd function's sleeps
    assert s["code"], s["code_note"]
    site = s["code"][0]["site"]
    assert "demo_job.py" in site and site.split()[-1] in ("forward", "backward"), s["code"]


@pytest.mark.distributed
def test_real_data_straggler(data_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = analyze_json(data_run, capsys)
    check_contract(report, 4)
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(1, "data")]
    (s,) = report["stragglers"]
    assert abs(s["first_step"] - 15) <= 10
    assert s["code"] and s["code"][0]["site"].endswith("__iter__"), s["code"]  # the slow loader's sleep
    assert "demo_job.py" in s["code"][0]["site"] and s["code"][0]["native"]


@pytest.mark.distributed
@pytest.mark.parametrize("cause", ["optimizer", "other"])
def test_real_host_side_stragglers(cause: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    launch(4, EXAMPLE, "--steps", "50", "--slow-rank", "3", "--slowdown", "0.02", "--cause", cause,
             "--from-step", "5", "--run-dir", str(run))  # fmt: skip
    report = analyze_json(run, capsys)
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(3, cause)]


@pytest.mark.distributed
def test_real_healthy_run_has_no_flag(healthy_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = analyze_json(healthy_run, capsys)
    check_contract(report, 4)
    assert report["stragglers"] == [] and report["group_imbalance"] == []


@pytest.mark.distributed
def test_text_and_html_reports(compute_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["analyze", str(compute_run)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[2] == "1 straggler:" and "rank 2 is" in lines[3] and "compute" in text
    assert max(len(line) for line in lines) <= 80
    out = tmp_path / "r.html"
    assert cli(["analyze", str(compute_run), "--format", "html", "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "rank 2 is" in page
    assert "where in the code" in page and "demo_job.py" in page, "the straggler's code location"
    assert "code: of its extra" in text and "demo_job.py" in text
    assert page.count("Plotly.newPlot") == 4, "heatmap, breakdown, busy band and the straggler's host context"
    assert "<script src=" not in page, "self-contained: plotly.js inlined"


def test_simulate_then_analyze(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "sim"
    args = ["simulate", str(run), "--ranks", "48", "--steps", "300", "--straggler", "7:0.2:100:data",
            "--straggler", "30:0.12:50:optimizer:200", "--groups", "2"]  # fmt: skip
    assert cli(args) == 0
    truth = json.loads((run / "run.json").read_text())["simulation"]
    assert len(truth["injections"]) == 2
    report = analyze_json(run, capsys)
    check_contract(report, 48)
    got = {(s["rank"], s["cause"]) for s in report["stragglers"]}
    assert got == {(7, "data"), (30, "optimizer")}
    ended = next(s for s in report["stragglers"] if s["rank"] == 30)
    assert abs(ended["last_step"] - 199) <= 10
    assert {r["role"] for r in report["ranks"]} == {"group0", "group1"}


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["analyze", str(tmp_path / "missing")], "not a directory"),
        (["analyze", str(tmp_path)], "not a stragglerwatch run dir"),
        (["simulate", str(tmp_path / "x"), "--ranks", "4", "--steps", "10", "--straggler", "9:0.1"], "outside"),
        (["simulate", str(tmp_path / "x"), "--ranks", "4", "--steps", "10", "--straggler", "1:0.1:0:gpu"], "cause"),
        (["simulate", str(tmp_path / "x"), "--ranks", "0", "--steps", "10"], "at least 1"),
    ]
    for argv, needle in cases:
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("stragglerwatch: error:") and needle in err[0], err


def test_empty_and_unreadable_runs(make_run, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(2)
    assert cli(["analyze", str(run)]) == 2
    assert capsys.readouterr().err.strip().endswith("empty run (no step recorded yet)")
    (run / "rank-00000.arrows").write_bytes(b"garbage")
    (run / "rank-00001.parquet").write_bytes(b"PAR1 not really")
    assert cli(["analyze", str(run), "--format", "json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": ")[2] for line in err[:2]] == [
        str(run / "rank-00000.arrows"),
        str(run / "rank-00001.parquet"),
    ]
    assert all(line.startswith("stragglerwatch: warning:") for line in err[:2]) and "empty run" in err[-1]


def test_schema_1_0_logs_stay_readable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run written before comm_wait_s existed (tests/data/schema-1.0-run), as Parquet and as an Arrow stream."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    import stragglerwatch

    old = Path(__file__).parent / "data" / "schema-1.0-run"
    assert pq.read_schema(old / "rank-00000.parquet").metadata[b"stragglerwatch.schema_version"] == b"1.0"
    run = tmp_path / "run"
    shutil.copytree(old, run)
    table = pq.read_table(run / "rank-00001.parquet")  # rank 1 as a crashed rank leaves it: a stream
    with pa.OSFile(str(run / "rank-00001.arrows"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (run / "rank-00001.parquet").unlink()
    df = stragglerwatch.load_run(run)
    assert not df.duplicated(["rank", "step"]).any() and len(df) == 80
    assert (df["comm_wait_s"] == df["allreduce_wait_s"]).all()
    assert (df["collective_wait_s"] == 0).all() and (df["eval_s"] == 0).all()
    report = analyze_json(run, capsys)
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(1, "compute")]
    assert report["busy_unavailable"] == []
