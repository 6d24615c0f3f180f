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
from stragglerwatch.detect import DetectConfig, detect
from stragglerwatch.promrules import installed_rules, render_rules
from stragglerwatch.promsource import frame_from_prometheus

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
    assert out.returncode == 0 and "SUCCESS: 9 rules found" in out.stdout, out.stdout + out.stderr
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


@needs_prometheus
@pytest.mark.distributed
def test_real_prometheus_scrapes_a_straggler_job(live_prometheus) -> None:
    base = live_prometheus.base

    def firing() -> list[dict]:
        try:
            return prom_api(base, 'ALERTS{alertname="StragglerRank",alertstate="firing"}')
        except OSError:
            return []

    wait_for(lambda: firing(), 150, "StragglerRank to fire")
    up = prom_api(base, 'up{job="stragglerwatch"}')
    assert sorted(int(s["metric"]["rank"]) for s in up) == [0, 1, 2, 3]
    assert all(s["value"][1] == "1" for s in up)
    steps = prom_api(base, "stragglerwatch_steps_total")
    assert sorted(int(s["metric"]["rank"]) for s in steps) == [0, 1, 2, 3]
    run_id = live_prometheus.run_id
    assert all(s["metric"]["run"] == run_id for s in steps)
    info = prom_api(base, "stragglerwatch_rank_info")
    assert sorted(s["metric"]["local_rank"] for s in info) == ["0", "1", "2", "3"]
    ranked = prom_api(base, "sort_desc(stragglerwatch:busy_ratio:20s)")
    assert ranked[0]["metric"]["rank"] == "2" and float(ranked[0]["value"][1]) > 1.5
    alerts = firing()
    assert [a["metric"]["rank"] for a in alerts] == ["2"], "StragglerRank fires for the straggler and only it"
    # the same detection core, fed from Prometheus instead of the run dir
    wait_for(lambda: len(frame_from_prometheus(base, run_id, minutes=2, window="5s", step_seconds=1)) >= 4 * 24,
             60, "24 s of data")  # fmt: skip
    frame = frame_from_prometheus(base, run_id, minutes=2, window="5s", step_seconds=1)
    assert set(frame["rank"]) == {0, 1, 2, 3}
    verdict = detect(frame, DetectConfig(window=8, confirm=3))
    assert [s.rank for s in verdict.stragglers] == [2]
