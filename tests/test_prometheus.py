"""The exporter, the rules and the generated config, against real promtool and a real Prometheus server."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch
from conftest import ROOT, free_ports, prom_api, wait_for
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

import stragglerwatch
from stragglerwatch.analysis.detect import detect
from stragglerwatch.analysis.thresholds import DetectConfig
from stragglerwatch.presentation.promrules import installed_rules, render_rules
from stragglerwatch.record.promsource import frame_from_prometheus
from stragglerwatch.runtime.config import Config, ConfigError
from stragglerwatch.runtime.log import Problems

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None or PROMTOOL is None,
    reason="PROMETHEUS TESTS SKIPPED: install Debian's 'prometheus' package (scripts/setup.sh does so as root)",
)
RULES_DIR = ROOT / "grafana" / "prometheus"


def scrape(port: int) -> dict:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_shipped_rules_are_the_generated_defaults() -> None:
    assert installed_rules().read_text() == render_rules()
    assert (RULES_DIR / "stragglerwatch.rules.yml").resolve() == installed_rules().resolve()


@needs_prometheus
def test_promtool_checks_and_unit_tests_the_rules(tmp_path: Path) -> None:
    out = subprocess.run([PROMTOOL, "check", "rules", str(installed_rules())], capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS: 12 rules found" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([PROMTOOL, "test", "rules", "rules_test.yml"], cwd=RULES_DIR, capture_output=True, text=True)
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def test_exporter_series_labels_sd_file_and_port_in_use(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    port = free_ports(1)
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    watch = stragglerwatch.attach(model, run, optimizer=opt, prometheus_port=port, prometheus_addr="127.0.0.1")
    for _ in range(12):
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    watch.flush()
    families = scrape(port)
    run_id = watch.info.run_id
    assert run_id.startswith("run-"), "the run dir's name and a suffix unique to the job"
    names = ["step_seconds", "busy_seconds", "phase_seconds", "steps", "last_step_timestamp_seconds", "stalled"]
    for name in (f"stragglerwatch_{n}" for n in names):
        samples = families[name].samples
        assert samples and all(s.labels["run"] == run_id and s.labels["rank"] == "0" for s in samples), name
    steps = families["stragglerwatch_steps"].samples[0]
    assert steps.name == "stragglerwatch_steps_total" and steps.value == 12
    phases = {s.labels["phase"] for s in families["stragglerwatch_phase_seconds"].samples}
    assert phases == {"data_wait", "forward", "backward", "allreduce_wait", "collective_wait", "eval", "optimizer",
                      "other"}  # fmt: skip
    info = (families.get("stragglerwatch_rank") or families["stragglerwatch_rank_info"]).samples[0]
    assert info.labels["local_rank"] == "0" and info.labels["host"] == socket.gethostname()
    (sd,) = run.glob("stragglerwatch-*.json")
    assert json.loads(sd.read_text()) == [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"run": run_id, "rank": "0", "host": socket.gethostname()}}
    ]
    with caplog.at_level("WARNING", logger="stragglerwatch"):  # a second job on the same port
        other = stragglerwatch.attach(nn.Linear(2, 2), tmp_path / "other", prometheus_port=port,
                                      prometheus_addr="127.0.0.1")  # fmt: skip
    (line,) = [r.getMessage() for r in caplog.records if r.name == "stragglerwatch"]
    assert "Address already in use" in line and "training continues" in line
    assert other.stats()["exporter_errors"] == 1 and other.stats()["metrics_port"] is None
    other.close()
    from prometheus_client import REGISTRY

    assert not any(f.name.startswith("stragglerwatch") for f in REGISTRY.collect()), "no global registry leak"
    watch.close()
    assert not sd.exists(), "the target file is removed on close"
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_lean_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                        tmp_path: Path) -> None:  # fmt: skip
    """``STRAGGLERWATCH_PROMETHEUS_MODE=lean``: the same names and labels, summaries without buckets."""
    port = free_ports(1)
    monkeypatch.setenv("STRAGGLERWATCH_PROMETHEUS_MODE", "lean")
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    watch = stragglerwatch.attach(model, run, optimizer=opt, prometheus_port=port, prometheus_addr="127.0.0.1")
    try:
        for _ in range(12):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        watch.flush()
        families = scrape(port)
    finally:
        watch.close()
    assert json.loads((run / "run.json").read_text())["config"]["prometheus_mode"] == "lean"
    for name in ("step_seconds", "busy_seconds", "phase_seconds"):
        family = families[f"stragglerwatch_{name}"]
        assert family.type == "summary", name
        assert {s.name for s in family.samples} == {f"stragglerwatch_{name}_sum", f"stragglerwatch_{name}_count"}
    phases = families["stragglerwatch_phase_seconds"].samples
    assert len(phases) == 16 and all(s.value == 12 for s in phases if s.name.endswith("_count"))
    assert families["stragglerwatch_steps"].samples[0].value == 12
    assert len(families["stragglerwatch_watchdog_timeouts"].samples) == 8
    with caplog.at_level("WARNING", logger="stragglerwatch"):  # a typo in a launcher's environment: the full series
        monkeypatch.setenv("STRAGGLERWATCH_PROMETHEUS_MODE", "slim")
        assert Config.resolve(problems=Problems()).prometheus_mode is None
    assert any("STRAGGLERWATCH_PROMETHEUS_MODE='slim'" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="prometheus_mode"):
        Config.resolve(prometheus_mode="slim")


@pytest.mark.parametrize("lean", [False, True])
def test_work_counters_sum_the_measured_steps_in_both_modes(lean: bool, tmp_path: Path) -> None:
    """``work_total{unit}`` and ``work_steps_total``: only steps whose work was measured count, each unit
    its own series (a bounded number of them), in the full and the lean mode alike."""
    from prometheus_client import CollectorRegistry, generate_latest
    from synthetic_ranks import step_record

    from stragglerwatch.record.rundir import RunInfo
    from stragglerwatch.runtime.output.exporter import MAX_UNITS, RankCollector, RankMetrics

    metrics = RankMetrics()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(RankCollector(metrics, RunInfo("w", tmp_path, 0, 0, 1, "node-0"), lean=lean))

    def families() -> dict:
        return {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}

    before = families()
    assert not before["stragglerwatch_work"].samples, "no unit before a measured step"
    assert before["stragglerwatch_work_steps"].samples[0].value == 0
    t = 1000.0
    steps = [step_record(0, i, t + i)._replace(work=w, work_unit=u) for i, (w, u) in enumerate(
        [(512.0, "tokens"), (488.0, "tokens"), (float("nan"), ""), (3.0, "samples")])]  # fmt: skip
    steps += [step_record(0, 9, t + 9)]  # an old-style record: not measured
    steps += [step_record(0, 10 + i, t + 10 + i)._replace(work=1.0, work_unit=f"u{i}") for i in range(MAX_UNITS)]
    metrics.observe(steps)
    f = families()
    work = {s.labels["unit"]: s.value for s in f["stragglerwatch_work"].samples}
    assert work == {"tokens": 1000.0, "samples": 3.0, "u0": 1.0, "u1": 1.0}, "at most MAX_UNITS units"
    (w,) = f["stragglerwatch_work"].samples[:1]
    assert w.name == "stragglerwatch_work_total" and w.labels["run"] == "w" and w.labels["rank"] == "0"
    (ws,) = f["stragglerwatch_work_steps"].samples
    assert ws.name == "stragglerwatch_work_steps_total" and ws.value == 5
    assert f["stragglerwatch_steps"].samples[0].value == len(steps)


@needs_prometheus
@pytest.mark.distributed
def test_real_prometheus_scrapes_a_straggler_job(live_prometheus) -> None:
    """The rules on the real job (full export mode) and on the lean-mode run next to it."""
    base = live_prometheus.base
    runs = {live_prometheus.run_id: "full", live_prometheus.lean_run_id: "lean"}

    def firing() -> dict[str, list[str]]:
        try:
            alerts = prom_api(base, 'ALERTS{alertname="StragglerRank",alertstate="firing"}')
        except OSError:
            return {}
        return {run: sorted(a["metric"]["rank"] for a in alerts if a["metric"]["run"] == run) for run in runs}

    wait_for(lambda: all(firing().get(run) for run in runs), 150, "StragglerRank to fire in both runs")
    alerts = firing()
    for run_id, mode in runs.items():
        sel = f'run="{run_id}"'
        up = prom_api(base, f'up{{job="stragglerwatch", {sel}}}')
        assert sorted(int(s["metric"]["rank"]) for s in up) == [0, 1, 2, 3], mode
        assert all(s["value"][1] == "1" for s in up)
        steps = prom_api(base, f"stragglerwatch_steps_total{{{sel}}}")
        assert sorted(int(s["metric"]["rank"]) for s in steps) == [0, 1, 2, 3], mode
        info = prom_api(base, f"stragglerwatch_rank_info{{{sel}}}")
        assert sorted(s["metric"]["local_rank"] for s in info) == ["0", "1", "2", "3"], mode
        buckets = prom_api(base, f"count(stragglerwatch_phase_seconds_bucket{{{sel}}})")
        assert (int(buckets[0]["value"][1]) if buckets else 0) == (4 * 8 * 19 if mode == "full" else 0)
        assert len(prom_api(base, f"time() - stragglerwatch_last_step_timestamp_seconds{{{sel}}} < 60")) == 4
        for record in ("busy_seconds:mean20s", "step_seconds:mean20s", "phase_seconds:mean20s",
                       "busy_seconds:peer_median20s", "busy_ratio:20s", "phase_excess_seconds:20s",
                       "lost_share:20s", "slowest_saves_share:20s"):  # fmt: skip
            assert prom_api(base, f"stragglerwatch:{record}{{{sel}}}"), f"{mode}: no {record}"
        ranked = prom_api(base, f"sort_desc(stragglerwatch:busy_ratio:20s{{{sel}}})")
        assert ranked[0]["metric"]["rank"] == "2" and float(ranked[0]["value"][1]) > 1.5, mode
        assert alerts[run_id] == ["2"], f"{mode}: StragglerRank fires for the straggler and only it"
        if mode == "full":  # the real job (the lean run's exporters are synthetic: no code sampler)
            # where in the code each rank's time goes, label-limited: at most 5 locations a rank
            sites = prom_api(base, f"stragglerwatch_code_site_share{{{sel}}}")
            per_rank = {r: [x for x in sites if x["metric"]["rank"] == r] for r in ("0", "1", "2", "3")}
            assert all(1 <= len(v) <= 5 for v in per_rank.values()), per_rank
            # over the last minutes (the latest window may hold rank 2's injected stall alone)
            seen = prom_api(base, f'last_over_time(stragglerwatch_code_site_share{{{sel}, rank="2", '
                                  'phase=~"forward|backward"}[10m])')  # fmt: skip
            assert any("demo_job.py" in x["metric"]["site"] for x in seen), f"rank 2's slow layer: {seen}"
        # the same detection core, fed from Prometheus instead of the run dir
        wait_for(lambda r=run_id: len(frame_from_prometheus(base, r, minutes=2, window="5s", step_seconds=1)) >= 4 * 24,
                 60, "24 s of data")  # fmt: skip
        frame = frame_from_prometheus(base, run_id, minutes=2, window="5s", step_seconds=1)
        assert set(frame["rank"]) == {0, 1, 2, 3}
        verdict = detect(frame, DetectConfig(window=8, confirm=3))
        found = {s.rank: s for s in verdict.stragglers}
        assert 2 in found and max(found.values(), key=lambda s: s.slowdown).rank == 2, (mode, verdict.stragglers)
        # a real 4-rank job on 2 shared cores: another rank may truly run slower for a stretch of these 2 minutes
        # (CI: rank 1 7% slower than ranks 0 and 3 over 19 of the 5 s means). Flagged, it must be slower in the
        # frame itself by more than the documented 5% tolerance, against the ranks neither flagged
        for rank, s in found.items():
            if rank == 2:
                continue
            span = frame[(frame["step"] >= s.first_step) & (frame["step"] <= (s.last_step or frame["step"].max()))]
            mine = span.loc[span["rank"] == rank, "busy_s"].median()
            theirs = span.loc[~span["rank"].isin(found), "busy_s"].median()
            said = f"{mode}: rank {rank} flagged at {mine * 1e3:.1f} ms a step, the others {theirs * 1e3:.1f}"
            assert mine > 1.05 * theirs, said
