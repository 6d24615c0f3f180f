"""Runtime control of a watched rank (``control.py``) on real watched modules in this process: the
validation, the effect of each setting, the control file and its command, and the debug server's
pure parts (the job verdict, the page's parameters and HTML)."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch
from conftest import wait_for
from torch import nn

import stragglerwatch
from stragglerwatch.cli.commands import main as cli
from stragglerwatch.record.events import latest_stall, read_events
from stragglerwatch.runtime.controls import debugserver
from stragglerwatch.runtime.controls.controlfile import status, write_request
from stragglerwatch.runtime.controls.controlspec import CONTROL_FILE, ControlError, parse_settings

_OPEN: list[stragglerwatch.Watch] = []


@pytest.fixture(autouse=True)
def close_watches():
    """A failed test must not leave its watch open for the next (the worker handler answers the latest)."""
    yield
    while _OPEN:
        _OPEN.pop().close()


def make(tmp_path: Path, **settings) -> tuple[nn.Module, torch.optim.Optimizer, stragglerwatch.Watch]:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    settings.setdefault("context_interval_s", 0)
    watch = stragglerwatch.attach(model, tmp_path / "run", optimizer=opt, **settings)
    _OPEN.append(watch)
    return model, opt, watch


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        nn.functional.mse_loss(model(torch.randn(8, 16)), torch.randn(8, 4)).backward()
        opt.step()
        opt.zero_grad()


# -- validation -----------------------------------------------------------------------------------------------


def test_parse_settings_takes_what_urls_and_command_lines_give() -> None:
    values, errors = parse_settings({"recording": "OFF", "watchdog_timeout_s": "2.5", "flush_interval_s": "0.2"})
    assert errors == [] and values == {"recording": False, "watchdog_timeout_s": 2.5, "flush_interval_s": 0.2}
    assert parse_settings({"watchdog_timeout_s": "auto"}) == ({"watchdog_timeout_s": None}, [])
    assert parse_settings({"recording": True, "watchdog_timeout_s": None}) == (
        {"recording": True, "watchdog_timeout_s": None}, [])  # fmt: skip


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"recording": "maybe"}, "recording must be 'on' or 'off'"),
        ({"watchdog_timeout_s": "0"}, "can only be chosen at attach"),
        ({"watchdog_timeout_s": "0.1"}, "at least 0.5 s"),
        ({"watchdog_timeout_s": "soon"}, "must be a number of seconds"),
        ({"watchdog_timeout_s": "nan"}, "finite"),
        ({"flush_interval_s": "-1"}, "between 0.05 and 3600"),
        ({"flush_interval_s": "1e9"}, "between 0.05 and 3600"),
        ({"fsync_interval_s": "1"}, "unknown setting 'fsync_interval_s'"),
        ({}, "nothing to change"),
    ],
)
def test_each_bad_setting_is_one_line(settings: dict, says: str) -> None:
    _, errors = parse_settings(settings)
    assert len(errors) == 1 and says in errors[0] and "\n" not in errors[0]


# -- effects on a watched module ----------------------------------------------------------------------------


def test_watchdog_threshold_changes_at_run_time(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, watch = make(tmp_path)
    controls = watch.controls
    train(model, opt, 4)
    assert controls.settings()["watchdog_timeout_s"] is None
    assert controls.settings()["watchdog_threshold_s"] >= 10, "adaptive: at least its 10 s floor"
    with caplog.at_level(logging.INFO, logger="stragglerwatch"):
        result = controls.apply({"watchdog_timeout_s": "0.5"}, source="test")
    assert result["errors"] == [] and result["applied"] == {"watchdog_timeout_s": 0.5}
    assert result["settings"]["watchdog_threshold_s"] == 0.5
    assert [r.getMessage() for r in caplog.records if "runtime control" in r.getMessage()] == [
        "stragglerwatch: rank 0: watchdog_timeout_s auto -> 0.5 s (runtime control, test)"
    ]
    time.sleep(1.2)  # a pause between steps, longer than the new threshold and far below the old one

    seen: dict = {}

    def stepped_and_recovered() -> bool:
        # keep stepping until the watchdog has seen the recovery, and read the state in the same breath as the
        # step that ended: any idle wait here as long as the 0.5 s threshold is a second, real stall (under load
        # in CI it was, between the recovery and a later read of the state)
        train(model, opt, 1)
        seen["state"] = controls.state()
        stall = seen["state"]["stall"]
        return bool((stall["latest"] or {}).get("recovered")) and not stall["stalled"]

    wait_for(stepped_and_recovered, 5, "the recovery")
    state = seen["state"]
    assert state["stall"]["latest"]["threshold_s"] == 0.5
    controls_state = {**state["controls"], "control_file": state["controls"]["control_file"]["role"]}
    assert controls_state == {"changes": 1, "rejected": 0, "control_file": "relay", "debug_server": None}
    assert controls.apply({"watchdog_timeout_s": "auto"})["settings"]["watchdog_timeout_s"] is None
    watch.close()
    stalls = [e for e in read_events(tmp_path / "run")[0] if e["kind"] == "stall"]
    # the pause is the first stall; a loaded machine may freeze the test for another half second after it
    assert stalls and stalls[0]["threshold_s"] == 0.5 and 0.5 < stalls[0]["waited_s"] < 2.0


def test_recording_off_and_on_at_step_ends(tmp_path: Path) -> None:
    model, opt, watch = make(tmp_path)
    train(model, opt, 5)  # steps 0-4 recorded; step 5 is in progress (it starts where step 4 ended)
    assert watch.controls.apply({"recording": "off"})["errors"] == []
    assert watch.controls.settings()["recording_now"], "applied at the next step end, not in a step"
    train(model, opt, 5)  # step 5 ends recorded; 6-9 are counted, not recorded
    assert not watch.controls.settings()["recording_now"]
    assert watch.controls.state()["phase"] == "idle", "the watchdog is quiet while nothing is recorded"
    watch.controls.apply({"recording": "on"})
    train(model, opt, 5)  # step 10 was in progress when recording came back: 11-14 recorded
    assert watch.controls.settings()["recording_now"] and watch.steps == 15
    watch.close()
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["step"].tolist() == [0, 1, 2, 3, 4, 5, 11, 12, 13, 14], "step numbers stay the training's"
    assert (df["forward_s"] > 0).all() and (df["backward_s"] > 0).all() and (df["optimizer_s"] > 0).all()
    assert (df["step_s"] < 1.0).all(), "a resumed step starts at a step end, not where recording stopped"


def test_flush_interval_change_cuts_the_current_wait(tmp_path: Path) -> None:
    model, opt, watch = make(tmp_path, flush_interval_s=60)
    train(model, opt, 3)
    time.sleep(0.3)
    assert watch.stats()["steps_written"] == 0, "the log thread waits its 60 s"
    t0 = time.monotonic()
    assert watch.controls.apply({"flush_interval_s": "0.1"})["errors"] == []
    wait_for(lambda: watch.stats()["steps_written"] == 3, 5, "the steps written at the new interval")
    assert time.monotonic() - t0 < 2.0
    assert watch.controls.state()["settings"]["flush_interval_s"] == 0.1
    watch.controls.apply({"flush_interval_s": "30"})
    train(model, opt, 2)
    time.sleep(0.5)
    assert watch.stats()["steps_written"] == 3, "and back to a long interval"
    watch.close()
    assert len(stragglerwatch.load_run(tmp_path / "run")) == 5


def test_a_refused_request_changes_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, watch = make(tmp_path)
    before = watch.controls.settings()
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        result = watch.controls.apply({"recording": "off", "flush_interval_s": "fast"})
    assert result["applied"] == {} and result["errors"] == ["flush_interval_s must be a number of seconds, not 'fast'"]
    assert watch.controls.settings() == before and watch.controls.rejected == 1
    assert watch.stats()["problems"] == {"control": 1}
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("stragglerwatch: rank 0: runtime control refused (api): flush_interval_s must be")
    watch.close()


def test_a_watchdog_off_at_attach_cannot_be_turned_on(tmp_path: Path) -> None:
    model, opt, watch = make(tmp_path, watchdog_timeout_s=0)
    assert watch.controls.settings()["watchdog"].startswith("off")
    (error,) = watch.controls.apply({"watchdog_timeout_s": "5"})["errors"]
    assert "turned off at attach" in error and "cannot be turned on at run time" in error
    assert watch.controls.apply({"recording": "off"})["errors"] == [], "the rest still changes"
    watch.close()


def test_an_inert_or_closed_watch_says_so(tmp_path: Path) -> None:
    inert = stragglerwatch.attach(nn.Linear(2, 2), tmp_path / "inert", enabled=False)
    (error,) = inert.controls.apply({"recording": "off"})["errors"]
    assert "not watched" in error and inert.controls.state()["watched"] is False
    model, opt, watch = make(tmp_path)
    watch.close()
    assert "not watched" in watch.controls.apply({"recording": "off"})["errors"][0]
    json.dumps(watch.controls.state(), allow_nan=False)  # valid JSON for any reader


# -- the control file ---------------------------------------------------------------------------------------


def test_control_file_request_is_applied_and_answered(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    model, opt, watch = make(tmp_path, control_interval_s=0.1)
    train(model, opt, 3)
    assert cli(["control", str(run), "--set", "watchdog_timeout_s=2", "--set", "flush_interval_s=0.5"]) == 0
    out = capsys.readouterr().out
    assert "request 1 (all ranks" in out and "applied by rank 0" in out, out
    assert watch.controls.settings()["watchdog_timeout_s"] == 2.0
    assert watch.controls.settings()["flush_interval_s"] == 0.5
    # a second request, written by the library the command calls
    write_request(run, {"recording": "off"}, rank=None)
    wait_for(lambda: status(run)["requests"][-1]["applied"] == [0], 5, "the answer to the second request")
    assert not watch.controls.settings()["recording"]
    assert cli(["control", str(run)]) == 0
    out = capsys.readouterr().out
    assert "request 2 (all ranks" in out and out.count("applied by rank 0") == 2
    # a request the rank refuses is answered with why
    bad = {"seq": 3, "rank": None, "settings": {"watchdog_timeout_s": "-3"}, "issued_at": time.time()}
    requests = [*json.loads((run / CONTROL_FILE).read_text())["requests"], bad]
    control = {"schema": "stragglerwatch-control", "version": 1, "requests": requests}
    (run / CONTROL_FILE).write_text(json.dumps(control))
    wait_for(lambda: status(run)["requests"][-1]["refused"], 5, "the refusal")
    assert "must be at least 0.5 s" in status(run)["requests"][-1]["refused"][0][0]
    watch.close()


def test_control_command_refuses_bad_requests_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    model, opt, watch = make(tmp_path)
    train(model, opt, 1)
    capsys.readouterr()  # (rank 0's line at attach, where the run goes)
    for args, says in [
        (["--set", "recording=maybe"], "recording must be 'on' or 'off'"),
        (["--set", "recording"], "--set takes KEY=VALUE"),
        (["--set", "recording=off", "--rank", "3"], "rank 3 is not a rank of this run (world size 1)"),
    ]:
        assert cli(["control", str(run), *args, "--wait", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("stragglerwatch: error: ") and says in err, err
    assert not (run / CONTROL_FILE).exists(), "nothing was written"
    assert cli(["control", str(tmp_path / "nowhere")]) == 2
    assert "not a stragglerwatch run dir" in capsys.readouterr().err
    (run / CONTROL_FILE).write_text(json.dumps({"schema": "stragglerwatch-control", "version": 99, "requests": []}))
    assert cli(["control", str(run)]) == 2
    assert "newer than this stragglerwatch reads" in capsys.readouterr().err
    watch.close()
    (run / CONTROL_FILE).unlink()
    assert cli(["control", str(run), "--set", "recording=off", "--rank", "0", "--wait", "0.3"]) == 2, "nobody runs"
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank 0 did not answer request 1 within 0.3 s: the job is not running" in err


def test_requests_made_before_attach_are_not_replayed(tmp_path: Path) -> None:
    run = tmp_path / "run"
    model, opt, first = make(tmp_path)
    first.close()
    write_request(run, {"recording": "off"})
    model, opt, watch = make(tmp_path, control_interval_s=0.1)  # a restart in the same run dir
    write_request(run, {"watchdog_timeout_s": "3"})
    wait_for(lambda: status(run)["requests"][-1]["applied"] == [0], 5, "the answer to the new request")
    assert watch.controls.settings()["watchdog_timeout_s"] == 3.0
    assert watch.controls.settings()["recording"], "the old request stays unapplied"
    assert [r["seq"] for r in status(run)["requests"] if r["applied"]] == [2]
    watch.close()


def test_a_broken_control_file_is_one_line_and_training_goes_on(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    model, opt, watch = make(tmp_path, control_interval_s=0.1)
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        (tmp_path / "run" / CONTROL_FILE).write_text("{not json")
        wait_for(lambda: watch.stats()["problems"].get("control"), 5, "the problem")
        train(model, opt, 3)
    assert watch.steps == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "control file" in lines[0] and "unreadable" in lines[0]
    watch.close()
    with pytest.raises(ControlError):
        write_request(tmp_path / "run", {"recording": "off"})


def test_without_a_node_local_directory_the_rank_looks_itself(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("STRAGGLERWATCH_NODE_DIR", str(tmp_path / "not-a-dir"))
    with caplog.at_level(logging.WARNING, logger="stragglerwatch"):
        model, opt, watch = make(tmp_path, control_interval_s=0.1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "no node-local directory to share it with this host's other ranks" in line and "looks at" in line, line
    assert watch.controls.state()["controls"]["control_file"]["role"] == "alone"
    write_request(tmp_path / "run", {"recording": "off"})
    wait_for(lambda: status(tmp_path / "run")["requests"][-1]["applied"] == [0], 5, "the answer")
    assert watch.controls.state()["controls"]["control_file"]["shared_looks"] > 0
    watch.close()


# -- the worker handler and the pure parts of the debug server ----------------------------------------------------


def test_worker_handler_applies_where_addressed(tmp_path: Path) -> None:
    model, opt, watch = make(tmp_path)
    train(model, opt, 2)
    code, body = debugserver.handle({})
    assert code == 503, "nothing registered in torch unless asked (opt-in)"
    assert debugserver.register(watch.controls)
    code, body = debugserver.handle({"rank": "", "watchdog_timeout_s": ""})
    assert code == 200 and body["result"] is None and body["state"]["rank"] == 0
    code, body = debugserver.handle({"rank": "1", "watchdog_timeout_s": "4"})
    assert body["result"] is None and body["state"]["settings"]["watchdog_timeout_s"] is None, "not for rank 0"
    code, body = debugserver.handle({"rank": "0", "watchdog_timeout_s": "4"})
    assert body["result"]["applied"] == {"watchdog_timeout_s": 4.0}
    assert body["state"]["settings"]["watchdog_threshold_s"] == 4.0
    code, body = debugserver.handle({"rank": "one", "recording": "off"})
    assert body["result"]["errors"] == ["rank must be a rank number or 'all', not 'one'"]
    watch.close()
    assert debugserver.handle({})[0] == 503


def _state(step: int, phase: str, count: int, stalled: bool = False, ratio: float = 0.3) -> dict:
    return {"step": step, "phase": phase, "collectives": {"0": count}, "stall": {"stalled": stalled},
            "recent": {"busy_share_median": ratio}, "latest": {"busy_share": ratio}}  # fmt: skip


def test_verdict_names_the_culprit_and_the_busiest_rank() -> None:
    states = {0: _state(40, "allreduce_wait", 81, True), 1: _state(40, "data_wait", 80, True, ratio=0.9),
              2: _state(40, "allreduce_wait", 81, True), 3: _state(40, "allreduce_wait", 81, False)}  # fmt: skip
    v = debugserver.verdict(states, 4)
    assert v["stalled_ranks"] == [0, 1, 2] and v["hang"]["culprit_ranks"] == [1]
    assert v["hang"]["victim_ranks"] == [0, 2, 3] and v["hang"]["basis"] == "collective counts"
    assert v["slowest"][0]["rank"] == 1 and v["slowest"][0]["vs_median"] == pytest.approx(3.0)
    assert v["summary"][0].startswith("stalled: ranks 0, 1, 2; hang: culprit [1], victims [0, 2, 3]")
    # a rank that does not answer (holding the GIL in native code?) is silent: a culprit
    v = debugserver.verdict({0: states[0], 1: None, 2: states[2], 3: states[3]}, 4)
    assert v["unreachable_ranks"] == [1] and v["hang"]["culprit_ranks"] == [1] and v["hang"]["silent_ranks"] == [1]
    calm = debugserver.verdict({0: _state(5, "forward", 10), 1: _state(5, "other", 10, ratio=float("nan"))}, 2)
    assert calm["hang"] is None and calm["summary"][0] == "no rank is stalled" and len(calm["slowest"]) == 1


def test_page_parameters_and_html() -> None:
    assert debugserver.request_params({}) == ({}, None)
    assert debugserver.request_params({"setting": ["watchdog_timeout_s"], "value": ["3"], "rank": ["all"]}) == (
        {"watchdog_timeout_s": "3", "rank": "all"}, None)  # fmt: skip
    assert debugserver.request_params({"recording": ["off"], "rank": ["2"]}) == ({"recording": "off", "rank": "2"},
                                                                                  None)  # fmt: skip
    params, error = debugserver.request_params({"setting": ["bogus"], "value": ["1"]})
    assert params == {} and error.startswith("unknown setting 'bogus'")
    params, error = debugserver.request_params({"recording": ["off"], "rank": ["<b>"]})
    assert params == {} and "rank must be a rank number" in error
    state = {**_state(3, "<script>", 5), "host": "<img src=x>", "settings": {"recording": True, "recording_now": True,
             "watchdog": "adaptive", "watchdog_timeout_s": None, "watchdog_threshold_s": 10.0, "flush_interval_s": 1.0},
             "stats": {"steps_written": 3, "problems": {}}}  # fmt: skip
    view = {"world_size": 2, "request": None, "verdict": debugserver.verdict({0: state}, 2),
            "ranks": [{"rank": 0, "state": state}, {"rank": 1, "error": "no answer: <timeout>"}]}  # fmt: skip
    page = debugserver.render_page(view, error="bad <value>")
    assert "<script>" not in page and "<img" not in page and "&lt;script&gt;" in page and "&lt;timeout&gt;" in page
    assert "not changed: bad &lt;value&gt;" in page and "<option value='1'>rank 1</option>" in page


def test_latest_stall_reads_the_tail_of_an_events_file(tmp_path: Path) -> None:
    path = tmp_path / "events-00000.jsonl"
    filler = {"kind": "native_stacks", "rank": 0, "stacks": {"x": "y" * 5000}}
    events = [filler] * 40 + [
        {"kind": "stall", "rank": 0, "id": "a", "step": 3, "phase": "forward", "waited_s": 2.0, "threshold_s": 1.0},
        {"kind": "stall", "rank": 0, "id": "b", "step": 9, "phase": "data_wait", "waited_s": 1.5, "threshold_s": 1.0},
        {"kind": "diagnosis", "rank": 0, "stall_id": "b", "culprit_ranks": [0], "victim_ranks": [1]},
        {"kind": "recovery", "rank": 0, "stall_id": "b", "stalled_s": 4.2},
    ]  # fmt: skip
    path.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"kind": "sta')
    latest = latest_stall(path, tail_bytes=10_000)
    assert latest["id"] == "b" and latest["diagnosis"]["culprit_ranks"] == [0] and latest["recovered"]
    assert latest["stalled_s"] == 4.2
    assert latest_stall(tmp_path / "missing.jsonl") is None
