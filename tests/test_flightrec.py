"""Flight Recorder dumps of real gloo jobs (torch's own writer), analysed alone and with our events and logs."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLE, ROOT, launch

from stragglerwatch.cli.commands import main as cli
from stragglerwatch.evidence.flightrec import analyze_dumps
from stragglerwatch.evidence.frdumps import load_dumps
from stragglerwatch.evidence.hangverdict import reconcile

pytestmark = pytest.mark.distributed

WORKER = ROOT / "tests" / "workers" / "fr_worker.py"
FR_ENV = {"TORCH_FR_BUFFER_SIZE": "200"}


def fr_job(factory: pytest.TempPathFactory, mode: str, *args: str) -> Path:
    out = factory.mktemp(f"fr-{mode}")
    launch(3, WORKER, str(out), mode, *args, env=FR_ENV, timeout_s=90)
    return out


@pytest.fixture(scope="module")
def skip_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fr_job(tmp_path_factory, "skip", "--culprit", "1")


@pytest.fixture(scope="module")
def mismatch_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fr_job(tmp_path_factory, "mismatch")


@pytest.fixture(scope="module")
def order_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fr_job(tmp_path_factory, "order")


@pytest.fixture(scope="module")
def chain_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fr_job(tmp_path_factory, "chain")


@pytest.fixture(scope="module")
def slow_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fr_job(tmp_path_factory, "slow")


def analyze(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert cli(["analyze", *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("fmt", ["pickle", "json"])
def test_rank_that_never_issues_the_collective_is_named_from_the_dumps_alone(
    skip_job: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    r = analyze(capsys, "--fr", str(skip_job / fmt))
    fr = r["flight_recorder"]
    assert fr["dumps"] == 3 and fr["world_size"] == 3 and fr["no_dump"] == [] and fr["skipped_files"] == []
    v = fr["verdict"]
    assert v["culprit_ranks"] == [1] and v["victim_ranks"] == [0, 2] and v["basis"] == "collective counts"
    assert v["collective"] == {"group": "0", "seq": 4, "op": "all_reduce"}
    (world,) = [g for g in fr["groups"] if g["group"] == "0"]
    assert world["stuck"]["entered"] == [0, 2] and world["stuck"]["missing"] == [1]
    assert world["stuck"]["missing_last"] == {"1": {"seq": 3, "op": "all_reduce"}}
    assert world["issued"] == {"0": 4, "1": 3, "2": 4}
    sub = next(g for g in fr["groups"] if g["group"] != "0")
    assert sub["members"] == [0, 1] and sub["stuck"] is None, "the subgroup of ranks 0 and 1 is not stuck"
    assert fr["last_completed"]["1"]["seq"] == 3 and fr["last_completed"]["2"] == {
        "group": "0", "seq": 3, "op": "all_reduce", "before_all_entered": False}  # fmt: skip
    hv = r["hang_verdict"]
    assert hv["culprit_ranks"] == [1] and hv["decided_by"] == "flight recorder"
    assert hv["collective"]["seq"] == 4
    if fmt == "pickle":  # the pickles carry stacks: where the victims wait, in user code
        assert world["stuck"]["where"].startswith(str(WORKER))
    assert cli(["analyze", "--fr", str(skip_job / fmt)]) == 0
    text = capsys.readouterr().out
    assert "never by rank(s) 1" in text and "Hang verdict: rank(s) 1" in text


def test_pickle_and_json_dumps_read_the_same(skip_job: Path) -> None:
    a = analyze_dumps(load_dumps(skip_job / "pickle"))
    b = analyze_dumps(load_dumps(skip_job / "json"))
    for g in a["groups"] + b["groups"]:
        if g["stuck"]:
            g["stuck"].pop("where")
    a.pop("source"), b.pop("source")
    assert a == b


def test_mismatched_operation_names_the_odd_rank(mismatch_job: Path, capsys: pytest.CaptureFixture[str]) -> None:
    r = analyze(capsys, "--fr", str(mismatch_job / "pickle"))
    v = r["flight_recorder"]["verdict"]
    assert v["basis"] == "mismatch" and v["culprit_ranks"] == [1] and v["collective"]["seq"] == 4
    (m,) = [m for g in r["flight_recorder"]["groups"] for m in g["mismatches"]]
    assert m["differs_in"] == "op" and m["by_rank"] == {"0": "all_reduce", "1": "broadcast", "2": "all_reduce"}
    assert r["hang_verdict"]["culprit_ranks"] == [1]


def test_collectives_in_another_order_are_a_cycle(order_job: Path) -> None:
    """Rank 1 all-reduces on the subgroup {0, 1} where ranks 0 and 2 all-reduce on the world: rank 1 holds
    up 0 and 2 in the world group, rank 0 holds up 1 in the subgroup."""
    v = analyze_dumps(load_dumps(order_job / "json"))["verdict"]
    assert v["basis"] == "cycle of waits" and v["culprit_ranks"] == [1, 0], "the rank holding up most, first"
    assert "rank 1 holds up 0, 2; rank 0 holds up 1" in v["summary"]


def test_a_rank_waiting_in_another_group_is_a_victim_not_a_culprit(chain_job: Path) -> None:
    """Neither rank 0 nor rank 1 entered the world's all-reduce, but rank 0 waits inside the broadcast of a
    group that rank 1's dump never mentions (gloo records no members): rank 1 alone holds the job up."""
    fr = analyze_dumps(load_dumps(chain_job / "pickle"))
    v = fr["verdict"]
    assert (v["culprit_ranks"], v["victim_ranks"]) == ([1], [0, 2]), v
    assert v["collective"]["group"] == "0" and v["collective"]["op"] == "all_reduce", v
    fresh = [g for g in fr["groups"] if g["stuck"] and g["group"] != "0"]
    assert len(fresh) == 1 and fresh[0]["stuck"]["entered"] == [0] and fresh[0]["stuck"]["op"] == "broadcast"
    assert "meanwhile group" in v["summary"] and "do not name this group's members" in v["summary"], v["summary"]


def test_a_rank_entering_late_is_shown_and_no_hang_is_invented(
    slow_job: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = analyze(capsys, "--fr", str(slow_job / "json"))
    fr = r["flight_recorder"]
    assert fr["verdict"]["culprit_ranks"] == [] and fr["verdict"]["basis"] == "nothing pending"
    assert "hang_verdict" not in r, "no source saw a hang"
    lag = next(g for g in fr["groups"] if g["group"] == "0")["entry_lag"]
    assert lag["entered_last"].get("1", 0) >= 10, lag
    assert lag["median_lag_s"]["1"] > 0.03 > lag["median_lag_s"]["0"]
    assert cli(["analyze", "--fr", str(slow_job / "json")]) == 0
    assert "rank 1 entered last in" in capsys.readouterr().out


def test_missing_dumps(skip_job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim_gone = tmp_path / "a"
    shutil.copytree(skip_job / "pickle", victim_gone)
    (victim_gone / "rank_2").unlink()
    fr = analyze_dumps(load_dumps(victim_gone), world_size=3)
    assert fr["no_dump"] == [2] and fr["verdict"]["culprit_ranks"] == [1], "the others' counts still decide"
    # without a run dir, gloo's dumps do not say how many ranks there are; the logs do
    log = tmp_path / "rank2.log"
    log.write_text("[rank2]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                   "waiting 60000ms for recv operation to complete\n")  # fmt: skip
    fr = analyze(capsys, "--fr", str(victim_gone), "--logs", str(log))["flight_recorder"]
    assert fr["world_size"] == 3 and fr["no_dump"] == [2] and fr["verdict"]["culprit_ranks"] == [1]
    culprit_gone = tmp_path / "b"
    shutil.copytree(skip_job / "pickle", culprit_gone)
    (culprit_gone / "rank_1").unlink()
    fr = analyze_dumps(load_dumps(culprit_gone), world_size=3)
    assert fr["verdict"]["culprit_ranks"] == [1] and fr["verdict"]["basis"] == "no dump"
    assert "left no dump" in fr["verdict"]["summary"]


def _older(raw: dict) -> dict:
    """A 2.10 dump rewritten with the fields of older releases: ``seq_id``, no process_group, no pg_status."""
    out = {"version": "1.5", "pg_config": raw["pg_config"], "entries": []}
    for e in raw["entries"]:
        old = {k: v for k, v in e.items() if k not in ("process_group", "collective_seq_id", "is_p2p", "input_dtypes")}
        out["entries"].append({**old, "seq_id": e["collective_seq_id"]})
    return out


def test_older_dump_layouts_and_bad_files(skip_job: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = tmp_path / "dumps"
    d.mkdir()
    for r in range(3):
        raw = pickle.loads((skip_job / "pickle" / f"rank_{r}").read_bytes())
        (d / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(_older(raw), protocol=2))
    fr = analyze_dumps(load_dumps(d))
    assert fr["verdict"]["culprit_ranks"] == [1] and fr["verdict"]["collective"]["seq"] == 4
    # bad input: skipped with a reason, never run, never a traceback
    marker = tmp_path / "pwned"
    (d / "evil_rank_7").write_bytes(pickle.dumps(_Evil(str(marker))))
    (d / "cut_rank_5").write_bytes((skip_job / "pickle" / "rank_0").read_bytes()[:100])
    (d / "notes_rank_6.txt").write_text("=== FR Trace ===\nnot a dump\n")
    r = analyze(capsys, "--fr", str(d))
    assert not marker.exists(), "a dump cannot run code"
    assert sorted(Path(s["file"]).name for s in r["flight_recorder"]["skipped_files"]) == [
        "cut_rank_5", "evil_rank_7", "notes_rank_6.txt"]  # fmt: skip
    assert r["flight_recorder"]["verdict"]["culprit_ranks"] == [1]
    assert cli(["analyze", "--fr", str(tmp_path / "nowhere")]) == 2
    assert "no such file" in capsys.readouterr().err


def _nccl_like(raw: dict) -> dict:
    """A gloo dump rewritten as ProcessGroupNCCL writes one: group members in pg_config, each entry's state
    tracked (completed, or started while pending), no pg_status."""
    groups = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"},
              "1": {"name": "1", "desc": "undefined", "ranks": "[0, 1]"}}  # fmt: skip
    entries = [{**e, "profiling_name": e["profiling_name"].replace("gloo:", "nccl:"),
                "state": "completed" if e["retired"] else "started"} for e in raw["entries"]]  # fmt: skip
    return {"version": raw["version"], "pg_config": groups, "entries": entries}


def test_nccl_layout(skip_job: Path, tmp_path: Path) -> None:
    for r in range(3):
        raw = pickle.loads((skip_job / "pickle" / f"rank_{r}").read_bytes())
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(_nccl_like(raw)))
    fr = analyze_dumps(load_dumps(tmp_path))
    assert fr["verdict"]["culprit_ranks"] == [1] and fr["verdict"]["collective"]["op"] == "all_reduce"
    assert {g["group"]: g["members_from"] for g in fr["groups"]} == {"0": "pg_config", "1": "pg_config"}
    assert fr["groups"][0]["completed"] == {"0": 3, "1": 3, "2": 3}, "completion from the entries' states"
    # every rank issued #4, but rank 1's device never started it while the others' did (an NCCL straggler
    # stuck in earlier GPU work): the issued counts are equal, the states decide
    raws = {r: _nccl_like(pickle.loads((skip_job / "pickle" / f"rank_{r}").read_bytes())) for r in range(3)}
    pending = next(e for e in raws[0]["entries"] if e["collective_seq_id"] == 4 and e["process_group"][0] == "0")
    raws[1]["entries"].append({**pending, "state": "scheduled", "record_id": len(raws[1]["entries"])})
    for r, raw in raws.items():
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(raw))
    fr = analyze_dumps(load_dumps(tmp_path))
    v = fr["verdict"]
    assert v["culprit_ranks"] == [1] and v["basis"] == "not started on the device" and v["collective"]["seq"] == 4
    assert fr["groups"][0]["stuck"]["missing"] == [] and fr["groups"][0]["stuck"]["not_started"] == [1]


class _Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.path}",))


def test_real_hang_reconciled_with_events_and_logs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """4 ranks; rank 2 stalls for good at step 8, the others' gloo collectives time out after 8 s and
    the job goes down. Our watchdog dumps Flight Recorder on every rank at the stall."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(EXAMPLE),
           "--steps", "14", "--stall-rank", "2", "--stall-at-step", "8", "--stall-seconds", "40",
           "--watchdog-timeout", "2", "--pg-timeout", "8", "--run-dir", str(run)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", **FR_ENV}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0, "the job went down"
    log = tmp_path / "torchrun.log"
    log.write_text(proc.stdout + proc.stderr)
    assert sorted(p.name for p in run.glob("flightrec-*.pkl")) == [f"flightrec-0000{r}.pkl" for r in range(4)]
    # PyTorch's evidence alone: the dumps (moved out of the run dir) and the logs
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    for p in run.glob("flightrec-*.pkl"):
        shutil.copy(p, dumps / p.name)
    alone = analyze(capsys, "--fr", str(dumps), "--logs", str(log))
    assert alone["flight_recorder"]["verdict"]["culprit_ranks"] == [2]
    hv = alone["hang_verdict"]
    assert hv["culprit_ranks"] == [2] and hv["decided_by"] == "flight recorder"
    assert hv["agreement"] != "disagreement", hv["notes"]
    logs = next(e for e in hv["evidence"] if e["source"] == "pytorch logs")
    if logs["basis"] == "did not time out":  # ranks 0, 1, 3 timed out in gloo; torchrun lists all four
        assert logs["culprit_ranks"] == [2]
    else:  # torchrun tore a rank down before its timeout fired: the logs name only who failed first
        assert hv["notes"], "the logs' other rank is explained"
    # with our events too: three sources, one verdict
    full = analyze(capsys, str(run), "--logs", str(log))
    hv = full["hang_verdict"]
    assert hv["culprit_ranks"] == [2] and hv["step"] == 8 and hv["agreement"] != "disagreement", hv
    sources = {e["source"]: e for e in hv["evidence"]}
    assert sources["stragglerwatch watchdog"]["culprit_ranks"] == [2]
    assert set(sources) == {"flight recorder", "stragglerwatch watchdog", "pytorch logs"}
    (hang,) = full["hangs"]
    assert not hang["recovered"] and "ended" in hang, "the job went down during the stall: not a recovery"
    assert cli(["analyze", str(run), "--logs", str(log)]) == 0
    assert "Hang verdict: rank(s) 2" in capsys.readouterr().out


def test_reconcile_flags_an_unexplained_disagreement() -> None:
    fr = {"verdict": {"culprit_ranks": [1], "basis": "collective counts", "summary": "rank 1 behind",
                      "collective": {"group": "0", "seq": 7, "op": "all_reduce"}, "silent_ranks": []},
          "groups": [{"group": "0", "stuck": {"entered": [0, 2, 3]}}]}  # fmt: skip
    hang = {"culprit_ranks": [3], "victim_ranks": [0, 1, 2], "silent_ranks": [], "basis": "collective counts",
            "evidence": "store", "recovered": False, "step": 5, "phase": "data"}  # fmt: skip
    v = reconcile([hang], fr, None)
    assert v["culprit_ranks"] == [1] and v["agreement"] == "disagreement"
    assert any(n.startswith("DISAGREEMENT") for n in v["notes"])
    # a log naming a victim whose timeout fired first is explained, not a disagreement
    first = {"rank": 0, "seq": 7, "op": "ALLREDUCE", "kind": "nccl_timeout", "line_no": 3, "file": None}
    v = reconcile([{**hang, "culprit_ranks": [1], "victim_ranks": [0, 2, 3]}], fr, first)
    assert v["agreement"] == "differences explained" and "victim" in " ".join(v["notes"])
    assert any("same collective" in n for n in v["notes"])
    # the watchdog heard nothing from rank 3 and named it too; the dumps have rank 3 waiting: explained
    silent = {**hang, "culprit_ranks": [1, 3], "victim_ranks": [0, 2], "silent_ranks": [3]}
    v = reconcile([silent], fr, None)
    assert v["culprit_ranks"] == [1] and v["agreement"] == "differences explained", v["notes"]
