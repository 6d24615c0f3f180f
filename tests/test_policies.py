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

from stragglerwatch.analysis.policy import (
    ActRule,
    Episodes,
    actions_from_events,
    current_episode,
    declined,
    due,
    episode,
    exclusion_declined,
    slurm_hostlist,
    verdict,
    view,
    why_not,
)
from stragglerwatch.analysis.policyfeed import WindowRun, view_of_run
from stragglerwatch.record.events import EventFile, read_events
from stragglerwatch.record.rundir import RunInfo, where_ran, write_rank_meta
from stragglerwatch.record.simulate import GrowingRun, Injection, SimConfig, write_run
from stragglerwatch.runtime.actions.hangabort import HANG_EXIT_STATUS, HangAbort, forget_group_keys, restart_caveat
from stragglerwatch.runtime.actions.stragglerpolicy import (
    ChildFeed,
    StragglerPolicy,
    acted_before,
    prune_exclusions,
    read_exclusions,
    read_hosts,
    write_exclusion,
)
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
    assert not Config.resolve(environ={}, exclude_needs_evidence=False).act_rule().exclude_needs_evidence


@pytest.mark.parametrize("settings, message", [
    ({"on_hang": "kill"}, "on_hang must be"),
    ({"on_hang": "abort", "watchdog_timeout_s": 0}, "needs the watchdog"),
    ({"hang_abort_s": 0}, "hang_abort_s must be > 0"),
    ({"on_straggler": 42}, "on_straggler takes"),
    ({"on_straggler": ["exclude", "drain"]}, "on_straggler takes"),
    ({"straggler_causes": ("gpu",)}, "straggler_causes is a tuple"),
    ({"straggler_causes": "compute"}, "straggler_causes is a tuple"),
    ({"straggler_min_slowdown": 1.0}, "straggler_min_slowdown=1.0 is out of range: a slowdown ratio above 1"),
    ({"straggler_min_slowdown": 0.15}, "did you mean 1.15"),
    ({"policy_interval_s": 0.1}, "policy_interval_s must be"),
    ({"exclude_needs_evidence": "maybe"}, "exclude_needs_evidence='maybe' is not a boolean"),
    ({"exclude_expire_s": 0}, "exclude_expire_s must be > 0"),
    ({"straggler_window_steps": 100}, "straggler_window_steps must be an integer >= 256"),
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
    path.write_text("# drained by hand\nnode04\n\n")  # an older file, or one written by hand: plain hosts
    assert read_hosts(path) == ["node04"]
    assert write_exclusion(path, "node05") == ["node04", "node05"]
    assert write_exclusion(path, "node05") == ["node04", "node05"]
    assert path.read_text() == "# drained by hand\nnode04\nnode05\n"
    assert (tmp_path / "shared" / "exclude.txt.slurm").read_text() == "node[04-05]\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["exclude.txt", "exclude.txt.slurm"]  # no temp file left


def test_exclusions_carry_their_evidence_and_age_and_expire(tmp_path: Path) -> None:
    """Each host the policy adds carries a comment (rank, cause, evidence, when in UTC, the run); a line
    older than ``expire_s`` is dropped when the file is next written, from the Slurm list too; a host
    without a time (by hand, an older version's) stays; a host added again is renewed."""
    from stragglerwatch.analysis.policy import exclusion_note

    path, day = tmp_path / "excluded-hosts.txt", 86400.0
    path.write_text("node01\n")
    v = verdict(_straggler(context=[_signal("sm_clock")]))
    t0 = 1_700_000_000.0
    write_exclusion(path, "node07", exclusion_note(v, "job-42", t0), t0, 3 * day)
    line = path.read_text().splitlines()[1]
    assert line.startswith("node07  # rank 3, compute, 1.4x; evidence: sm_clock: SM clock 1.40 GHz")
    assert line.endswith("added 2023-11-14T22:13:20Z; run job-42")
    (old, new) = read_exclusions(path)
    assert (old.host, old.added, new.host, new.added) == ("node01", None, "node07", t0)
    assert new.age_s(t0 + 3600) == 3600
    write_exclusion(path, "node09", exclusion_note(v, "job-43", t0 + 2 * day), t0 + 2 * day, 3 * day)
    assert read_hosts(path) == ["node01", "node07", "node09"]
    assert [e.host for e in prune_exclusions(path, 3 * day, t0 + 4 * day)] == ["node07"]  # 4 days old: gone
    assert read_hosts(path) == ["node01", "node09"]
    assert (tmp_path / "excluded-hosts.txt.slurm").read_text() == "node[01,09]\n"
    assert prune_exclusions(path, 3 * day, t0 + 4 * day) == []  # nothing more to drop: the file is left alone
    write_exclusion(path, "node09", "renewed; added 2023-11-20T00:00:00Z", t0 + 6 * day, 3 * day)
    assert read_hosts(path) == ["node01", "node09"] and "renewed" in path.read_text()
    write_exclusion(path, None, now=t0 + 100 * day, expire_s=None)  # never expire: all kept
    assert read_hosts(path) == ["node01", "node09"]


# -- the rule -----------------------------------------------------------------------------------------


def _straggler(**kw) -> dict:
    s = {"rank": 3, "host": "node07", "hosts": [[0, 0, "node07"]], "restart": 0, "attach": 0, "cause": "compute",
         "slowdown": 1.4, "first_step": 100, "last_step": None, "time_span": [1000.0, 1400.0], "lost_seconds": 50.0,
         "lost_gpu_seconds": 400.0, "hints": ["drain it"], "context": [], "by_design": None}  # fmt: skip
    return {**s, **kw}


def _signal(name: str) -> dict:
    """A context signal as ``explain`` names it."""
    text = {"sm_clock": "SM clock 1.40 GHz vs peers' 1.98 GHz", "io_pressure": "I/O pressure 45% on its host"}
    return {"signal": name, "value": 1.0, "peers": 0.0, "text": text.get(name, name)}


def test_the_rule_acts_only_on_a_verdict_that_shows_everything_it_asks() -> None:
    rule, last = ActRule(), 400
    assert why_not(_straggler(), rule, last) is None
    assert why_not(_straggler(last_step=390), rule, last) == "no longer flagged"
    assert "cause data" in why_not(_straggler(cause="data"), replace(rule, causes=("compute",)), last)
    assert "slowdown 1.1" in why_not(_straggler(slowdown=1.1), rule, last)
    assert "fewer than 200" in why_not(_straggler(first_step=300), rule, last)
    assert "less than 300" in why_not(_straggler(time_span=[1000.0, 1299.0]), rule, last)
    assert why_not(_straggler(time_span=None), rule, last) == "the flagged steps' times are unknown"
    assert why_not(_straggler(by_design="rank 0's duty"), rule, last) == "busier by design: rank 0's duty"
    report = {"stragglers": [_straggler(), _straggler(rank=5, slowdown=1.05)], "last_step": last,
              "busy_unavailable": []}  # fmt: skip
    (v,) = due(report, rule)
    reason = v.pop("not_excluded")
    assert v == {"rank": 3, "host": "node07", "hosts": [[0, 0, "node07"]], "restart": 0, "attach": 0,
                 "cause": "compute", "since": 1000.0, "since_step": 100, "flagged_s": 400.0, "slowdown": 1.4,
                 "lost_seconds": 50.0, "lost_gpu_seconds": 400.0, "where": None, "hints": ["drain it"],
                 "host_evidence": [], "exclude": False}  # fmt: skip
    assert "no signal of its GPU" in reason  # told to the callables, with no evidence: *exclude* declines
    assert due(report, rule, acted=[(0, 0, 3, 100)]) == []  # once per episode
    assert due(report, rule, acted=[(None, None, 3, 100)]) == []  # ... as an older version recorded it
    assert due(report, rule, acted=[(1, 0, 3, 100)]) != []  # another attempt's episode
    assert due({**report, "busy_unavailable": [{"reason": "x", "ranks": [0]}]}, rule) == []  # nothing measured


def test_the_rule_acts_on_a_rank_s_latest_spell_of_its_one_report_entry() -> None:
    """A report holds one entry per rank with all its episodes: the rule acts on the latest spell (its
    stretches a short pause apart), from that spell's first step and time, once; an earlier spell it acted
    on does not stop it."""
    entry = _straggler(first_step=100, time_span=[1000.0, 5000.0],
                       episodes=[[100, 180, 110], [190, 260, 195], [900, 905, 902], [912, None, 915]],
                       episode_spans=[[1000.0, 1800.0], [1900.0, 2600.0], [4000.0, 4900.0], [4920.0, 5000.0]])
    assert current_episode(entry) == (900, [4000.0, 5000.0])
    assert current_episode({**entry, "episodes": [[100, None, 110]], "episode_spans": [[1000.0, 5000.0]]}) \
        == (100, [1000.0, 5000.0])
    older = {k: v for k, v in entry.items() if k not in ("episodes", "episode_spans")}  # an older report's entry
    assert current_episode(older) == (100, [1000.0, 5000.0])
    looked = view({"stragglers": [entry], "last_step": 1200, "attempts": []}, {}, {})
    (s,) = looked["stragglers"]
    assert s["first_step"] == 900 and s["time_span"] == [4000.0, 5000.0]
    rule = replace(ActRule(), after_s=0.0)
    assert [v["since_step"] for v in due(looked, rule, acted=[(None, None, 3, 100)])] == [900]
    assert due(looked, rule, acted=[(None, None, 3, 900)]) == []


@pytest.mark.parametrize("cause, signals, needs, excluded", [
    ("compute", [], True, False),
    ("compute", ["sm_clock"], True, True),  # a slower GPU clock
    ("compute", ["gpu_hw_thermal_slowdown"], True, True),
    ("compute", ["steal"], True, True),  # its host's CPUs taken by the hypervisor
    ("compute", ["affinity_cpus"], True, False),  # the job's own CPU binding follows it to any node
    ("compute", ["gpu_applications_clocks_setting"], True, False),  # a clock setting, not the node
    ("optimizer", ["run_delay"], True, True),
    ("compute", ["workers_invol_switches"], True, False),  # its loader's CPUs: not its compute's
    ("data", ["io_pressure"], True, True),  # its host's storage
    ("data", ["workers_invol_switches"], True, True),  # its loader's CPUs
    ("data", ["run_delay"], True, False),  # its training thread's CPU wait says nothing of its data
    ("data", [], True, False),
    ("other", ["sm_clock", "steal", "io_pressure"], True, False),  # never: the loop's own work
    ("compute", [], False, True),  # exclude_needs_evidence=False: any cause but other
    ("other", [], False, False),
])  # fmt: skip
def test_exclude_acts_only_on_a_cause_a_node_change_fixes_with_its_evidence(
    cause: str, signals: list[str], needs: bool, excluded: bool
) -> None:
    rule = replace(ActRule(), exclude_needs_evidence=needs)
    s = _straggler(cause=cause, context=[_signal(n) for n in signals])
    (v,) = due({"stragglers": [s], "last_step": 400}, rule)  # every action is told of it, whatever the evidence
    assert v["exclude"] is excluded and (v["not_excluded"] is None) is excluded
    kinds = {"sm_clock": "hardware", "gpu_hw_thermal_slowdown": "hardware", "steal": "host", "run_delay": "host",
             "io_pressure": "storage", "workers_invol_switches": "host"}  # fmt: skip
    assert [(e["signal"], e["kind"]) for e in v["host_evidence"]] == [(n, kinds[n]) for n in signals if n in kinds]


def test_exclude_names_no_host_for_steps_on_several_hosts() -> None:
    s = _straggler(context=[_signal("sm_clock")], host=None, hosts=[[0, 0, "node07"], [1, 0, "node11"]])
    assert "ran on 2 hosts (node07 in restart 0, node11 in restart 1)" in exclusion_declined(s, ActRule())
    assert exclusion_declined({**s, "hosts": [[0, 0, None]]}, ActRule()) == "the rank's host is not known"


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


# -- busier by design --------------------------------------------------------------------------------


_RULE = replace(ActRule(), after_s=0.0)


@pytest.mark.parametrize("kw", [
    {"duty_ms": 12.0, "step_ms": 50.0},  # rank 0 writes a metrics line every step: its next data wait grows
    {"duty_ms": 20.0, "duty_phase": "other_s"},  # .item() or wandb after the step, timed as other
    {"duty_ms": 20.0, "duty_evidence": "io"},  # its writes even show as I/O pressure on its host
    {"duty_ms": 20.0, "duty_ranks": "local0"},  # every node's local rank 0
])  # fmt: skip
def test_a_rank_busier_by_design_is_never_acted_on_and_said(tmp_path: Path, kw: dict) -> None:
    run = write_run(tmp_path / "run", SimConfig(ranks=16, steps=600, seed=4, context_every=10, **kw))
    v = view_of_run(run)
    duty = [0] if kw.get("duty_ranks") != "local0" else [0, 8]
    assert sorted(s["rank"] for s in v["stragglers"]) == duty, "flagged, as a report should"
    for s in v["stragglers"]:
        who = "rank 0" if s["rank"] == 0 else "its node's local rank 0"
        assert s["by_design"].startswith(f"{who}, busier in {s['cause']} by "), s["by_design"]
    assert due(v, _RULE) == []
    assert sorted(key for key, _ in declined(v, _RULE)) == [(0, 0, r, 0) for r in duty]  # what the policy says


def test_rank_0_is_still_acted_on_for_what_was_not_there_at_its_start(tmp_path: Path) -> None:
    """Rank 0 with its logging duty from the start, and from step 300 a storage fault on its host (I/O
    pressure there, its data wait 30% longer): the excess that came later is its node's."""
    sick = Injection(0, 0.3, 300, "data", evidence="io")
    run = write_run(tmp_path / "run", SimConfig(ranks=16, steps=900, seed=5, duty_ms=10.0, context_every=10,
                                                injections=[sick]))  # fmt: skip
    (v,) = due(view_of_run(run), _RULE)
    assert (v["rank"], v["cause"], v["exclude"]) == (0, "data", True)
    assert [e["signal"] for e in v["host_evidence"]] == ["io_pressure"]


def test_an_unlabelled_pipeline_stage_is_never_acted_on(tmp_path: Path) -> None:
    """Two stages, the second 20% busier, nobody gave a role: the detector flags the busier stage (a report
    says so), the rule acts on none of it. Labelled, it is stage imbalance and nobody is flagged."""
    cfg = SimConfig(ranks=16, steps=600, seed=6, groups=2, group_skew=0.2, roles=False)
    v = view_of_run(write_run(tmp_path / "unlabelled", cfg))
    assert sorted(s["rank"] for s in v["stragglers"]) == list(range(8, 16))
    assert all("an unlabelled pipeline stage" in s["by_design"] for s in v["stragglers"])
    assert due(v, _RULE) == []
    labelled = view_of_run(write_run(tmp_path / "labelled", replace(cfg, roles=True)))
    assert labelled["stragglers"] == []
    # one slow host among many is no stage: with the signal of its node, it is excluded
    bad = [Injection(r, 0.3, 50, evidence="sm_clock") for r in range(8, 16)]
    host = view_of_run(write_run(tmp_path / "host", SimConfig(ranks=32, steps=600, seed=6, context_every=10,
                                                               injections=bad)))  # fmt: skip
    verdicts = due(host, _RULE)
    assert sorted(v["rank"] for v in verdicts) == list(range(8, 16)) and all(v["exclude"] for v in verdicts)


# -- restarts: hosts and episodes by attempt ----------------------------------------------------------


def test_a_rank_remembers_the_host_of_each_attempt(tmp_path: Path) -> None:
    for restart, host in ((0, "node01"), (0, "node01"), (1, "node05")):
        write_rank_meta(RunInfo("r", tmp_path, 3, 3, 8, host, restart=restart), {"device": "cpu"})
    meta = json.loads((tmp_path / "rank-00003.json").read_text())
    assert (meta["host"], meta["restart"], meta["device"]) == ("node05", 1, "cpu")
    assert where_ran(meta) == {(0, 0): {"host": "node01", "local_rank": 3, "agent": None, "world_size": 8},
                               (1, 0): {"host": "node05", "local_rank": 3, "agent": None, "world_size": 8}}
    # a file of an earlier release: its latest attempt only, without the agent and the world size
    assert where_ran({"host": "old", "restart": 2, "local_rank": 0}) == {
        (2, 0): {"host": "old", "local_rank": 0, "agent": None, "world_size": None}}


def test_the_host_acted_on_is_the_one_of_the_attempt_of_its_flagged_steps(tmp_path: Path) -> None:
    """A run of two attempts; at the restart every rank moved one host on (rank 5: node 0 -> node 1)."""
    moved = {"ranks": 16, "seed": 2, "restart_at": 400, "restart_move": 1, "context_every": 10}
    # slow in the second attempt only: its host there, not the first attempt's
    later = view_of_run(write_run(tmp_path / "later", SimConfig(steps=800, injections=[
        Injection(5, 0.3, 450, evidence="sm_clock")], **moved)))  # fmt: skip
    (v,) = due(later, _RULE)
    assert (v["rank"], v["host"], v["restart"], v["exclude"]) == (5, "sim-node-0001", 1, True)
    assert v["hosts"] == [[1, 0, "sim-node-0001"]]
    # slow in the first attempt only: the ranks moved at the restart, so the rank of attempt 1 is another GPU
    # and its series is cut there. Its episode is attempt 0's, on attempt 0's host; the flag does not run on
    # into attempt 1 (where it is healthy), so nothing is due, and no host of the wrong attempt is named
    earlier = view_of_run(write_run(tmp_path / "earlier", SimConfig(steps=420, injections=[
        Injection(5, 0.3, 100, end=400, evidence="sm_clock")], **moved)))  # fmt: skip
    (s,) = earlier["stragglers"]
    assert (s["rank"], s["host"], s["restart"], s["hosts"]) == (5, "sim-node-0000", 0, [[0, 0, "sim-node-0000"]])
    assert s["first_step"] == 100 and s["last_step"] is not None and 390 <= s["last_step"] < 400
    assert due(earlier, _RULE) == []
    # slow in both attempts, on both hosts: one entry per attempt, and the current one names both hosts: the
    # slowness follows the rank, not a node, so no node is excluded
    both = view_of_run(write_run(tmp_path / "both", SimConfig(steps=800, injections=[
        Injection(5, 0.3, 100, evidence="sm_clock")], **moved)))  # fmt: skip
    assert sorted((x["rank"], x["restart"]) for x in both["stragglers"]) == [(5, 0), (5, 1)]
    (v,) = due(both, _RULE)
    assert (v["rank"], v["host"], v["restart"], v["exclude"]) == (5, None, 1, False)
    assert "ran on 2 hosts" in v["not_excluded"]
    assert episode({**v, "first_step": v["since_step"]}) == (1, 0, 5, 400)


def test_a_restarted_policy_does_not_act_again_on_an_episode(tmp_path: Path) -> None:
    events = EventFile(tmp_path / "events-00000.jsonl")
    base = {"kind": "action", "action": "straggler", "rank": 0, "step": 40, "detected_at": 1.0}
    events.write({**base, "verdict": {"rank": 2, "since_step": 40}})  # an older version's: no attempt
    events.write({**base, "verdict": {"rank": 3, "since_step": 50, "restart": 1, "attach": 0}})
    assert acted_before(tmp_path) == {(None, None, 2, 40), (1, 0, 3, 50)}


# -- the live analysis: a bounded window --------------------------------------------------------------


def test_the_live_window_is_bounded_and_episodes_carry_over(tmp_path: Path) -> None:
    """A 3,000-step run followed in a 400-step window, a look every 200 steps (and one while only half the
    ranks have written their next batch): the analysis judges the last 400 steps every rank has written and
    never holds more than twice that, rank 0's logging duty is still known from its start, and the
    straggler from step 500 keeps its first step through the windows."""
    cfg = SimConfig(ranks=16, steps=3000, seed=8, duty_ms=20.0, injections=[Injection(9, 0.3, 500)])
    run = GrowingRun(tmp_path / "run", cfg)
    live, episodes = WindowRun(run.out, window=400), Episodes()
    views = []
    for upto in range(200, 3001, 200):
        run.flush(upto, ranks=range(8))  # half the ranks have written their next batch when the analysis looks
        if upto > 200:
            assert live.update() is None, "judged on the steps every rank has written"
        run.flush(upto)
        v = live.update()
        assert v is not None and v["window"][1] == upto - 1 and v["window"][1] - v["window"][0] < 400
        assert live.steps.size <= 800 and live.cells <= 800 * 16  # at most two windows while the ranks are apart
        assert all(a.shape[0] <= 800 for a in live.values.values())
        views.append(episodes.carry(v))
    assert live.update() is None  # nothing new
    run.close()  # compacted into Parquet: read once more, nothing new in it
    assert live.update() is None and live.cells <= 800 * 16
    last = views[-1]
    assert last["window"] == [2600, 2999]
    by_rank = {s["rank"]: s for s in last["stragglers"] if s["last_step"] is None}
    assert 495 <= by_rank[9]["first_step"] <= 510, by_rank[9]
    assert by_rank[0]["first_step"] == 0 and by_rank[0]["by_design"].startswith("rank 0, busier in data")
    (v,) = due(last, _RULE)
    assert v["rank"] == 9 and v["since_step"] == by_rank[9]["first_step"] and v["flagged_s"] > 200


def test_an_episode_outlasts_looks_further_apart_than_the_window(tmp_path: Path) -> None:
    """500 steps between two looks, a window of 300: the steps between are judged by no view (said in
    ``skipped``); the straggler open at one look and flagged from the next window's start is one episode."""
    cfg = SimConfig(ranks=8, steps=3000, seed=9, injections=[Injection(3, 0.3, 400)])
    run = GrowingRun(tmp_path / "run", cfg)
    live, episodes, done = WindowRun(run.out, window=300), Episodes(), set()
    acted = []
    for upto in range(500, 3001, 500):
        run.flush(upto)
        v = episodes.carry(live.update())
        assert v["skipped"] == (0 if upto == 500 else 200)
        for told in due(v, _RULE, done):
            done.add(episode({**told, "first_step": told["since_step"]}))
            acted.append(told)
    run.close()
    (v,) = acted
    assert v["rank"] == 3 and 395 <= v["since_step"] <= 410


def test_an_episode_goes_on_across_a_view_that_missed_it() -> None:
    episodes = Episodes()

    def look(last: int, *stragglers: dict) -> dict:
        return episodes.carry({"last_step": last, "stragglers": [dict(s) for s in stragglers]})

    look(500, _straggler(first_step=100, time_span=[1000.0, 1040.0], by_design="a duty"))
    look(900)  # a look that did not see it open (the ranks' logs apart)
    (s,) = look(1300, _straggler(first_step=450, time_span=[1035.0, 1130.0]))["stragglers"]  # from the window's start
    assert (s["first_step"], s["time_span"], s["by_design"]) == (100, [1000.0, 1130.0], "a duty")
    (s,) = look(2400, _straggler(first_step=1400, time_span=[1140.0, 1240.0]))["stragglers"]  # began after: a new one
    assert (s["first_step"], s["by_design"]) == (1400, None)


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
    assert calls[0][1] == {"exit_status": HANG_EXIT_STATUS, "bound_s": 4.0, "exit_within_s": 0.05,
                           "backend": "host", "state_suspect": False}  # fmt: skip
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


def test_the_policy_acts_once_per_episode_and_survives_a_failing_action(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Rank 5 slow with a slower GPU clock (excluded), rank 6 slow with nothing of its node to show (told,
    not excluded), rank 0 logging every step (left alone, said once)."""
    cfg = SimConfig(ranks=8, steps=600, seed=3, duty_ms=20.0, context_every=10,
                    injections=[Injection(5, 0.3, 50, evidence="sm_clock"), Injection(6, 0.3, 50)])  # fmt: skip
    run = write_run(tmp_path / "run", cfg)
    told: list[dict] = []

    def broken(verdict: dict) -> None:
        raise RuntimeError("pager down")

    policy = StragglerPolicy(run, _RULE, [broken, "exclude", told.append], EventFile(run / "events-00000.jsonl"),
                             world_size=8, problems=Problems(), feed="thread")  # fmt: skip
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        acted = {v["rank"]: v for v in policy.check()}
    assert sorted(acted) == [5, 6] and told == list(acted.values()) and policy.errors == 2
    assert acted[5]["host"] == "sim-node-0000" and acted[5]["exclude"]
    assert [e["signal"] for e in acted[5]["host_evidence"]] == ["sm_clock"]
    assert not acted[6]["exclude"] and acted[6]["host_evidence"] == [] and "no signal" in acted[6]["not_excluded"]
    assert read_hosts(run / "excluded-hosts.txt") == ["sim-node-0000"]  # rank 5's, not rank 6's (sim-node-0000 too)
    assert "rank 5, compute" in (run / "excluded-hosts.txt").read_text()
    assert (run / "excluded-hosts.txt.slurm").read_text() == "sim-node-0000\n"
    assert "rank 0 (sim-node-0000, data" in caplog.text and "left alone: busier by design: rank 0" in caplog.text
    assert policy.check() == []  # nothing new, and the episodes were acted on
    events, bad = read_events(run)
    actions = {e["straggler_rank"]: e for e in events if e["kind"] == "action"}
    assert bad == 0 and sorted(actions) == [0, 5, 6]
    assert actions[5]["done"] == ["exclude", "list.append"] and "declined" not in actions[5]
    assert actions[6]["done"] == ["list.append"] and "no signal" in actions[6]["declined"]["exclude"]
    assert actions[0]["done"] == [] and actions[0]["declined"]["all"].startswith("busier by design: rank 0")
    assert json.loads(json.dumps(actions[5]["verdict"])) == acted[5]
    assert len(policy.acted) == 2 and len(policy.left_alone) == 1
    restarted = StragglerPolicy(run, _RULE, [told.append], EventFile(run / "events-00000.jsonl"), world_size=8,
                                problems=Problems(), feed="thread")  # fmt: skip
    assert restarted.check() == [] and len(told) == 2  # a restarted job does not act on the same episodes again


def test_the_analysis_runs_in_a_child_process_restarted_when_it_dies(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The view comes from ``python -m stragglerwatch.analysis.policyfeed`` over a pipe, the process at a
    lower priority; one that dies is started again a bounded number of times, and said once."""
    import os
    import time

    run = write_run(tmp_path / "run", SimConfig(ranks=8, steps=600, seed=3, context_every=10,
                                                injections=[Injection(5, 0.3, 50, evidence="sm_clock")]))  # fmt: skip
    policy = StragglerPolicy(run, _RULE, ["exclude"], EventFile(run / "events-00000.jsonl"), world_size=8,
                             interval_s=1.0, problems=Problems())  # fmt: skip
    try:
        acted: list[dict] = []
        end = time.monotonic() + 60
        while not acted and time.monotonic() < end:
            acted = policy.check(wait_s=5.0)
        assert [v["rank"] for v in acted] == [5] and read_hosts(run / "excluded-hosts.txt") == ["sim-node-0000"]
        feed = policy.feed
        assert isinstance(feed, ChildFeed) and feed.proc is not None and feed.proc.pid != os.getpid()
        assert os.getpriority(os.PRIO_PROCESS, feed.proc.pid) >= os.getpriority(os.PRIO_PROCESS, 0) + 10 or \
            os.getpriority(os.PRIO_PROCESS, 0) + 10 > 19  # fmt: skip
        assert feed.last is not None and feed.last["cells"] == 600 * 8
        child = feed.proc
    finally:
        policy.stop()
    assert child.wait(timeout=10) is not None and policy.feed.proc is None  # it ends with the policy

    problems = Problems()

    class Dying(ChildFeed):
        def command(self) -> list[str]:
            return [sys.executable, "-c", "import sys; print('cannot go on', file=sys.stderr); sys.exit(3)"]

    dying = Dying(run, 400, 1.0, problems, restarts=2)
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        for _ in range(6):
            assert dying.poll(2.0) == []
    assert dying.started == 3 and problems.counts["policy"] == 1  # started again twice; said once
    said = "its analysis process ended (status 3): started again (at most 2 times); it said: cannot go on"
    assert said in caplog.text
    assert "ended 3 times; the policy acts no more" in caplog.text


def test_the_policy_says_when_it_cannot_see_every_rank(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    run = write_run(tmp_path / "run", SimConfig(ranks=4, steps=50, seed=1))
    policy = StragglerPolicy(run, ActRule(), ["exclude"], EventFile(run / "events-00000.jsonl"), world_size=16,
                             problems=Problems(), feed="thread")  # fmt: skip
    with caplog.at_level("WARNING", logger="stragglerwatch"):
        assert policy.check() == []
        for _ in range(2):  # the ranks start writing one by one: said from the third view in a row
            assert "reads 4 of 16" not in caplog.text
            assert policy._judge(view_of_run(run)) == []
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
    EventFile(run / "events-00000.jsonl").write(
        {"kind": "action", "action": "straggler", "rank": 0, "straggler_rank": 0, "step": 0, "detected_at": 950.0,
         "verdict": {**verdict, "rank": 0, "since_step": 0}, "done": [],
         "declined": {"all": "busier by design: rank 0, busier in data"}, "restart": 0})  # fmt: skip
    analysis = analyze_run(run)
    assert [a["action"] for a in analysis.report["actions"]] == ["straggler", "straggler", "abort", "abort"]
    text = render_text(analysis.report, width=200)
    left = "straggler policy: rank 0 on node07 (data, 1.3x for 400.0 s from step 0): left alone: busier by design"
    assert left in text
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
