"""Real 4-rank gloo jobs under torchrun: a stalled rank, a killed rank, a healthy run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLE, ROOT, launch, torchrun

from stragglerwatch.cli.commands import main as cli
from stragglerwatch.record.events import read_events

pytestmark = pytest.mark.distributed


def report(run: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert cli(["analyze", str(run), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_stalled_rank_is_named_and_training_recovers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    launch(4, EXAMPLE, "--steps", "25", "--stall-rank", "1", "--stall-at-step", "10", "--stall-seconds", "6",
             "--watchdog-timeout", "2", "--run-dir", str(run))  # fmt: skip
    r = report(run, capsys)
    assert all(x["steps"] == 25 for x in r["ranks"]), "training went on after the stall"
    (hang,) = r["hangs"]
    assert hang["culprit_ranks"] == [1] and hang["victim_ranks"] == [0, 2, 3]
    assert hang["evidence"] == "store" and hang["recovered"] and hang["step"] == 10
    assert 2.0 <= hang["waited_s"] < 5.0, "noticed within a few seconds of the threshold"
    assert "time.sleep" in json.dumps(hang["stacks"]), "the culprit's stack shows where it is stuck"
    events, _ = read_events(run)
    diagnoses = [e for e in events if e["kind"] == "diagnosis"]
    assert {e["rank"] for e in diagnoses} == {0, 1, 2, 3}
    assert all(e["culprit_ranks"] == [1] for e in diagnoses), "every rank, live, names the same culprit"
    assert {e["rank"] for e in events if e["kind"] == "recovery"} == {0, 1, 2, 3}
    assert r["stragglers"] == [], "one long stall is not a consistently slow rank"


def test_killed_rank_is_named_by_its_silence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(EXAMPLE),
           "--steps", "40", "--kill-rank", "2", "--kill-at-step", "12", "--run-dir", str(run)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0, "torchrun reports the dead worker"
    events, _ = read_events(run)
    survivors = {e["rank"] for e in events if e["kind"] in ("sigterm", "exception")}
    assert survivors and 2 not in survivors and 2 not in {e["rank"] for e in events}
    assert all(e["step"] == 12 for e in events if e["kind"] in ("sigterm", "exception"))
    r = report(run, capsys)
    (hang,) = r["hangs"]
    assert hang["culprit_ranks"] == [2] and hang["silent_ranks"] == [2] and hang["step"] == 12
    assert set(hang["victim_ranks"]) == survivors


def test_healthy_run_has_no_event(healthy_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events, bad = read_events(healthy_run)
    assert bad == 0 and sorted(e["rank"] for e in events) == [0, 1, 2, 3]
    assert {e["kind"] for e in events} == {"closed"}
    assert report(healthy_run, capsys)["hangs"] == []


def test_store_survives_in_torchrun_agent(tmp_path: Path) -> None:
    """The culprit keeps publishing even when it is rank 0 (the store lives in torchrun's agent)."""
    run = tmp_path / "run"
    torchrun(2, EXAMPLE, "--steps", "16", "--stall-rank", "0", "--stall-at-step", "8", "--stall-seconds", "5",
             "--watchdog-timeout", "2", "--run-dir", str(run))  # fmt: skip
    diagnoses = [e for e in read_events(run)[0] if e["kind"] == "diagnosis"]
    assert diagnoses and all(e["culprit_ranks"] == [0] and e["victim_ranks"] == [1] for e in diagnoses)
