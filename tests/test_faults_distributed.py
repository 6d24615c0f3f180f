"""The fault matrix on real 2-rank gloo jobs under torchrun: SIGTERM with the application's own
checkpointing handler, and a rank stuck in native code holding the GIL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, launch, wait_for

from stragglerwatch.cli.commands import main as cli
from stragglerwatch.record.events import read_events

pytestmark = pytest.mark.distributed
FAULTS = ROOT / "tests" / "workers" / "faults.py"


@pytest.mark.parametrize("installed", ["before", "after"])
def test_sigterm_lets_the_checkpoint_handler_finish(tmp_path: Path, installed: str) -> None:
    """torchrun is told to stop (a preemption): each rank's handler, installed before or after attach,
    takes 3 s to save a checkpoint (longer than any grace of ours) and exits; atexit hooks run."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(FAULTS),
           "sigterm", str(tmp_path), "--handler", installed]  # fmt: skip
    job = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        wait_for(lambda: all((tmp_path / f"training-{r}").exists() for r in (0, 1)), 90, "both ranks training")
        job.send_signal(signal.SIGTERM)
        job.wait(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait(timeout=10)
    for rank in (0, 1):
        assert (tmp_path / f"ckpt-{rank}.pt").stat().st_size > 0, f"rank {rank}'s checkpoint was cut short"
        assert (tmp_path / f"atexit-{rank}").exists(), f"rank {rank}'s atexit hooks did not run"
    events, bad = read_events(tmp_path / "run")
    assert bad == 0 and {e["rank"] for e in events if e["kind"] == "sigterm"} == {0, 1}, "and we recorded it"


def test_rank_stuck_in_native_code_holding_the_gil(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 1 spends 8 s in a C call that keeps the GIL: its own watchdog thread cannot run, so
    faulthandler's timer dumps its stacks; rank 0 names it from its silence."""
    launch(2, FAULTS, "native", str(tmp_path), "--steps", "20")
    run = tmp_path / "run"
    assert "faults.py" in (run / "stacks-00001.txt").read_text()
    assert cli(["analyze", str(run), "--format", "json"]) == 0
    (hang,) = json.loads(capsys.readouterr().out)["hangs"]
    assert hang["culprit_ranks"] == [1] and hang["victim_ranks"] == [0] and hang["step"] == 10
    assert "faults.py" in hang["stacks"]["1"]["faulthandler"]
    assert cli(["analyze", str(run)]) == 0
    text = capsys.readouterr().out
    assert "stuck in native code holding the GIL" in text and "in distributed" in text
