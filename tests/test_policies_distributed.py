"""The policies on real gloo jobs: a hang ended by ``on_hang="abort"`` and the job restarted by
``torchrun --max-restarts 1``; a stall that recovers left alone; ``on_straggler`` acting once on a real
straggler and never on a healthy job."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, analyze_json, launch, torchrun

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "workers" / "policies.py"
#: torchrun shares its rendezvous store with the workers across restarts, and a restarted gloo group can
#: read the previous attempt's addresses (pytorch/pytorch#135712): what the docs tell users to set.
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
#: A 6 s bound: the abort 3 s after the diagnosis, 3 s for the handlers (a gloo victim's runs once the
#: culprit's process has ended), then the exit.
ABORT = {"STRAGGLERWATCH_ON_HANG": "abort", "STRAGGLERWATCH_HANG_ABORT_S": "6"}


def _time(path: Path) -> float:
    return float(path.read_text())


@pytest.mark.parametrize("handler, stuck, shared", [("after", "data", True), ("before", "other", False),
                                                    ("after", "native", False)])  # fmt: skip
def test_a_hang_ends_every_rank_and_the_job_restarts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     handler: str, stuck: str, shared: bool) -> None:  # fmt: skip
    """Rank 1 stops making progress: in a Python sleep (in its marked data fetch, or outside any phase), or
    in native code holding the GIL; rank 0 waits for it in the gradient all-reduce. With a 2 s watchdog and
    a 6 s bound, every rank that can run Python runs the application's checkpoint handler and exits 75;
    the one holding the GIL is ended by faulthandler's timer (status 1); torchrun's restart trains to the end.
    ``shared``: torchrun's store shared across restarts (its default), where the restart relies on the
    policy deleting the group's keys; else ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as the docs advise."""
    out = tmp_path / "out"
    proc = torchrun(2, WORKER, "hang", str(out), "--handler", handler, "--stuck", stuck, timeout_s=150,
                    env={**({} if shared else RESTARTABLE), **ABORT}, launcher=("--max-restarts", "1"))  # fmt: skip
    native = stuck == "native"
    said = proc.stderr[-4000:]  # what torchrun and the ranks said, for a failure's message
    # torchrun names the first exit it sees: with the culprit in native code both end at about the bound
    assert any(f"(exitcode: {code})" in proc.stderr + proc.stdout for code in ((1, 75) if native else (75,))), said
    assert (out / "done-1-0").exists() and (out / "done-1-1").exists(), f"the restart did not finish:\n{said}"
    handled = [0] if native else [0, 1]
    ckpts = sorted(int(p.name.split("-")[2]) for p in out.glob("ckpt-0-*"))
    assert ckpts == handled, f"the checkpoint handlers of {ckpts} ran:\n{said}"
    hang = _time(out / "hang-1")
    restarted = max(_time(out / f"first-1-{r}") for r in (0, 1))
    # detection 2 s + diagnosis 2 s + the bound 6 s + a restart (two interpreters importing torch on 2 cores)
    assert restarted - hang < 45, f"the restarted job's first step came {restarted - hang:.1f} s after the hang"
    report = analyze_json(out / "run", capsys)
    h, *later = report["hangs"]  # later: a slow first step of the restarted job, seen by a 2 s watchdog
    assert all(x["recovered"] for x in later), report["hangs"]
    assert h["culprit_ranks"] == [1] and h["aborted_ranks"] == handled and not h["recovered"], h
    aborts = [a for a in report["actions"] if a["action"] == "abort"]
    assert sorted(a["rank"] for a in aborts) == handled
    assert all(a["exit_status"] == 75 and a["culprit_ranks"] == [1] and a["restart"] == 0 for a in aborts)
    assert [a["restart"] for a in report["attempts"]] == [0, 1]
    if native:  # its stacks, dumped by faulthandler before it ended
        assert "Timeout (" in (out / "run" / "stacks-00001.txt").read_text()


def test_a_stall_that_recovers_before_the_bound_is_left_alone(tmp_path: Path) -> None:
    """Rank 1 pauses 4.5 s: the stall is noticed (2 s) and diagnosed (4 s), and ends before the abort
    (7 s): no action, the job trains to the end."""
    out = tmp_path / "out"
    launch(2, WORKER, "recover", str(out), "--pause", "4.5", timeout_s=120, env=ABORT)
    assert json.loads((out / "done-0-0").read_text()) == {} and json.loads((out / "done-0-1").read_text()) == {}
    events = [json.loads(line) for f in sorted((out / "run").glob("events-*.jsonl")) for line in f.open()]
    kinds = [e["kind"] for e in events]
    assert "stall" in kinds and "recovery" in kinds and "action" not in kinds


@pytest.mark.parametrize("slow_rank", [2, -1])
def test_the_straggler_policy_acts_once_on_a_straggler_and_never_on_a_healthy_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], slow_rank: int
) -> None:
    """3 ranks, 400 steps; rank 2 sleeps 20 ms in every forward from step 10 (or no rank does). Rank 0's
    policy (``straggler_after_s`` 2, checked every second) writes the exclusion files and calls the
    application's action once; the healthy job gets none, and no file. The hang policy is on too (a 2 s
    watchdog, a 10 s bound): neither job is ended."""
    out = tmp_path / "out"
    env = {"STRAGGLERWATCH_STRAGGLER_AFTER_S": "2", **ABORT, "STRAGGLERWATCH_HANG_ABORT_S": "10"}
    launch(3, WORKER, "straggler", str(out), "--steps", "400", "--slow-rank", str(slow_rank), "--slowdown", "0.02",
           timeout_s=180, env=env)  # fmt: skip
    run = out / "run"
    report = analyze_json(run, capsys)
    if slow_rank < 0:
        assert not (out / "verdicts.jsonl").exists() and not (run / "excluded-hosts.txt").exists()
        assert report["actions"] == [] and json.loads((out / "done-0-0").read_text()) == {}
        return
    (verdict,) = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    host = report["ranks"][2]["host"]
    assert (verdict["rank"], verdict["cause"], verdict["host"]) == (2, "compute", host)
    assert verdict["flagged_s"] >= 2 and verdict["slowdown"] >= 1.15 and verdict["since_step"] <= 14
    assert (run / "excluded-hosts.txt").read_text() == f"{host}\n"
    (action,) = report["actions"]
    assert action["action"] == "straggler" and action["done"] == ["exclude", "main.<locals>.note"]
    assert json.loads((out / "done-0-0").read_text()) == {"straggler": 1}
