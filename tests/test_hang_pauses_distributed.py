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


def test_a_busy_rank_is_not_hung_and_the_job_finishes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One job, three pauses of rank 0 a few steps apart (each its own stall)."""
    out = tmp_path / "out"
    env = {**POLICY, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # a cold compile
    launch(2, WORKER, "checkpoint,native,compile", str(out), "--seconds", "10", timeout_s=300, env=env)
    assert json.loads((out / "done-0").read_text()) == {} and json.loads((out / "done-1").read_text()) == {}
    events = _events(out / "run")
    assert not [e for e in events if e["kind"] == "action"], [e for e in events if e["kind"] == "action"]
    hangs = analyze_json(out / "run", capsys)["hangs"]
    for kind in ("checkpoint", "native", "compile"):
        paused = json.loads((out / f"paused-{kind}").read_text())
        # the stall of rank 1 behind this pause: at the step after the one rank 0 paused after
        stalls = [e for e in events if e["kind"] == "stall" and e["rank"] == 1 and e["step"] == paused["step"] + 1]
        assert stalls, f"rank 1 never noticed rank 0's {paused['seconds']:.1f} s {kind}: the test proves nothing"
        if paused["seconds"] <= 9.0:  # ended before the policy's decision (2 s + 2 s + half the bound, + slack)
            continue
        ids = {e["id"] for e in stalls}
        deferred = [e for e in events if e["kind"] == "deferred" and e["rank"] == 1 and e["stall_id"] in ids]
        assert deferred and all("busy, not hung" in e["why"] for e in deferred), (kind, deferred)
        assert "0" in deferred[0]["busy"], (kind, deferred)
        (hang,) = [h for h in hangs if h["culprit_ranks"] == [0] and h["step"] == paused["step"] + 1]
        assert hang["recovered"] and "0" in hang["busy"] and "aborted_ranks" not in hang, (kind, hang)
