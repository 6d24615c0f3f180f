"""The policies (``on_hang``, ``on_straggler``): their settings, the rule that decides an action, the host
lists, the abort's sequence, rank 0's policy thread, and no action on any healthy simulated job."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from stragglerwatch.analysis.policy import ActRule, actions_from_events, due, slurm_hostlist, why_not
from stragglerwatch.record.events import EventFile, read_events
from stragglerwatch.record.simulate import Injection, SimConfig, write_run
from stragglerwatch.runtime.actions.hangabort import HANG_EXIT_STATUS, HangAbort, forget_group_keys, restart_caveat
from stragglerwatch.runtime.actions.stragglerpolicy import StragglerPolicy, read_hosts, write_exclusion
from stragglerwatch.runtime.config import Config, ConfigError
from stragglerwatch.runtime.log import Problems

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("_sw_policy_actions", ROOT / "benchmarks" / "policy_actions.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# -- settings -----------------------------------------------------------------------------------------


def test_settings_from_the_environment_and_bad_values_said_not_raised() -> None:
    env = {"STRAGGLERWATCH_ON_HANG": "Abort", "STRAGGLERWATCH_HANG_ABORT_S": "12",
           "STRAGGLERWATCH_ON_STRAGGLER": "exclude", "STRAGGLERWATCH_STRAGGLER_AFTER_S": "60",
           "STRAGGLERWATCH_EXCLUDE_FILE": "/shared/exclude.txt"}  # fmt: skip
    cfg = Config.resolve(environ=env)
    assert (cfg.on_hang, cfg.hang_abort_s, cfg.straggler_actions(), cfg.exclude_file) == (
        "abort", 12.0, ["exclude"], "/shared/exclude.txt")
    assert cfg.act_rule() == ActRule(after_s=60.0)
    problems = Problems()
    bad = {"STRAGGLERWATCH_ON_HANG": "kill", "STRAGGLERWATCH_HANG_ABORT_S": "-3",
           "STRAGGLERWATCH_ON_STRAGGLER": "drain", "STRAGGLERWATCH_STRAGGLER_AFTER_S": "soon"}  # fmt: skip
    cfg = Config.resolve(environ=bad, problems=problems)
    assert (cfg.on_hang, cfg.hang_abort_s, cfg.on_straggler, cfg.straggler_after_s) == (None, None, None, None)
    assert problems.counts["config"] == 4
    assert Config.resolve(environ={}, on_hang="record", on_straggler="exclude",
                          straggler_after_s=5).act_rule().after_s == 5  # an argument wins  # fmt: skip


@pytest.mark.parametrize("settings, message", [
    ({"on_hang": "kill"}, "on_hang must be"),
    ({"on_hang": "abort", "watchdog_timeout_s": 0}, "needs the watchdog"),
    ({"hang_abort_s": 0}, "hang_abort_s must be > 0"),
    ({"on_straggler": 42}, "on_straggler takes"),
    ({"on_straggler": ["exclude", "drain"]}, "on_straggler takes"),
    ({"straggler_causes": ("gpu",)}, "straggler_causes is a tuple"),
    ({"straggler_causes": "compute"}, "straggler_causes is a tuple"),
    ({"straggler_min_slowdown": 1.0}, "straggler_min_slowdown must be > 1"),
    ({"policy_interval_s": 0.1}, "policy_interval_s must be"),
])  # fmt: skip
def test_a_setting_that_cannot_be_used_is_one_line(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        Config.resolve(environ={}, **settings)
    assert "\n" not in str(err.value)


# -- host lists ---------------------------------------------------------------------------------------


def _expand(expression: str) -> set[str]:
    """A Slurm hostlist read back (what ``scontrol show hostnames`` does), for the round trip."""
    out = set()
    for prefix, inner, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", expression):
        if plain:
            out.add(plain)
            continue
        for part in inner.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                out.add(f"{prefix}{n:0{len(lo)}d}")
    return out


@pytest.mark.parametrize("hosts, expected", [
    (["node01"], "node01"),
    (["node03", "node01", "node02", "node07"], "node[01-03,07]"),
    (["gpu9", "gpu10", "login", "node01", "node02"], "login,gpu9,gpu10,node[01-02]"),
    (["a-1.cluster", "b"], "a-1.cluster,b"),
    (["n1", "n1", " n2 ", ""], "n[1-2]"),
])  # fmt: skip
def test_slurm_hostlist(hosts: list[str], expected: str) -> None:
    assert slurm_hostlist(hosts) == expected
    assert _expand(expected) == {h.strip() for h in hosts if h.strip()}


def test_the_exclusion_files_keep_earlier_hosts_and_name_each_once(tmp_path: Path) -> None:
    path = tmp_path / "shared" / "exclude.txt"
    assert read_hosts(path) == []
    path.parent.mkdir()
    path.write_text("# drained by hand\nnode04\n\n")
    assert write_exclusion(path, "node05") == ["node04", "node05"]
    assert write_exclusion(path, "node05") == ["node04", "node05"]
    assert path.read_text() == "node04\nnode05\n"
    assert (tmp_path / "shared" / "exclude.txt.slurm").read_text() == "node[04-05]\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["exclude.txt", "exclude.txt.slurm"]  # no temp file left


# -- the rule -----------------------------------------------------------------------------------------


def _straggler(**kw) -> dict:
    s = {"rank": 3, "host": "node07", "cause": "compute", "slowdown": 1.4, "first_step": 100, "last_step": None,
         "time_span": [1000.0, 1400.0], "lost_seconds": 50.0, "lost_gpu_seconds": 400.0,
         "hints": ["drain it"]}  # fmt: skip
    return {**s, **kw}


def test_the_rule_acts_only_on_a_verdict_that_shows_everything_it_asks() -> None:
    rule, last = ActRule(), 400
    assert why_not(_straggler(), rule, last) is None
    assert why_not(_straggler(last_step=390), rule, last) == "no longer flagged"
    assert "cause data" in why_not(_straggler(cause="data"), replace(rule, causes=("compute",)), last)
    assert "slowdown 1.1" in why_not(_straggler(slowdown=1.1), rule, last)
    assert "fewer than 200" in why_not(_straggler(first_step=300), rule, last)
    assert "less than 300" in why_not(_straggler(time_span=[1000.0, 1299.0]), rule, last)
    assert why_not(_straggler(time_span=None), rule, last) == "the flagged steps' times are unknown"
    report = {"stragglers": [_straggler(), _straggler(rank=5, slowdown=1.05)], "last_step": last,
              "busy_unavailable": []}  # fmt: skip
    (v,) = due(report, rule)
    assert v == {"rank": 3, "host": "node07", "cause": "compute", "since": 1000.0, "since_step": 100,
                 "flagged_s": 400.0, "slowdown": 1.4, "lost_seconds": 50.0, "lost_gpu_seconds": 400.0, "where": None,
                 "hints": ["drain it"]}  # fmt: skip
    assert due(report, rule, acted=[(3, 100)]) == []  # once per episode
    assert due({**report, "busy_unavailable": [{"reason": "x", "ranks": [0]}]}, rule) == []  # nothing measured


def test_actions_read_back_from_events_in_time_order() -> None:
    events = [{"kind": "stall", "rank": 0, "detected_at": 1.0},
              {"kind": "action", "action": "straggler", "rank": 0, "detected_at": 9.0, "verdict": {"rank": 2},
               "done": ["exclude"], "exclude_file": "/x"},
              {"kind": "action", "action": "abort", "rank": 1, "detected_at": 5.0, "stall_id": "1-8-0",
               "culprit_ranks": [1], "exit_status": 75, "restart": 0}]  # fmt: skip
    got = actions_from_events(events)
    assert [a["action"] for a in got] == ["abort", "straggler"]
    assert got[0] == {"action": "abort", "rank": 1, "at": 5.0, "restart": 0, "stall_id": "1-8-0",
                      "culprit_ranks": [1], "exit_status": 75}  # fmt: skip


# -- never a false action -----------------------------------------------------------------------------


def test_no_action_on_a_healthy_job_of_any_noise_model_and_one_on_a_real_straggler(tmp_path: Path) -> None:
    """Every noise model of the accuracy benchmarks (tuning and held-out, real traces' noise among them),
    straggler-free: the detector flags some of them; the rule (``after_s`` 0: only its other gates) acts
    on none. The same jobs with a 30% straggler: the rule acts on it, so the gates are not shut."""
    bench = _bench()
    rule = replace(ActRule(), after_s=0.0)
    flagged = found = 0
    models = bench.models()
    assert len(models) >= 25
    for i, (name, kw) in enumerate(models.items()):
        cfg = SimConfig(ranks=16, steps=600, seed=bench.seed(name, "test"), **kw)
        actions, flags = bench.acted(cfg, rule, tmp_path)
        assert actions == [], f"{name}: a healthy job was acted on: {actions}"
        flagged += flags
        if i % 4 == 0:  # a straggler in every fourth model, causes alternating
            rank = i % 16
            sick = replace(cfg, injections=[Injection(rank, 0.30, 50, ("compute", "data")[i % 8 // 4])])
            verdicts, _ = bench.acted(sick, rule, tmp_path)
            assert [v["rank"] for v in verdicts] == [rank], f"{name}: {verdicts}"
            found += 1
    assert flagged > 0, "no healthy job was even flagged: the test would not show the gates at work"
    assert found >= 6


@pytest.mark.parametrize("mode", ["variable", "static"])
def test_load_imbalance_is_never_acted_on(tmp_path: Path, mode: str) -> None:
    bench = _bench()
    extra = {"token_cv": 0.05, "heavy_share": 0.3} if mode == "static" else {"token_cv": 0.4}
    cfg = SimConfig(ranks=16, steps=600, seed=7, tokens=4096.0, token_mode=mode, **extra)
    assert bench.acted(cfg, replace(ActRule(), after_s=0.0), tmp_path)[0] == []


# -- the abort's sequence -----------------------------------------------------------------------------


def test_the_abort_waits_half_the_bound_records_first_then_ends_at_the_bound() -> None:
    calls: list[tuple] = []
    stopped = threading.Event()
    abort = HangAbort(4.0, terminate=lambda: calls.append(("terminate",)) or "ours", stopped=stopped,
                      abort=lambda: calls.append(("abort",)) or "aborted 1 of 1",
                      exit=lambda s: calls.append(("exit", s)),
                      forget=lambda: calls.append(("forget",)) or "")  # fmt: skip
    assert not abort.due(100.0, 10.0, 101.9) and abort.due(100.0, 10.0, 102.0)
    assert HangAbort(None, lambda: "", stopped).bound(10.0) == 20.0  # default: twice the threshold
    abort.run(100.0, 10.0, 103.95, lambda **f: calls.append(("record", f)))
    assert [c[0] for c in calls] == ["record", "forget", "terminate", "abort", "exit"]
    assert calls[0][1] == {"exit_status": HANG_EXIT_STATUS, "bound_s": 4.0, "exit_within_s": 0.05}
    assert calls[-1] == ("exit", 75) and not abort.due(100.0, 10.0, 200.0)  # once
    calls.clear()
    closing = threading.Event()
    closing.set()  # the Watch closed: the process is ending by itself, its status set by the exit hook
    HangAbort(4.0, lambda: "ours", closing, abort=lambda: "", exit=lambda s: calls.append(("exit", s)),
              forget=lambda: "").run(100.0, 10.0, 102.0, lambda **f: None)
    assert calls == []


def test_the_restart_caveat_of_torchrun_s_shared_store_is_said() -> None:
    shared = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in restart_caveat(shared)
    assert restart_caveat({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None  # the variable set
    assert restart_caveat({**shared, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None  # nothing to restart
    assert restart_caveat({}) is None


def test_the_process_group_keys_are_deleted_from_a_shared_store_only(one_rank_group) -> None:
    """Under torchrun's shared store the keys the group formed with would be read by the restarted group:
    the abort deletes them (the group itself goes on: they serve only its forming); other keys stay."""
    import torch
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    store.set("stragglerwatch/run/where/0", "{}")
    group_keys = [k for k in store.list_keys() if k.startswith("default_pg/")]
    assert group_keys, store.list_keys()
    assert forget_group_keys({}) == "the store is not shared across restarts"
    shared = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
    assert forget_group_keys(shared) == f"{len(group_keys)} process-group key(s) deleted"
    assert [k for k in store.list_keys() if k.startswith("default_pg/")] == []
    assert "stragglerwatch/run/where/0" in store.list_keys()
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0]


# -- rank 0's policy thread ---------------------------------------------------------------------------


def test_the_policy_acts_once_per_episode_and_survives_a_failing_action(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", SimConfig(ranks=8, steps=600, seed=3, injections=[Injection(5, 0.3, 50)]))
    told: list[dict] = []

    def broken(verdict: dict) -> None:
        raise RuntimeError("pager down")

    policy = StragglerPolicy(run, replace(ActRule(), after_s=0.0), [broken, "exclude", told.append],
                             EventFile(run / "events-00000.jsonl"), world_size=8, problems=Problems())  # fmt: skip
    (v,) = policy.check()
    assert v["rank"] == 5 and v["host"] == "sim-node-0000" and told == [v] and policy.errors == 1
    assert read_hosts(run / "excluded-hosts.txt") == ["sim-node-0000"]
    assert (run / "excluded-hosts.txt.slurm").read_text() == "sim-node-0000\n"
    assert policy.check() == []  # nothing new, and the episode was acted on
    events, bad = read_events(run)
    (ev,) = [e for e in events if e["kind"] == "action"]
    assert bad == 0 and ev["straggler_rank"] == 5 and ev["done"] == ["exclude", "list.append"]
    assert json.loads(json.dumps(ev["verdict"])) == v
    restarted = StragglerPolicy(run, replace(ActRule(), after_s=0.0), [told.append],
                                EventFile(run / "events-00000.jsonl"), world_size=8, problems=Problems())  # fmt: skip
    assert restarted.check() == [] and told == [v]  # a restarted job does not act on the same episode again


def test_the_policy_says_when_it_cannot_see_every_rank(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = write_run(tmp_path / "run", SimConfig(ranks=4, steps=50, seed=1))
    policy = StragglerPolicy(run, ActRule(), ["exclude"], EventFile(run / "events-00000.jsonl"), world_size=16,
                             problems=Problems())  # fmt: skip
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        assert policy.check() == []
    assert "reads 4 of 16 ranks' logs" in caplog.text


# -- where an action is shown -------------------------------------------------------------------------


def test_actions_are_shown_in_the_report_the_html_and_the_dashboard(tmp_path: Path) -> None:
    from stragglerwatch.analysis.report import analyze_run
    from stragglerwatch.presentation.dashboard import Snapshot
    from stragglerwatch.presentation.dashboard.app import ALERT_STYLE, banner
    from stragglerwatch.presentation.htmlreport import render_html
    from stragglerwatch.presentation.render import render_text

    run = write_run(tmp_path / "run", SimConfig(ranks=4, steps=100, seed=2))
    verdict = {"rank": 2, "host": "node07", "cause": "data", "since_step": 20, "flagged_s": 400.0, "slowdown": 1.3}
    for rank in (0, 1):
        EventFile(run / f"events-{rank:05d}.jsonl").write(
            {"kind": "action", "action": "abort", "rank": rank, "step": 90, "detected_at": 1000.0 + rank,
             "stall_id": "1-90-990", "culprit_ranks": [1], "stalled_s": 8.2, "exit_status": 75,
             "restart": 0})  # fmt: skip
    EventFile(run / "events-00000.jsonl").write(
        {"kind": "action", "action": "straggler", "rank": 0, "straggler_rank": 2, "step": 20, "detected_at": 900.0,
         "verdict": verdict, "done": ["exclude"], "exclude_file": "/shared/excluded-hosts.txt",
         "restart": 0})  # fmt: skip
    analysis = analyze_run(run)
    assert [a["action"] for a in analysis.report["actions"]] == ["straggler", "abort", "abort"]
    text = render_text(analysis.report, width=200)
    assert ("hang policy: rank(s) 0, 1 left the job (exit status 75) 8 s into a stall whose culprit was rank(s) 1"
            in text)  # fmt: skip
    assert ("straggler policy: rank 2 on node07 (data, 1.3x for 400.0 s from step 20): exclude into "
            "/shared/excluded-hosts.txt") in text
    assert "<h2>Actions of the policies</h2>" in render_html(analysis)
    children, style = banner(Snapshot(analysis), "sim")
    shown = " ".join(str(c.children) for c in children)
    assert "straggler policy: rank 2 on node07" in shown and "hang policy: rank(s) 0, 1" in shown
    assert style == ALERT_STYLE


def test_the_exporter_serves_the_actions_only_with_a_policy_on(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from stragglerwatch.record.rundir import RunInfo
    from stragglerwatch.runtime.output.exporter import RankCollector, RankMetrics

    def scrape(policy) -> str:
        registry = CollectorRegistry()
        registry.register(RankCollector(RankMetrics(), RunInfo("r", tmp_path, 0, 0, 4, "node-0"), policy=policy))
        return generate_latest(registry).decode()

    assert "policy_actions" not in scrape(None) and "straggler_action" not in scrape(None)  # the default series
    acted = [{"rank": 3, "host": "node07", "cause": "compute"}]
    text = scrape(lambda: ({"straggler": 1}, acted))
    assert 'stragglerwatch_policy_actions_total{action="straggler",rank="0",run="r"} 1.0' in text
    assert 'stragglerwatch_policy_actions_total{action="abort",rank="0",run="r"} 0.0' in text
    assert ('stragglerwatch_straggler_action{cause="compute",host="node07",rank="0",run="r",straggler_rank="3"} 1.0'
            in text)  # fmt: skip
