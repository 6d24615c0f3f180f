"""Grafana dashboards (JSON model), generated here so that they stay in sync with the metric names,
and the files that serve them: ``stragglerwatch grafana DIR`` (or ``python -m stragglerwatch.presentation.grafana
DIR``) writes the whole ``grafana/`` folder of the repository from the installed package.

``dashboards/`` holds ``stragglerwatch.json`` (one run:
step time, throughput, busy time and its ratio to the peer median per rank, the slowest ranks with
their cause, the phase breakdown, exposed communication, watchdog stalls, time lost, firing alerts,
the ranks' host and GPU context: CPU contention, context switches, GPU clocks and their slowdown
reasons, temperature and power, GPU errors; and, where the ranks measure their work per step, the
work per step, busy time per unit of work and the spread of work across ranks) and
``stragglerwatch-overview.json`` (all runs at a glance); ``provisioning/`` the Grafana provisioning
that loads them and a Prometheus data source; ``docker-compose.yml``, ``compose/prometheus.yml`` and
``prometheus/stragglerwatch.rules.yml`` (the rules shipped with the package) a Prometheus and a
Grafana with Docker. Tests check that the repository's files are what this module writes and run
every query against a real Prometheus.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
RUN = 'run="$run"'
RANKS = 'run="$run", rank=~"$rank"'
SCHEMA_VERSION = 39


def mean(metric: str, sel: str, by: str = "rank") -> str:
    """Mean value per step of a stragglerwatch histogram over the panel's rate interval."""
    m = f"stragglerwatch_{metric}"
    return (f"sum by ({by}) (rate({m}_sum{{{sel}}}[$__rate_interval]))"
            f" / sum by ({by}) (rate({m}_count{{{sel}}}[$__rate_interval]))")  # fmt: skip


BUSY = mean("busy_seconds", RUN)
#: Exposed communication per step and rank: the communication phases' means, added up.
COMM = (f'sum by (rank) (rate(stragglerwatch_phase_seconds_sum{{{RANKS}, phase=~"allreduce_wait|collective_wait"}}'
        f'[$__rate_interval])) / sum by (rank) (rate(stragglerwatch_phase_seconds_count{{{RANKS}, '
        f'phase="allreduce_wait"}}[$__rate_interval]))')  # fmt: skip
STEP = mean("step_seconds", RUN)
RATIO = f"({BUSY}) / scalar(quantile(0.5, {BUSY}))"
#: Phases a straggler's cause can be (communication and evaluation are not the rank's own work).
PHASE = mean("phase_seconds", f'{RUN}, phase!~"allreduce_wait|collective_wait|eval"', by="rank, phase")
CAUSE = f"topk by (rank) (1, ({PHASE}) - on (phase) group_left quantile by (phase) (0.5, {PHASE}))"


def rate_by_rank(metric: str, sel: str, by: str = "rank") -> str:
    return f"sum by ({by}) (rate(stragglerwatch_{metric}{{{sel}}}[$__rate_interval]))"


#: Steps per second whose work was measured, per rank (none: no series, not a division by zero).
WORK_STEPS = f"({rate_by_rank('work_steps_total', RANKS)} > 0)"
#: Work per step per rank over the panel's rate interval (in the unit the rank recorded).
WORK = f"{rate_by_rank('work_total', RANKS, 'rank, unit')} / on (rank) group_left () {WORK_STEPS}"
#: Busy seconds per unit of work per rank, only where every step of the interval had its work measured
#: (busy time counts every step, the work only the measured ones: ``work_steps_total`` = ``steps_total``).
BUSY_PER_WORK = (f"({rate_by_rank('busy_seconds_sum', RANKS)} / on (rank) {rate_by_rank('work_total', RANKS)}) "
                 f"and on (rank) ({rate_by_rank('work_steps_total', RANKS)} >= 0.99 * "
                 f"{rate_by_rank('steps_total', RANKS)})")  # fmt: skip
_WORK_ALL = f"{rate_by_rank('work_total', RUN)} / on (rank) ({rate_by_rank('work_steps_total', RUN)} > 0)"
#: The job's spread of work across ranks: (heaviest - mean) / mean of the ranks' work per step.
WORK_SPREAD = f"(max({_WORK_ALL}) - avg({_WORK_ALL})) / avg({_WORK_ALL})"


def target(expr: str, legend: str, ref: str = "A", instant: bool = False, table: bool = False) -> dict[str, Any]:
    t = {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref, "range": not instant,
         "instant": instant}  # fmt: skip
    if table:
        t["format"] = "table"
    return t


def panel(pid: int, title: str, kind: str, grid: tuple[int, int, int, int], targets: list[dict], **extra: Any) -> dict:
    x, y, w, h = grid
    p = {"id": pid, "title": title, "type": kind, "datasource": DS, "targets": targets,
         "gridPos": {"x": x, "y": y, "w": w, "h": h}}  # fmt: skip
    p.update(extra)
    return p


def _unit(unit: str, **custom: Any) -> dict[str, Any]:
    return {"defaults": {"unit": unit, "custom": custom}, "overrides": []}


RULES_LINK = {
    "title": "Alert rules (StragglerRank, TrainingStalled, WatchdogTimeout)",
    "url": "https://prometheus.io/docs/prometheus/latest/configuration/alerting_rules/",
    "targetBlank": True,
}


def _templating() -> dict[str, Any]:
    return {
        "list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Prometheus"},
            {"name": "run", "type": "query", "datasource": DS, "label": "run", "refresh": 2, "sort": 2,
             "query": {"query": "label_values(stragglerwatch_steps_total, run)", "refId": "run"},
             "definition": "label_values(stragglerwatch_steps_total, run)"},
            {"name": "rank", "type": "query", "datasource": DS, "label": "rank", "refresh": 2, "sort": 3,
             "multi": True, "includeAll": True, "allValue": ".*",
             "query": {"query": 'label_values(stragglerwatch_steps_total{run="$run"}, rank)', "refId": "rank"},
             "definition": 'label_values(stragglerwatch_steps_total{run="$run"}, rank)'},
        ]
    }  # fmt: skip


def _annotations() -> dict[str, Any]:
    return {
        "list": [
            {"name": "Watchdog stalls", "datasource": DS, "enable": True, "iconColor": "red",
             # a stall counted in the window; or a counter first seen already counting (its series begins
             # with the stall, or was first scraped after it): no change to see, a stall all the same. The
             # window is $__rate_interval (at least 4 scrape intervals), never $__interval: that can be
             # shorter than the gap between two samples (a short time range, 15 s scrapes, a missed scrape),
             # and a window holding one sample sees no change
             "expr": f"changes(stragglerwatch_watchdog_timeouts_total{{{RUN}}}[$__rate_interval]) > 0 or "
                     f"(stragglerwatch_watchdog_timeouts_total{{{RUN}}} > 0 unless "
                     f"stragglerwatch_watchdog_timeouts_total{{{RUN}}} offset $__rate_interval)",
             "titleFormat": "stall", "textFormat": "rank {{rank}} stalled in {{phase}}", "step": "5s"},
            {"name": "Alerts", "datasource": DS, "enable": True, "iconColor": "orange",
             "expr": f'ALERTS{{{RUN}, alertstate="firing"}}',
             "titleFormat": "{{alertname}}", "textFormat": "rank {{rank}}", "step": "15s"},
        ]
    }  # fmt: skip


def run_dashboard() -> dict[str, Any]:
    """One run: where its time goes and which rank holds it back."""
    panels = [
        panel(1, "Job step time", "timeseries", (0, 0, 12, 7), [
            target(f"quantile(0.5, {STEP})", "median rank"),
            target(f"max({STEP})", "slowest rank", "B"),
        ], fieldConfig=_unit("s")),
        panel(2, "Throughput", "timeseries", (12, 0, 12, 7), [
            target(f"min(rate(stragglerwatch_steps_total{{{RUN}}}[$__rate_interval]))", "steps/s"),
        ], fieldConfig=_unit("none")),
        panel(3, "Busy time / peer median, per rank", "state-timeline", (0, 7, 24, 8), [
            target(RATIO, "{{rank}}"),
        ], fieldConfig={"defaults": {"unit": "x", "thresholds": {"mode": "absolute", "steps": [
            {"color": "green", "value": None}, {"color": "orange", "value": 1.1}, {"color": "red", "value": 1.3}]},
            "color": {"mode": "thresholds"}}, "overrides": []},
            description="Busy time = step minus exposed communication and evaluation; 1.0 = like the run's median rank."),
        panel(4, "Slowest ranks vs the peer median", "table", (0, 15, 12, 9), [
            target(f"topk(10, {RATIO})", "", instant=True, table=True),
            target(CAUSE, "", "B", instant=True, table=True),
        ], transformations=[
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {"excludeByName": {"Time": True},
                                           "renameByName": {"Value #A": "busy / peers", "Value #B": "cause excess (s)",
                                                            "phase": "cause"}}},
            {"id": "sortBy", "options": {"sort": [{"field": "busy / peers", "desc": True}]}},
        ], links=[RULES_LINK]),
        panel(5, "Busy time per rank", "timeseries", (12, 15, 12, 9), [
            target(mean("busy_seconds", RANKS), "rank {{rank}}"),
        ], fieldConfig=_unit("s")),
        panel(6, "Phase breakdown", "timeseries", (0, 24, 12, 9), [
            target(mean("phase_seconds", RANKS, by="rank, phase"), "rank {{rank}} {{phase}}"),
        ], fieldConfig=_unit("s", stacking={"mode": "normal"}, fillOpacity=60)),
        panel(7, "Exposed communication per rank", "timeseries", (12, 24, 12, 9), [
            target(COMM, "rank {{rank}}"),
        ], fieldConfig=_unit("s"), description="Gradient all-reduce wait plus every other collective (buffer "
            "broadcast, SyncBatchNorm, the loop's own). The straggler waits least: the others wait for it."),
        panel(8, "Watchdog: stalls", "timeseries", (0, 33, 12, 8), [
            target(f"sum by (rank, phase) (increase(stragglerwatch_watchdog_timeouts_total{{{RUN}}}[$__rate_interval]))",
                   "timeouts rank {{rank}} ({{phase}})"),
            target(f"stragglerwatch_stalled{{{RUN}}}", "stalled rank {{rank}}", "B"),
        ], fieldConfig=_unit("none"), links=[RULES_LINK]),
        panel(9, "Time lost to the slowest rank", "timeseries", (12, 33, 12, 8), [
            target(f"(max({BUSY}) - quantile(0.5, {BUSY})) / quantile(0.5, {STEP})", "share of step time"),
            target(f"(max({BUSY}) - quantile(0.5, {BUSY})) / quantile(0.5, {STEP}) * count({BUSY})",
                   "GPU-seconds lost per second", "B"),
            target(f"(max({BUSY}) - max({BUSY} unless topk(1, {BUSY}))) / quantile(0.5, {STEP})",
                   "fixing the slowest rank saves", "C"),
            target(f"(max({BUSY} unless topk(1, {BUSY})) - quantile(0.5, {BUSY})) / quantile(0.5, {STEP})",
                   "left: the next rank and jitter", "D"),
        ], fieldConfig=_unit("percentunit"),
            description="What-if: each step without the slowest rank's excess over the median; split into what "
            "fixing the slowest rank would save (down to the next slowest) and what is left (the next rank, "
            "jitter). Over the rate window, per-step jitter averages out: the report's split (analyze) is per step."),
        panel(10, "Firing alerts", "table", (0, 41, 24, 6), [
            target(f'ALERTS{{{RUN}, alertstate="firing"}}', "{{alertname}} rank {{rank}}", instant=True, table=True),
        ], links=[RULES_LINK]),
        *context_panels(11, 47),
        *work_panels(17, 71),
    ]  # fmt: skip
    return _dashboard("stragglerwatch-run", "stragglerwatch: run", panels, _templating(), _annotations())


def context_panels(first_id: int, y: int) -> list[dict[str, Any]]:
    """Why is it slow: the ranks' host and GPU context (``ctxmetrics.py``). GPU series exist only on GPU
    ranks and carry DCGM's labels (``gpu``, ``UUID``, ``Hostname``): join them with DCGM's on ``UUID``."""
    gpu = "by (rank, gpu, UUID)"
    return [
        panel(first_id, "CPU contention per rank", "timeseries", (0, y, 12, 8), [
            target(f"stragglerwatch_process_run_delay_ratio{{{RANKS}}}", "rank {{rank}} waiting for a CPU"),
            target(f"max by (host) (stragglerwatch_host_cpu_pressure_ratio{{{RANKS}}})", "CPU pressure {{host}}", "B"),
            target(f"max by (rank) (stragglerwatch_host_cpu_steal_ratio{{{RANKS}}})", "rank {{rank}} steal", "C"),
        ], fieldConfig=_unit("percentunit"), description="Share of time each rank's training thread waited, "
            "runnable, for a CPU (its run-queue delay); the host's CPU pressure (PSI some avg10); hypervisor steal "
            "on the rank's CPUs. A rank whose CPU is contended waits more than its peers."),
        panel(first_id + 1, "Involuntary context switches per rank", "timeseries", (12, y, 12, 8), [
            target(f"stragglerwatch_process_involuntary_switches_per_second{{{RANKS}}}", "rank {{rank}}"),
            target(f"stragglerwatch_workers_involuntary_switches_per_second{{{RANKS}}}", "rank {{rank}} workers",
                   "B"),
        ], fieldConfig=_unit("none"), description="Per second: the training thread's, and its data-loader "
            "workers' (child processes)."),
        panel(first_id + 2, "GPU SM clock per rank", "timeseries", (0, y + 8, 12, 8), [
            target(f"max {gpu} (stragglerwatch_gpu_sm_clock_hertz{{{RANKS}}})", "rank {{rank}} GPU {{gpu}}"),
        ], fieldConfig=_unit("hertz"), description="A GPU held below its peers' clock (thermal, power) slows its "
            "rank: see the reasons below."),
        panel(first_id + 3, "GPU clock slowdown reasons", "timeseries", (12, y + 8, 12, 8), [
            target(f'max by (rank, gpu, reason) (stragglerwatch_gpu_clock_event_reason{{{RANKS}, '
                   f'reason!~"gpu_idle|display_clock_setting"}}) > 0', "rank {{rank}} GPU {{gpu}} {{reason}}"),
        ], fieldConfig=_unit("none"), description="NVML's clock event (throttle) reasons while they hold a GPU's "
            "clocks down: power cap, thermal and hardware slowdowns, power brake, sync boost."),
        panel(first_id + 4, "GPU temperature and power", "timeseries", (0, y + 16, 12, 8), [
            target(f"max {gpu} (stragglerwatch_gpu_temperature_celsius{{{RANKS}}})", "rank {{rank}} °C"),
            target(f"max {gpu} (stragglerwatch_gpu_power_watts{{{RANKS}}}) / max {gpu} "
                   f"(stragglerwatch_gpu_power_limit_watts{{{RANKS}}}) * 100", "rank {{rank}} % of power limit", "B"),
        ], fieldConfig=_unit("none")),
        panel(first_id + 5, "GPU errors", "timeseries", (12, y + 16, 12, 8), [
            target(f"sum {gpu} (increase(stragglerwatch_gpu_pcie_replays_total{{{RANKS}}}[$__rate_interval]))",
                   "rank {{rank}} PCIe replays"),
            target(f"sum {gpu} (increase(stragglerwatch_gpu_nvlink_errors_total{{{RANKS}}}[$__rate_interval]))",
                   "rank {{rank}} NVLink errors", "B"),
            target(f"sum by (rank, gpu, UUID, type) (increase(stragglerwatch_gpu_ecc_errors_total{{{RANKS}}}"
                   f"[$__rate_interval]))", "rank {{rank}} ECC {{type}}", "C"),
            target(f"sum {gpu} (increase(stragglerwatch_gpu_xid_events_total{{{RANKS}}}[$__rate_interval]))",
                   "rank {{rank}} XID", "D"),
        ], fieldConfig=_unit("none"), description="New errors per interval: a degraded PCIe link replays, a "
            "failing NVLink retries; XIDs are the driver's critical errors (last code: stragglerwatch_gpu_last_xid)."),
    ]  # fmt: skip


#: What every work panel's description ends with: what per-rank rates cannot tell.
NO_STEP_COST = ("Per-rank rates average each rank's work over the interval, so imbalance that moves from rank to "
                "rank (a different heaviest batch each step) averages out here; only imbalance that stays on the "
                "same ranks shows. The per-step imbalance cost needs every rank's step side by side and cannot be "
                "computed from these rates: it is in `stragglerwatch analyze` and the Dash dashboard.")  # fmt: skip


def work_panels(first_id: int, y: int) -> list[dict[str, Any]]:
    """Straggler or load imbalance: the work each rank is given (``stragglerwatch_work_total``, the
    steps it was measured on ``stragglerwatch_work_steps_total``), its busy time per unit of work, and
    the job's spread of work across ranks. No series for a run that measures no work."""
    return [
        panel(first_id, "Work per step per rank", "timeseries", (0, y, 12, 8), [
            target(WORK, "rank {{rank}} ({{unit}})"),
        ], fieldConfig=_unit("none"), description="Mean units of work per step (input elements, tokens, or what "
            "the loop noted with note_work) over the steps whose work was measured. A rank given more work is "
            "busier without being slow: that is load imbalance, not a straggler. " + NO_STEP_COST),
        panel(first_id + 1, "Busy time per unit of work per rank", "timeseries", (12, y, 12, 8), [
            target(BUSY_PER_WORK, "rank {{rank}}"),
        ], fieldConfig=_unit("s"), description="Busy seconds over units of work. A straggler (slow for the same "
            "work) stands out here; a rank that merely drew heavier batches does not. stragglerwatch_busy_seconds "
            "counts every step and the work only the steps whose work was measured, so a rank is shown only while "
            "its work was measured on every step of the interval. " + NO_STEP_COST),
        panel(first_id + 2, "Spread of work across ranks", "timeseries", (0, y + 8, 24, 7), [
            target(WORK_SPREAD, "(heaviest - mean) / mean work per step"),
        ], fieldConfig=_unit("percentunit"), description="How much more work per step the heaviest rank was "
            "given than the mean rank, over the interval (0 = balanced). " + NO_STEP_COST),
    ]  # fmt: skip


def overview_dashboard() -> dict[str, Any]:
    """Every run at a glance: ranks, throughput, worst busy ratio, stalls."""
    busy_all = mean("busy_seconds", "", by="run, rank")
    panels = [
        panel(1, "Runs", "table", (0, 0, 24, 8), [
            target("count by (run) (stragglerwatch_steps_total)", "", instant=True, table=True),
            target(f"max by (run) (({busy_all}) / on (run) group_left quantile by (run) (0.5, {busy_all}))", "", "B",
                   instant=True, table=True),
            target("sum by (run) (rate(stragglerwatch_steps_total[$__rate_interval])) / count by (run) "
                   "(stragglerwatch_steps_total)", "", "C", instant=True, table=True),
        ], transformations=[{"id": "merge", "options": {}}, {"id": "organize", "options": {
            "excludeByName": {"Time": True},
            "renameByName": {"Value #A": "ranks", "Value #B": "worst busy / peers", "Value #C": "steps/s"}}}],
            links=[RULES_LINK]),
        panel(2, "Worst busy / peer median per run", "timeseries", (0, 8, 12, 8), [
            target(f"max by (run) (({busy_all}) / on (run) group_left quantile by (run) (0.5, {busy_all}))", "{{run}}"),
        ], fieldConfig=_unit("x")),
        panel(3, "Stalled ranks per run", "timeseries", (12, 8, 12, 8), [
            target("sum by (run) (stragglerwatch_stalled)", "{{run}}"),
        ], fieldConfig=_unit("none")),
    ]  # fmt: skip
    templating = {"list": [_templating()["list"][0]]}
    return _dashboard("stragglerwatch-overview", "stragglerwatch: overview", panels, templating, {"list": []})


def _dashboard(uid: str, title: str, panels: list[dict], templating: dict, annotations: dict) -> dict[str, Any]:
    return {
        "uid": uid, "title": title, "tags": ["stragglerwatch"], "timezone": "browser", "editable": True,
        "schemaVersion": SCHEMA_VERSION, "version": 1, "refresh": "10s",
        "time": {"from": "now-30m", "to": "now"}, "templating": templating, "annotations": annotations,
        "links": [RULES_LINK], "panels": panels,
    }  # fmt: skip


def dashboards() -> dict[str, dict[str, Any]]:
    """File name -> dashboard model."""
    return {"stragglerwatch.json": run_dashboard(), "stragglerwatch-overview.json": overview_dashboard()}


def render(model: dict[str, Any]) -> str:
    return json.dumps(model, indent=2, sort_keys=True) + "\n"


PROVISIONING_DASHBOARDS = """\
# Grafana provisioning: load the dashboards mounted at /var/lib/grafana/dashboards/stragglerwatch.
apiVersion: 1
providers:
  - name: stragglerwatch
    folder: stragglerwatch
    type: file
    allowUiUpdates: true
    options:
      path: /var/lib/grafana/dashboards/stragglerwatch
"""

PROVISIONING_DATASOURCES = """\
# Grafana provisioning: the Prometheus that scrapes the stragglerwatch exporters.
apiVersion: 1
datasources:
  - name: Prometheus
    type: prometheus
    uid: prometheus
    access: proxy
    url: ${PROMETHEUS_URL:-http://localhost:9090}
    isDefault: true
"""

DOCKER_COMPOSE = """\
# Prometheus + Grafana for stragglerwatch, for users with Docker:
#   STRAGGLERWATCH_SD_DIR=/shared/prom-sd docker compose -f grafana/docker-compose.yml up
# (this folder: the repository's grafana/, or one written by `stragglerwatch grafana DIR`).
# Jobs export with STRAGGLERWATCH_PROMETHEUS_PORT=19400 and STRAGGLERWATCH_SD_DIR pointing at the same
# directory. Host networking lets Prometheus reach the ranks' exporters by the addresses they publish.
# Grafana: http://localhost:3000 (admin/admin), folder "stragglerwatch".
services:
  prometheus:
    image: prom/prometheus:latest
    network_mode: host
    command: ["--config.file=/etc/prometheus/prometheus.yml", "--web.listen-address=:9090"]
    volumes:
      - ./compose/prometheus.yml:/etc/prometheus/prometheus.yml:ro
      - ./prometheus:/rules:ro
      - ${STRAGGLERWATCH_SD_DIR:-/tmp/stragglerwatch-sd}:/sd:ro
  grafana:
    image: grafana/grafana:latest
    network_mode: host
    environment:
      PROMETHEUS_URL: http://localhost:9090
    volumes:
      - ./provisioning:/etc/grafana/provisioning:ro
      - ./dashboards:/var/lib/grafana/dashboards/stragglerwatch:ro
"""

COMPOSE_PROMETHEUS = """\
# Prometheus for docker-compose.yml: scrapes every stragglerwatch target file in ${STRAGGLERWATCH_SD_DIR}
# (mounted at /sd) and loads the shipped rules (mounted at /rules).
global:
  scrape_interval: 15s
  evaluation_interval: 15s
rule_files:
  - /rules/stragglerwatch.rules.yml
scrape_configs:
  - job_name: stragglerwatch
    honor_labels: true
    file_sd_configs:
      - files: ['/sd/stragglerwatch-*.json']
        refresh_interval: 5s
"""


def files() -> dict[str, str]:
    """Path (relative to the folder, ``/``-separated) -> text of every file ``stragglerwatch grafana`` writes."""
    from stragglerwatch.presentation.promrules import RULES_FILE, installed_rules

    out = {f"dashboards/{name}": render(model) for name, model in dashboards().items()}
    out["provisioning/dashboards/stragglerwatch.yml"] = PROVISIONING_DASHBOARDS
    out["provisioning/datasources/stragglerwatch.yml"] = PROVISIONING_DATASOURCES
    out["docker-compose.yml"] = DOCKER_COMPOSE
    out["compose/prometheus.yml"] = COMPOSE_PROMETHEUS
    out[f"prometheus/{RULES_FILE}"] = installed_rules().read_text()
    return out


def write(out: Path) -> list[Path]:
    """Write :func:`files` under ``out`` (created, existing files overwritten); the paths written."""
    written = []
    for rel, text in files().items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:] or ["grafana"])[0])
    try:
        written = write(out)
    except OSError as exc:
        print(f"stragglerwatch: error: cannot write {out}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
