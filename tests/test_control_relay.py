"""The control file on a real 4-rank gloo job over two simulated hosts (a node-local directory each): one
rank per host looks at the shared ``control.json``, a request still reaches and is answered by every rank
addressed (one that does not look at the shared file included), another rank takes over when the relay
leaves, and ``stragglerwatch control --set`` tells a partial answer and a job that is not running."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from conftest import ROOT, launch, wait_for

from stragglerwatch.cli.commands import main as cli
from stragglerwatch.runtime.controls.controlfile import status

pytestmark = pytest.mark.distributed

JOB = ROOT / "tests" / "workers" / "control_relay.py"


def files(signals: Path, kind: str, n: int, job: dict, timeout_s: float = 90) -> dict[int, dict]:
    """The ``n`` files ``kind-<rank>.json`` of the job's ranks, once all are there; fails at once when the job
    ended without them (with its output), or after ``timeout_s``."""

    def there() -> bool:
        count = len(list(signals.glob(f"{kind}-*.json")))
        if count < n and ("error" in job or "out" in job):
            raise AssertionError(f"the job ended with {count} of {n} {kind} files: {job.get('error') or job['out']}")
        return count == n

    wait_for(there, timeout_s, f"{n} {kind} files")
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in signals.glob(f"{kind}-*.json")}


def test_one_rank_per_host_looks_and_every_rank_answers(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run, signals, node = tmp_path / "run", tmp_path / "signals", tmp_path / "node"
    signals.mkdir()
    job: dict = {}

    def run_job() -> None:
        try:
            job["out"] = launch(4, JOB, "--run-dir", str(run), "--signal-dir", str(signals), "--node-base", str(node),
                                timeout_s=150)  # fmt: skip
        except BaseException as exc:  # noqa: BLE001 - said by the test below
            job["error"] = exc

    thread = threading.Thread(target=run_job, daemon=True)
    thread.start()
    try:
        ready = files(signals, "ready", 4, job)
        roles = {r: ready[r]["control_file"]["role"] for r in range(4)}
        assert sorted([roles[0], roles[1]]) == sorted([roles[2], roles[3]]) == ["follower", "relay"], roles
        follower = next(r for r in (2, 3) if roles[r] == "follower")
        relay = 5 - follower
        capsys.readouterr()

        assert cli(["control", str(run), "--set", "watchdog_timeout_s=3", "--wait", "30"]) == 0
        assert "applied by ranks 0-3" in capsys.readouterr().out
        assert cli(["control", str(run), "--set", "flush_interval_s=0.5", "--rank", str(follower), "--wait", "30"]) == 0
        assert f"applied by rank {follower}" in capsys.readouterr().out

        (signals / "leaving").write_text(str(relay))  # host 1's relay closes its Watch; the other takes over
        (signals / "leaving").rename(signals / "leave")  # whole: rank 0 reads it as soon as it is there
        left = files(signals, "left", 4, job)
        assert cli(["control", str(run), "--set", "recording=off", "--wait", "5"]) == 1
        out = capsys.readouterr().out
        others = [r for r in range(4) if r != relay]
        assert f"no answer within 5 s from rank {relay}" in out, out
        assert status(run)["requests"][-1]["applied"] == others
        (signals / "stop").write_text("")
        thread.join(timeout=120)
    finally:
        (signals / "stop").write_text("")
        thread.join(timeout=120)
    assert "error" not in job, job.get("error")
    done = files(signals, "done", 4, job, timeout_s=1)

    # before the relay left: only the relays looked at the shared file (and read each of the two requests),
    # the others at the node-local copy
    for r in range(4):
        if roles[r] == "relay":
            assert left[r]["stat"] >= 2 and left[r]["open"] >= 2 and left[r]["control_file"]["local_looks"] == 0
        else:
            assert left[r]["stat"] == left[r]["open"] == 0 and left[r]["control_file"]["local_looks"] >= 2, left[r]
    assert done[follower]["control_file"]["role"] == "relay" and done[follower]["stat"] > left[follower]["stat"]
    for r in range(4):
        assert done[r]["settings"]["watchdog_timeout_s"] == 3.0
        assert (done[r]["settings"]["flush_interval_s"] == 0.5) == (r == follower)
        assert r == relay or done[r]["settings"]["recording"] is False, "recording=off reached every rank left"
    assert not list(node.glob("host*/stragglerwatch-*/*")), "the last rank of a host removes its directory"

    # the job is gone: nobody answers, which is said in one line with status 2; --wait 0 does not check
    assert cli(["control", str(run), "--set", "recording=on", "--wait", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no rank answered request 4 within 1 s: the job is not running" in err, err
    assert cli(["control", str(run), "--set", "recording=on", "--wait", "0"]) == 0
    assert "not checked (--wait 0)" in capsys.readouterr().out
