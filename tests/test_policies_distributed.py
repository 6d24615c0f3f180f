"""The policies on real gloo jobs: a hang ended by ``on_hang="abort"`` and the job restarted by
``torchrun --max-restarts 1``; a stall that recovers left alone; ``on_straggler`` acting once on a real
straggler and never on a healthy job."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ROOT, analyze_json, launch, torchrun

from stragglerwatch.runtime.actions.hangabort import TORN_DOWN

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


@pytest.mark.parametrize("handler, stuck, shared, victim_bound", [("after", "data", True, 20),
                                                                  ("before", "other", False, 0),
                                                                  ("after", "native", False, 0)])  # fmt: skip
def test_a_hang_ends_every_rank_and_the_job_restarts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     handler: str, stuck: str, shared: bool,
                                                     victim_bound: int) -> None:  # fmt: skip
    """Rank 1 stops making progress: in a Python sleep (in its marked data fetch, or outside any phase), or
    in native code holding the GIL; rank 0 waits for it in the gradient all-reduce. With a 2 s watchdog and
    a 6 s bound, every rank that can run Python runs the application's checkpoint handler and exits 75;
    the one holding the GIL is ended by faulthandler's timer (status 1); torchrun's restart trains to the end.
    ``shared``: torchrun's store shared across restarts (its default), where the restart relies on the
    policy deleting the group's keys; else ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as the docs advise.
    ``victim_bound``: rank 0's bound (0: the same 6 s), 20 s so that the culprit surely leaves first and rank
    0's all-reduce fails before its policy acts (with equal bounds either may act first): it leaves from its
    exception hook, as its policy would have."""
    out = tmp_path / "out"
    late = ("--victim-abort-s", str(victim_bound)) if victim_bound else ()
    proc = torchrun(2, WORKER, "hang", str(out), "--handler", handler, "--stuck", stuck, *late, timeout_s=150,
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
    # the one hang that did not recover; any other: a slow first step of either attempt, seen by a 2 s watchdog
    stuck = [x for x in report["hangs"] if not x["recovered"]]
    assert len(stuck) == 1, report["hangs"]
    h = stuck[0]
    assert h["culprit_ranks"] == [1] and h.get("aborted_ranks") == handled, h
    aborts = [a for a in report["actions"] if a["action"] == "abort"]
    assert sorted(a["rank"] for a in aborts) == handled
    assert all(a["exit_status"] == 75 and a["culprit_ranks"] == [1] and a["restart"] == 0 for a in aborts)
    if victim_bound:  # rank 0 left from its all-reduce's error, or torchrun's SIGTERM as rank 1 left: said
        (failed,) = [a for a in aborts if "error" in a]
        said_why = failed["error"] == TORN_DOWN or "closed by peer" in failed["error"].lower()
        assert failed["rank"] == 0 and said_why, aborts
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


#: ``contend`` (the exclusion acted on CPU contention seen in the context) is left out of the suite: in a loaded
#: full run its onset came at step 19, not by step 14, and it needs two free CPUs to pin to. Run it by hand:
#: ``STRAGGLERWATCH_TEST_CONTEND=1 pytest --full tests/test_policies_distributed.py -k contend``; the rule it
#: exercises is tested on recorded context in tests/test_policies.py.
CASES = ["sleep", "logging"] + (["contend"] if os.environ.get("STRAGGLERWATCH_TEST_CONTEND") == "1" else [])


@pytest.mark.parametrize("case", CASES)
def test_the_straggler_policy_acts_on_what_a_node_change_fixes_and_never_on_a_healthy_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    """Rank 0's policy (``straggler_after_s`` 2, checked every second, its analysis in a child process) on
    real gloo jobs, with the hang policy on too (a 2 s watchdog, a 10 s bound: no job is ended):

    - ``sleep``: 3 ranks, rank 2 sleeps 20 ms in every forward from step 150 (once rank 0's analysis process
      has started: its start-up takes CPUs from the ranks for a second or more, and while it lasts rank 2
      is not slower than its peers: its onset could not be placed). Nothing of its node explains it: the
      application's action is told once, with no ``host_evidence``, and *exclude* declines, saying why; no
      exclusion file.
    - ``contend``: 2 ranks of a larger model, each on a CPU of its own; from step 10 busy processes take
      most of rank 1's CPU. Its context says so (its training thread waits for its CPU): its host is
      excluded, the line carrying the evidence, and the application's action is told. (``straggler_after_s``
      12 here: the context reaches the run dir every 10 s.)
    - ``logging``: 3 healthy ranks, rank 0 writing a metrics line every step (12 ms after its optimizer
      step), no data fetch timed. Rank 0 is flagged ``data``, as a report should; nothing is acted on and
      no file is written: it is left alone, and that is said."""
    out = tmp_path / "out"
    env = {"STRAGGLERWATCH_STRAGGLER_AFTER_S": "2", **ABORT, "STRAGGLERWATCH_HANG_ABORT_S": "10"}
    if case == "contend" and (not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2):
        pytest.skip("needs two CPUs to pin to")
    onset = 150 if case == "sleep" else 10
    args = {"sleep": ("--slow-rank", "2", "--delay", "0.02", "--slow-from", str(onset)),
            "contend": ("--slow-rank", "1", "--contend", "--hidden", "512", "--batch", "128"),
            "logging": ("--log-rank0", "0.012", "--stuck", "other")}[case]  # other: no fetch timed  # fmt: skip
    if case == "contend":  # the context reaches the run dir every 10 s: judge once some of it is there
        env["STRAGGLERWATCH_STRAGGLER_AFTER_S"] = "12"
    proc = launch(2 if case == "contend" else 3, WORKER, "straggler", str(out), "--steps",
                  "600" if case == "contend" else "400", *args, timeout_s=180, env=env)  # fmt: skip
    run = out / "run"
    report = analyze_json(run, capsys)
    excluded = run / "excluded-hosts.txt"
    if case == "logging":
        assert not (out / "verdicts.jsonl").exists() and not excluded.exists(), proc.stdout[-3000:]
        assert json.loads((out / "done-0-0").read_text()) == {}
        # rank 0 is flagged (its logging delays its next forward: an inferred data wait), as the report says;
        # the policy leaves it alone, and says so once
        assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(0, "data")], report["stragglers"]
        (action,) = report["actions"]
        assert action["verdict"]["rank"] == 0 and action["done"] == [], action
        assert action["declined"]["all"].startswith("busier by design: rank 0, busier in data by "), action
        assert proc.stdout.count("left alone: busier by design: rank 0") == 1, proc.stdout[-3000:]
        return
    slow = 2 if case == "sleep" else 1
    (verdict,) = [json.loads(line) for line in (out / "verdicts.jsonl").read_text().splitlines()]
    host = report["ranks"][slow]["host"]
    assert (verdict["rank"], verdict["cause"], verdict["host"]) == (slow, "compute", host)
    assert verdict["flagged_s"] >= float(env["STRAGGLERWATCH_STRAGGLER_AFTER_S"]) and verdict["slowdown"] >= 1.15
    # placed at the onset, unless the machine slowed the rank before it: 3 ranks share 2 CPUs with rank 0's
    # analysis process, and a rank that shares its CPU for a while is slower (in a loaded run, or beside a CPU
    # hog, the report flagged rank 2 from steps 37, 97 and 111); the episode then began before the onset
    # (the policy joins stretches a few steps apart) and is still caught by it
    earlier = [e[0] for s in report["stragglers"] if s["rank"] == slow for e in s["episodes"] if e[0] < onset]
    assert (-1 if earlier else onset) <= verdict["since_step"] <= onset + 4, (verdict, earlier)
    (action,) = report["actions"]
    assert json.loads((out / "done-0-0").read_text()) == {"straggler": 1}
    if case == "sleep":
        assert verdict["host_evidence"] == [] and not verdict["exclude"], verdict
        assert "no signal of its GPU" in verdict["not_excluded"]
        assert not excluded.exists()
        assert action["done"] == ["main.<locals>.note"] and "no signal" in action["declined"]["exclude"]
        return
    signals = {e["signal"] for e in verdict["host_evidence"]}
    assert signals & {"run_delay", "invol_switches", "others_cpu", "cpu_pressure"}, verdict["host_evidence"]
    assert verdict["exclude"] and verdict["not_excluded"] is None
    (line,) = excluded.read_text().splitlines()
    assert line.startswith(f"{host}  # rank 1, compute, ") and "; added " in line and "evidence: " in line, line
    assert action["done"] == ["exclude", "main.<locals>.note"]
