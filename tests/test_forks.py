"""Forked helpers of a watched trainer: ours is inert in the child, and the trainer is left alone.

A real process (``tests/workers/forks.py``) terminates a busy fork ``Pool``, cuts fork-context
``DataLoader`` epochs short while their workers are busy (the loader terminates them), forks a child
that calls ``sys.exit`` and one that it terminates; with and without a user SIGTERM handler, with and
without stragglerwatch. Once, the inherited wakeup fd made a terminated child end the parent (143)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

import stragglerwatch
from stragglerwatch.record.events import read_events

FORKS = ROOT / "tests" / "workers" / "forks.py"


def trainer(run: Path, *flags: str) -> dict:
    proc = subprocess.run([sys.executable, str(FORKS), "--run-dir", str(run), *flags], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, f"the trainer ended with {proc.returncode}:\n{proc.stdout[-2000:]}\n" \
                                 f"{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.full  # trains with forking helpers, twice
@pytest.mark.parametrize("user_handler", [False, True], ids=["no-handler", "user-handler"])
def test_forked_helpers_leave_the_trainer_alone(tmp_path: Path, user_handler: bool) -> None:
    flags = ["--user-handler"] if user_handler else []
    plain = trainer(tmp_path / "plain", "--plain", *flags)
    watched = trainer(tmp_path / "watched", *flags)
    for out in (plain, watched):
        assert out["steps"] == 16 and out["pid"] not in out["handled_by"], "the trainer itself got no SIGTERM"
    assert len(watched["handled_by"]) == len(plain["handled_by"]), "the children handled SIGTERM as without us"
    if user_handler:
        assert watched["handled_by"], "the user's handler ran in the terminated children, as without us"
    events, bad = read_events(tmp_path / "watched")
    assert bad == 0 and [e["kind"] for e in events] == ["closed"], "no event the trainer did not cause"
    df = stragglerwatch.load_run(tmp_path / "watched")
    assert sorted(df["step"]) == list(range(16)), "every step once: no child flushed a stale copy"
