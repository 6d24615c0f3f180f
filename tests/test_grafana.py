"""The Grafana dashboards: in sync with their generator, well formed, and every query answered by a
real Prometheus that scraped a real 4-rank job with a straggler and a stall (no Grafana server), the
work panels included: the real job's ranks count their input elements, the lean run's its tokens."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest
from conftest import ROOT, prom_api, wait_for

from stragglerwatch.cli.commands import main as cli
from stragglerwatch.presentation.grafana import dashboards, files, render

DASH_DIR = ROOT / "grafana" / "dashboards"
VARS = {"$__rate_interval": "20s", "$__interval": "5s", "$rank": ".*"}


def substitute(expr: str, run_id: str = "run") -> str:
    for var, value in {**VARS, "$run": run_id}.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def queries(model: dict) -> list[tuple[str, dict]]:
    """(where, target) for every panel target and annotation of a dashboard."""
    out = [(f"panel {p['title']!r} {t['refId']}", t) for p in model["panels"] for t in p["targets"]]
    out += [(f"annotation {a['name']!r}", {"expr": a["expr"], "legendFormat": a["textFormat"]})
            for a in model["annotations"]["list"]]  # fmt: skip
    return out


def test_committed_dashboards_are_generated() -> None:
    generated = dashboards()
    assert sorted(p.name for p in DASH_DIR.glob("*.json")) == sorted(generated)
    for name, model in generated.items():
        assert (DASH_DIR / name).read_text() == render(model), f"{name}: run stragglerwatch grafana grafana"


def test_grafana_command_writes_the_repository_folder(tmp_path, capsys) -> None:
    """``stragglerwatch grafana DIR`` writes what the repository's grafana/ holds (its promtool tests aside)."""
    assert cli(["grafana", str(tmp_path / "out")]) == 0
    written = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert written == sorted(files())
    assert len(capsys.readouterr().out.splitlines()) == len(written)
    committed = {p.relative_to(ROOT / "grafana").as_posix() for p in (ROOT / "grafana").rglob("*") if p.is_file()}
    assert committed - set(written) == {"prometheus/rules_test.yml"}
    for rel in written:
        ours = (tmp_path / "out" / rel).read_text()
        assert ours == (ROOT / "grafana" / rel).read_text(), f"{rel}: run stragglerwatch grafana grafana"


def test_grafana_command_error_is_one_line(tmp_path, capsys) -> None:
    (tmp_path / "file").write_text("")
    assert cli(["grafana", str(tmp_path / "file" / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("stragglerwatch: error: cannot write "), err


@pytest.mark.parametrize("name", sorted(dashboards()))
def test_dashboard_model_is_well_formed(name: str) -> None:
    model = json.loads((DASH_DIR / name).read_text())
    assert json.loads(render(model)) == model, "round trip"
    assert {"uid", "title", "schemaVersion", "panels", "templating", "annotations", "time"} <= set(model)
    assert model["schemaVersion"] >= 36
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    for p in model["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        assert p["type"] in {"timeseries", "table", "state-timeline", "stat", "barchart", "heatmap"}
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)) and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    names = [v["name"] for v in model["templating"]["list"]]
    assert names[0] == "datasource"
    if name == "stragglerwatch.json":
        assert names == ["datasource", "run", "rank"]
        linked = [p for p in model["panels"] if p["title"] in ("Firing alerts", "Watchdog: stalls")]
        assert sorted(p["title"] for p in linked) == ["Firing alerts", "Watchdog: stalls"]
        assert all(p.get("links") for p in linked)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="PROMETHEUS TESTS SKIPPED: install Debian's 'prometheus'")
def test_stall_annotation_marks_a_stall_between_sparse_samples(tmp_path) -> None:
    """The stall annotation, evaluated by promtool as a Grafana with the default 15 s scrape interval sets
    its variables over a short range: a stall is marked when a scrape was missed just before it (no window
    of ``$__interval`` holds the 0 and the 1) and when the counter's series begins already counting."""
    annotations = dashboards()["stragglerwatch.json"]["annotations"]["list"]
    (stalls,) = [a for a in annotations if a["name"] == "Watchdog stalls"]
    expr = stalls["expr"].replace("$run", "r").replace("$__rate_interval", "1m").replace("$__interval", "15s")
    assert "$" not in expr, expr
    name = "stragglerwatch_watchdog_timeouts_total"
    missed = f'{name}{{run="r",rank="2",phase="data_wait"}}'  # 0 at 0-30 s, no sample at 45 s, 1 from 60 s
    fresh = f'{name}{{run="r",rank="3",phase="forward"}}'  # first scraped at 45 s, already 1
    test = {"evaluation_interval": "15s", "tests": [{
        "interval": "15s",
        "input_series": [{"series": missed, "values": "0 0 0 _ 1 1 1"}, {"series": fresh, "values": "_ _ _ 1 1 1 1"}],
        "promql_expr_test": [
            {"expr": expr, "eval_time": "60s", "exp_samples": [
                {"labels": '{run="r",rank="2",phase="data_wait"}', "value": 1},
                {"labels": fresh, "value": 1}]},
            {"expr": expr, "eval_time": "120s", "exp_samples": []},  # a window after: no stall marked
        ]}]}  # fmt: skip
    (tmp_path / "annotation_test.yml").write_text(json.dumps(test))
    out = subprocess.run(["promtool", "test", "rules", "annotation_test.yml"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and "SUCCESS" in out.stdout, out.stdout + out.stderr


def query_range(base: str, expr: str, minutes: float = 3.0) -> list[dict]:
    # a whole number of 1 s steps, so that the last point evaluated is now: an event scraped in the last
    # second (the stall, just before the test found it) lies after the last point of a grid that stops short
    end = time.time()
    params = urllib.parse.urlencode({"query": expr, "start": end - math.ceil(minutes * 60), "end": end, "step": 1})
    data = json.loads(urllib.request.urlopen(f"{base}/api/v1/query_range?{params}", timeout=10).read())
    assert data["status"] == "success", data
    return data["data"]["result"]


def raw_samples(base: str, expr: str, run_id: str) -> str:
    """For a failure message: the scraped samples of the expression's first series (times and values, each
    change and the gaps over 3 s), so that a query that found nothing can be told from data that was not there."""
    name = re.search(r"stragglerwatch_\w+", expr)
    if name is None:
        return ""
    lines = []
    for s in prom_api(base, f'{name.group(0)}{{run="{run_id}"}}[1h]'):
        values, kept = s["values"], []
        for i, (t, v) in enumerate(values):
            if i == 0 or v != values[i - 1][1] or t - values[i - 1][0] > 3:
                kept.append(f"{t:.1f}={v}")
        lines.append(f"{s['metric']}: {len(values)} samples; {' '.join(kept[:40])}")
    return "\n" + "\n".join(lines)


@pytest.mark.distributed
def test_every_query_answers_with_the_legend_labels(live_prometheus) -> None:
    """In both export modes: the real job (full) and the lean-mode run next to it."""
    base = live_prometheus.base
    runs = {live_prometheus.run_id: "full", live_prometheus.lean_run_id: "lean"}

    # every rank's stall counted and its alert evaluated, in both runs: the ranks' watchdogs fire and their
    # exporters are scraped at different moments (CI once went on when ranks 0, 2 and 3 had been scraped
    # with their stall and rank 1 not yet, 0.2 s later, and found no stall for rank 1)
    everyone = {(run, str(rank)) for run in runs for rank in range(4)}
    events = ("stragglerwatch_watchdog_timeouts_total > 0", 'count_over_time(ALERTS{alertname="WatchdogTimeout"}[1h])')

    def ready() -> bool:
        try:
            seen = [{(s["metric"]["run"], s["metric"]["rank"]) for s in prom_api(base, f"group by (run, rank) ({e})")}
                    for e in events]  # fmt: skip
            firing = prom_api(base, 'group by (run) (ALERTS{alertname="StragglerRank",alertstate="firing"})')
            return all(found >= everyone for found in seen) and {s["metric"]["run"] for s in firing} == set(runs)
        except OSError:
            return False

    wait_for(ready, 180, "every rank's stall and WatchdogTimeout, and the StragglerRank alert, in both runs")
    # template variables, as Grafana's label_values() would resolve them
    assert sorted(s["metric"]["run"] for s in prom_api(base, "group by (run) (stragglerwatch_steps_total)")) == sorted(
        runs
    )
    for run_id, mode in runs.items():
        check_run_dashboard(base, run_id, mode, live_prometheus.started)


def check_run_dashboard(base: str, run_id: str, mode: str, started: float) -> None:
    # the stall and its alert are events: look for them over the whole life of the job, not over a window
    # before now (under load, checking the first mode took longer than such a window)
    whole_job = (time.time() - started) / 60 + 0.5
    ranks = prom_api(base, f'group by (rank) (stragglerwatch_steps_total{{run="{run_id}"}})')
    assert sorted(s["metric"]["rank"] for s in ranks) == ["0", "1", "2", "3"]
    for name, model in dashboards().items():
        for where, target in queries(model):
            if "stragglerwatch_gpu_" in target["expr"]:  # only GPU ranks have it: test_context_grafana.py
                continue
            expr = substitute(target["expr"], run_id)
            # over the job's whole life: an event (the stall's annotation) can be older than any fixed window
            result = prom_api(base, expr) if target.get("instant") else query_range(base, expr, minutes=whole_job)
            result = [s for s in result if s["metric"].get("run", run_id) == run_id]  # the overview's: all runs
            assert result, f"{mode}: {name}: {where} returned no data: {expr}{raw_samples(base, expr, run_id)}"
            for label in re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")):
                assert all(label in s["metric"] for s in result), f"{mode}: {name}: {where} lacks label {label!r}"
    run = dashboards()["stragglerwatch.json"]
    (top,) = [p for p in run["panels"] if p["title"] == "Slowest ranks vs the peer median"]
    ranking = sorted(prom_api(base, substitute(top["targets"][0]["expr"], run_id)), key=lambda s: -float(s["value"][1]))
    assert ranking[0]["metric"]["rank"] == "2", f"{mode}: the straggler tops the table"

    def cause_of_2() -> str:
        rows = prom_api(base, substitute(top["targets"][1]["expr"], run_id))
        return next((r["metric"]["phase"] for r in rows if r["metric"]["rank"] == "2"), "")

    check_work_panels(base, run_id, mode, run)
    # right after the stall, its 6 s in `other` dominate rank 2's 20 s window; then compute shows again
    wait_for(lambda: cause_of_2() in ("forward", "backward"), 90, f"{mode}: rank 2's cause to be compute")
    (stalls,) = [p for p in run["panels"] if p["title"] == "Watchdog: stalls"]
    timeouts = query_range(base, substitute(stalls["targets"][0]["expr"], run_id), minutes=whole_job)
    stalled = {
        (s["metric"]["rank"], s["metric"]["phase"]) for s in timeouts if any(float(v) > 0 for _, v in s["values"])
    }
    # every rank's watchdog fired; only the culprit was stuck outside a collective (the victims wait in
    # the gradient all-reduce or, the example's model having buffers, in forward's buffer broadcast)
    waiting = ("allreduce_wait", "collective_wait")
    assert {r for r, phase in stalled if phase not in waiting} == {"2"}, mode
    assert {r for r, phase in stalled if phase in waiting} == {"0", "1", "3"}, mode
    alerts = query_range(base, f'ALERTS{{alertname="WatchdogTimeout", run="{run_id}"}}', minutes=whole_job)
    assert {s["metric"]["rank"] for s in alerts} == {"0", "1", "2", "3"}, f"{mode}: WatchdogTimeout for every rank"


def check_work_panels(base: str, run_id: str, mode: str, run: dict) -> None:
    """Every rank's work per step; busy time per unit of work tells the straggler (rank 2: slower for the
    same work) from its peers; the spread of work across ranks. (In the lean run a different rank draws
    the heaviest batch each step, ``synthetic_ranks.tokens``: over the rate interval it averages out.)"""
    panels = {p["title"]: p for p in run["panels"]}

    def values(title: str) -> dict[str, float]:
        found = prom_api(base, substitute(panels[title]["targets"][0]["expr"], run_id))
        return {s["metric"].get("rank", ""): float(s["value"][1]) for s in found}

    work = prom_api(base, substitute(panels["Work per step per rank"]["targets"][0]["expr"], run_id))
    assert sorted(s["metric"]["rank"] for s in work) == ["0", "1", "2", "3"], f"{mode}: work of every rank"
    units = {s["metric"]["unit"] for s in work}
    assert units == ({"tokens"} if mode == "lean" else {"elements"}), f"{mode}: {units}"
    per_step = [float(s["value"][1]) for s in work]
    if mode == "lean":
        assert all(4096 <= w <= 5632 for w in per_step), per_step
    else:  # every rank trains on batches of one shape
        assert max(per_step) == pytest.approx(min(per_step)) and min(per_step) > 0, per_step
    wait_for(lambda: max((v, r) for r, v in values("Busy time per unit of work per rank").items())[1] == "2", 60,
             f"{mode}: rank 2 to have the most busy time per unit of work")  # fmt: skip
    (spread,) = values("Spread of work across ranks").values()
    assert 0 <= spread < 0.2, f"{mode}: the spread of work across ranks over the interval: {spread}"
