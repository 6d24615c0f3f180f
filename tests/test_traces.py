"""Op-level traces of three real jobs (OSDI'25 what-if artifact): S and the verdicts to reproduce."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT

from stragglerwatch.cli import main as cli

TRACES = ROOT / "tests" / "data" / "whatif-traces"  # Apache-2.0, see the README and LICENSE there


def analyze(name: str, capsys: pytest.CaptureFixture[str]) -> dict:
    argv = ["analyze", str(TRACES / f"trace-{name}.parquet"), "--meta", str(TRACES / f"meta-{name}.yaml")]
    assert cli([*argv, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def within(value: float, published: float, tolerance: float = 0.10) -> bool:
    return abs(value - published) <= tolerance * published


def test_ar_one_slowed_worker(capsys: pytest.CaptureFixture[str]) -> None:
    r = analyze("AR", capsys)
    assert within(r["job_slowdown"], 1.97), r["job_slowdown"]
    assert r["whatif_verdict"] == "single worker" and r["stage_imbalance"] == []
    top = max(r["attribution"]["workers"], key=lambda w: w["slowdown"])
    assert (top["dp_rank"], top["stage"]) == (0, 0)
    assert top["slowdown"] - 1 >= 0.9 * (r["job_slowdown"] - 1), "almost all of S"
    ops = {o["optype"]: o["slowdown"] for o in r["attribution"]["optypes"]}
    assert ops["forward-compute"] > 1.2 and ops["backward-compute"] > 1.2 and ops["optimizer"] < 1.05
    assert [(s["rank"], s["cause"]) for s in r["stragglers"]] == [(0, "compute")], "compared within stage 0"
    assert r["world_size"] == 64 and len(r["ranks"]) == 16


def test_st_stage_imbalance(capsys: pytest.CaptureFixture[str]) -> None:
    r = analyze("ST", capsys)
    assert within(r["job_slowdown"], 1.18), r["job_slowdown"]
    assert r["whatif_verdict"] == "stage imbalance"
    assert [s["stage"] for s in r["stage_imbalance"]] == [3]
    stages = {s["stage"]: s["slowdown"] for s in r["attribution"]["stages"]}
    assert max(stages, key=stages.get) == 3
    assert r["stragglers"] == [], "a slow stage is not a straggler"
    assert [g["group"] for g in r["group_imbalance"]] == ["stage3"]


def test_se_random_imbalance(capsys: pytest.CaptureFixture[str]) -> None:
    r = analyze("SE", capsys)
    assert within(r["job_slowdown"], 1.54), r["job_slowdown"]
    assert r["whatif_verdict"] == "random imbalance"
    assert r["stragglers"] == [], "slowness that moves between workers is no consistent straggler"
    best_worker = max(w["slowdown"] for w in r["attribution"]["workers"]) - 1
    assert best_worker < 0.5 * (r["job_slowdown"] - 1), "no single worker explains it"
    stages = {s["stage"]: s["slowdown"] for s in r["attribution"]["stages"]}
    assert stages[1] > stages[0] and stages[1] - 1 >= 0.5 * (r["job_slowdown"] - 1), "the last stage carries much"


def test_trace_text_html_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace, meta = TRACES / "trace-ST.parquet", TRACES / "meta-ST.yaml"
    assert cli(["analyze", str(trace), "--meta", str(meta)]) == 0
    out = capsys.readouterr().out
    assert "what-if replay: S = 1.16 (stage imbalance)" in out and max(map(len, out.splitlines())) <= 80
    assert cli(["analyze", str(trace), "--meta", str(meta), "--format", "html", "--out", str(tmp_path / "r.html")]) == 0
    assert "What-if replay" in (tmp_path / "r.html").read_text()
    assert cli(["analyze", str(trace)]) == 2
    assert "needs --meta" in capsys.readouterr().err
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    assert cli(["analyze", str(tmp_path / "bad.parquet"), "--meta", str(meta)]) == 2
    assert "not a readable Parquet trace" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "pp"), [("ST", 4), ("AR", 4), ("SE", 2)])
def test_replay_with_real_compute_reproduces_the_recorded_time(name: str, pp: int) -> None:
    from stragglerwatch.traces import Replay, read_trace

    replay = Replay(read_trace(TRACES / f"trace-{name}.parquet"), pp)
    recorded = sum(float((g["start_ts"] + g["duration"]).max() - g["start_ts"].min()) for g, *_ in replay.steps)
    assert abs(replay.total() - recorded) <= 0.05 * recorded, (replay.total(), recorded)
