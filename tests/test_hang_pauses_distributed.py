"""Healthy jobs whose rank 0 pauses longer than the hang policy's bound while the others wait in a barrier:
a checkpoint, a recompile, a long call into native code holding the GIL. With ``on_hang="abort"`` and a
2 s watchdog (the policy would act about 6 s into a stall whose culprit made no progress), each job
finishes untouched, and the events say the culprit was busy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, analyze_json, launch

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "workers" / "pauses.py"
#: The hang policy on (the worker sets a 2 s watchdog), the default bound (twice the threshold): without the
#: progress check the waiting rank would end the job 2 s (diagnosis) + 2 s (half the bound) after noticing the stall.
POLICY = {"STRAGGLERWATCH_ON_HANG": "abort"}


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(run.glob("events-*.jsonl")) for line in f.open()]


@pytest.mark.parametrize("kind", ["checkpoint", "native", "compile"])
def test_a_busy_rank_is_not_hung_and_the_job_finishes(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     kind: str) -> None:  # fmt: skip
    out = tmp_path / "out"
    env = {**POLICY, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a cold compile
    launch(2, WORKER, kind, str(out), "--seconds", "12", timeout_s=240, env=env)
    assert json.loads((out / "done-0").read_text()) == {} and json.loads((out / "done-1").read_text()) == {}
    events = _events(out / "run")
    kinds = [e["kind"] for e in events]
    assert "action" not in kinds, [e for e in events if e["kind"] == "action"]
    paused = float((out / "paused").read_text())
    stalls = [e for e in events if e["kind"] == "stall" and e["rank"] == 1]
    assert stalls, f"rank 1 never noticed rank 0's {paused:.1f} s pause: the test proves nothing"
    if paused > 9.0:  # outlasted the policy's decision (stall 2 s + diagnosis 2 s + half the bound 2 s, + slack)
        deferred = [e for e in events if e["kind"] == "deferred" and e["rank"] == 1]
        assert deferred and all("busy, not hung" in e["why"] for e in deferred), deferred
        assert "0" in deferred[0]["busy"], deferred
        (hang,) = [h for h in analyze_json(out / "run", capsys)["hangs"] if h["culprit_ranks"] == [0]]
        assert hang["recovered"] and "0" in hang["busy"] and "aborted_ranks" not in hang, hang
