"""The documentation's tables against the code, both ways: every name the code has is in its table, and
every row of a table names something real.

- Settings (``docs/instrumenting.md``, Settings): every field of ``Config`` and every ``STRAGGLERWATCH_*``
  variable that any part reads (``config.ENV``, ``DISABLE_ENV``, ``OTHER_ENV``; and every such name in
  the package's and the dashboard service's source), each variable in the row of its field; the
  policies' and the dashboard service's tables name real settings and variables too.
- The report (``docs/analysis.md``, ``analyze --format json``): every key a real report emits, at every
  level (maps keyed by data, such as ``excess_ms`` per cause, aside), and every field of the report's
  dataclasses, is in the row of its top-level key; every key a row names exists. Values are written
  quoted (`` `"store"` ``), so that a backticked bare word is a key and is checked. The reports are
  real: simulated run dirs, the committed real run and PyTorch logs, a published op-level trace, and
  (distributed) a real 2-rank job that hangs and is ended by the hang policy.
- Prometheus (``docs/prometheus-grafana.md``): every metric family the exporter's collectors yield is
  in the series table, and every series listed is one of them; the rules table against the shipped
  rules file.
- What an ``on_straggler`` action is told (``docs/policies.md``); the files a real job leaves in its run dir
  (``docs/run-dir.md``).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import EXAMPLE, ROOT

DOCS = ROOT / "docs"
LOGS = ROOT / "tests" / "data" / "pytorch-logs"
TRACES = ROOT / "tests" / "data" / "whatif-traces"
REAL_RUN = ROOT / "tests" / "data" / "varlen-mlp-4ranks"
ENV_VAR = re.compile(r"STRAGGLERWATCH_[A-Z][A-Z0-9_]*")
IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
#: Objects of the report whose keys are data, not names (a cause, a phase, an action): their keys are not
#: looked for in the table. Paths are keys from the top, lists and rank-numbered levels left out.
DATA_MAPS = {
    ("stragglers", "excess_ms"): "per cause",
    ("stragglers", "gap_ms"): "per gap of untimed time",
    ("imbalance", "phase_seconds_per_unit"): "per phase",
    ("actions", "verdict"): "what the actions were told: the table of docs/policies.md",
    ("actions", "declined"): "per action",
    ("arrivals", "groups_skipped"): "per process group",
    ("log_events", "detail"): "per kind of message",
}


# -- reading the pages' tables ---------------------------------------------------------------------------------
def split_row(line: str) -> list[str]:
    """The cells of a Markdown table row; a ``|`` inside backticks is text, not a border."""
    cells, cell, code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            code = not code
        if ch == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += ch
    return [*cells, cell.strip()]


def table(page: Path, heading: str, header: str) -> list[tuple[str, list[str]]]:
    """The rows (line, cells) of the first table in the section ``heading`` (a line of the page, up to the next
    heading of its level or above) whose first header cell starts with ``header``."""
    lines = page.read_text().splitlines()
    assert heading in lines, f"{page.name}: no heading {heading!r}"
    level = len(heading) - len(heading.lstrip("#"))
    rows: list[tuple[str, list[str]]] = []
    found = fenced = False
    for line in lines[lines.index(heading) + 1 :]:
        fenced = fenced != line.lstrip().startswith("```")
        if not fenced and re.match(rf"#{{1,{level}}} ", line):
            break
        if line.startswith("|") and (found or not rows):
            found = found or split_row(line)[0].startswith(header)
            rows.append((line, split_row(line)))
        elif found and not line.startswith("|"):
            break
        elif not line.startswith("|"):
            rows = []
    assert found, f"{page.name}: no table with a {header!r} column in the section {heading!r}"
    return rows[2:]  # the header and its |---| line


def ticks(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def keys_named(text: str) -> set[str]:
    """The keys a table cell names: its backticked names (dotted: a path). A quoted word is a value."""
    return {t for t in ticks(text) if KEY.fullmatch(t)}


# -- settings and environment variables --------------------------------------------------------------------------
def source_env_vars() -> set[str]:
    """Every ``STRAGGLERWATCH_*`` name in the package's and the dashboard service's source."""
    files = [*(ROOT / "stragglerwatch").rglob("*.py"), *(ROOT / "dashboard").iterdir()]
    return {v for f in files if f.is_file() for v in ENV_VAR.findall(f.read_text(errors="replace"))}


def test_the_settings_tables_name_every_setting_and_variable_and_nothing_else() -> None:
    from stragglerwatch.runtime import config

    fields = {f.name for f in dataclasses.fields(config.Config)}
    setting_vars = {*config.ENV.values(), config.DISABLE_ENV}
    problems: list[str] = []
    named: dict[str, set[str]] = {"fields": set(), "vars": set(), "other": set()}
    for line, cells in table(DOCS / "instrumenting.md", "## Settings", "setting"):
        tokens, row_vars = ticks(cells[0]), set(ENV_VAR.findall(cells[0]))
        row_fields = {t for t in tokens if t in fields}
        if not tokens:
            problems.append(f"instrumenting.md, settings: a row that names no setting: {line[:80]}")
        problems += [f"instrumenting.md, settings: {t!r} is no field of Config: {line[:80]}" for t in tokens
                     if t not in fields and not ENV_VAR.search(t)]  # fmt: skip
        problems += [f"instrumenting.md, settings: {v} is no setting's variable: {line[:80]}"
                     for v in sorted(row_vars - setting_vars)]  # fmt: skip
        problems += [f"instrumenting.md, settings: {f!r} without its variable {config.ENV[f]}: {line[:80]}"
                     for f in sorted(row_fields) if f in config.ENV and config.ENV[f] not in row_vars]  # fmt: skip
        problems += [f"instrumenting.md, settings: {v} in a row without its field {f!r}: {line[:80]}"
                     for f, v in config.ENV.items() if v in row_vars and f not in row_fields]  # fmt: skip
        if config.DISABLE_ENV in row_vars and "enabled" not in row_fields:
            problems.append(f"instrumenting.md, settings: {config.DISABLE_ENV} is the variable of 'enabled': {line}")
        named["fields"] |= row_fields
        named["vars"] |= row_vars
    for line, cells in table(DOCS / "instrumenting.md", "## Settings", "other variable"):
        row_vars = set(ENV_VAR.findall(cells[0]))
        if not row_vars or len(row_vars) != len(ticks(cells[0])):
            problems.append(f"instrumenting.md, other variables: a row that names no variable: {line[:80]}")
        problems += [f"instrumenting.md, other variables: nothing reads {v}: {line[:80]}"
                     for v in sorted(row_vars - config.OTHER_ENV)]  # fmt: skip
        named["other"] |= row_vars
    problems += [f"instrumenting.md, settings: Config.{f} is missing" for f in sorted(fields - named["fields"])]
    problems += [f"instrumenting.md, settings: {v} is missing" for v in sorted(setting_vars - named["vars"])]
    problems += [f"instrumenting.md, other variables: {v} is missing"
                 for v in sorted(config.OTHER_ENV - named["other"])]  # fmt: skip
    read = source_env_vars()
    problems += [f"the code reads {v}, which config.unknown_env() calls a typo (add it to OTHER_ENV)"
                 for v in sorted(read - setting_vars - config.OTHER_ENV)]  # fmt: skip
    for line, cells in table(DOCS / "policies.md", "# Policies: act on a hang or a bad node", "setting"):
        (field,) = ticks(cells[0]) or [""]
        if field not in fields:
            problems.append(f"policies.md: {field!r} is no field of Config: {line[:80]}")
        elif set(ENV_VAR.findall(cells[1])) != ({config.ENV[field]} if field in config.ENV else set()):
            problems.append(f"policies.md: the variable of {field!r} is {config.ENV.get(field)}: {line[:100]}")
    for line, cells in table(DOCS / "dashboard.md", "## As a service (gunicorn)", "variable"):
        row_vars = set(ENV_VAR.findall(cells[0]))
        if not row_vars or not row_vars <= config.OTHER_ENV & read:
            problems.append(f"dashboard.md: a row that names no variable the service reads: {line[:80]}")
    assert not problems, "\n".join(problems)


# -- the report's JSON -----------------------------------------------------------------------------------------
def walk(value: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The key paths of a report (lists and keys that are data, such as rank numbers, left out of the path)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not IDENT.fullmatch(str(k)):
                yield from walk(v, path)  # keyed by data (a rank, a thread): its values' keys are names
                continue
            yield (*path, k)
            if (*path, k) not in DATA_MAPS:
                yield from walk(v, (*path, k))
    elif isinstance(value, list):
        for v in value:
            yield from walk(v, path)


def dataclass_of(hint: Any) -> type | None:
    """The dataclass a field holds (itself, in a list, or optional), if any."""
    if dataclasses.is_dataclass(hint):
        return hint  # type: ignore[return-value]
    for arg in typing.get_args(hint):
        found = dataclass_of(arg)
        if found is not None:
            return found
    return None


def field_paths(cls: type, path: tuple[str, ...]) -> Iterator[tuple[str, ...]]:
    """The key paths a dataclass gives the JSON, nested dataclasses included."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        yield (*path, f.name)
        inner = dataclass_of(hints[f.name])
        if inner is not None and (*path, f.name) not in DATA_MAPS:
            yield from field_paths(inner, (*path, f.name))


def typed_paths() -> tuple[set[tuple[str, ...]], set[str]]:
    """The key paths the report's dataclasses (and PyTorch log messages') give, and the top-level keys whose
    values are typed (where the dataclasses decide which keys exist)."""
    from stragglerwatch.analysis.reportschema import Report
    from stragglerwatch.evidence.logevent import LogEvent

    paths = {("schema",)} | {p for p in field_paths(Report, ()) if p != ("extra",)}
    paths |= set(field_paths(LogEvent, ("log_events",)))
    hints = typing.get_type_hints(Report)
    typed = {f.name for f in dataclasses.fields(Report) if dataclass_of(hints[f.name]) is not None} | {"log_events"}
    return paths, typed


def source_keys() -> set[str]:
    """Every string the package uses as a key (of a dict literal, a subscript, ``.get()`` and the like, a
    keyword argument): a key a report may hold though no report here shows it."""
    out: set[str] = set()
    for f in (ROOT / "stragglerwatch").rglob("*.py"):
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Dict):
                out |= {k.value for k in n.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
            elif isinstance(n, ast.Subscript) and isinstance(n.slice, ast.Constant):
                out.add(str(n.slice.value))
            elif isinstance(n, ast.Call):
                out |= {k.arg for k in n.keywords if k.arg}
                name = n.func.attr if isinstance(n.func, ast.Attribute) else ""
                if name in ("get", "pop", "setdefault") and n.args and isinstance(n.args[0], ast.Constant):
                    out.add(str(n.args[0].value))
    return out


def json_table() -> list[tuple[str, set[str], set[str]]]:
    """The rows of the report's key table: (line, the top-level keys, the keys its meaning names)."""
    rows = []
    for line, cells in table(DOCS / "analysis.md", "## `analyze --format json`", "key"):
        top = keys_named(cells[0])
        assert top and len(top) == len(ticks(cells[0])), f"analysis.md: a row that names no key: {line[:80]}"
        rows.append((line, top, keys_named(cells[1])))
    return rows


def report_problems(reports: list[dict[str, Any]], both_ways: bool = True) -> list[str]:
    """What the key table of ``analysis.md`` and the reports disagree on: a key of theirs it lacks, and (``both_ways``:
    the reports are every kind the table speaks of) a key it names that none has."""
    typed, typed_tops = typed_paths()
    seen = {p for r in reports for p in walk(r)}
    everything = seen | typed
    rows = json_table()
    problems: list[str] = []
    row_of = {top: (line, named) for line, tops, named in rows for top in tops}
    for path in sorted(everything):
        if path[0] not in row_of:
            problems.append(f"analysis.md: the report's key {path[0]!r} has no row")
        elif len(path) > 1 and path[-1] not in {k for n in row_of[path[0]][1] for k in n.split(".")}:
            problems.append(f"analysis.md: {'.'.join(path)} is missing from the row of {path[0]!r}")
    if not both_ways:
        return sorted(set(problems))
    tops = {p[0] for p in everything}
    anywhere = {p[-1] for p in everything}
    strings = source_keys()
    for line, row_tops, named in rows:
        problems += [f"analysis.md: the report has no key {t!r}: {line[:80]}" for t in sorted(row_tops - tops)]
        may_be = bool(row_tops - typed_tops)  # untyped values: a key no report here shows may still be in the code
        for name in sorted(named):  # its own keys, or another row's (a cross-reference); dotted: a path
            parts = tuple(name.split("."))
            known = any(p[-len(parts) :] == parts for p in everything) if len(parts) > 1 else name in anywhere
            if not known and not (may_be and len(parts) == 1 and name in strings):
                problems.append(f"analysis.md: no report has a key {name!r} (row {sorted(row_tops)}): {line[:80]}")
    return sorted(set(problems))


def as_json(report: Any) -> dict[str, Any]:
    return json.loads(json.dumps(report.to_dict() if hasattr(report, "to_dict") else report))


def test_the_report_keys_and_the_json_table_match(tmp_path: Path) -> None:
    import stragglerwatch
    from stragglerwatch.analysis.reportschema import Report
    from stragglerwatch.evidence.traces import analyze_trace
    from stragglerwatch.record.simulate import Injection, SimConfig, write_run

    # 8 ranks in two peer groups, with tokens, a restart and context samples; a data straggler with the
    # I/O evidence of its host, a compute straggler that ends; and PyTorch's real failure logs beside them
    slow = [Injection(5, 0.3, 60, "data", evidence="io"), Injection(2, 0.15, 300, end=340)]
    cfg = SimConfig(ranks=8, steps=400, seed=3, groups=2, tokens=2000, restart_at=250, context_every=5, injections=slow)
    simulated = stragglerwatch.analyze(write_run(tmp_path / "sim", cfg), logs=sorted(LOGS.glob("*.log")))
    trace = analyze_trace(TRACES / "trace-ST.parquet", TRACES / "meta-ST.yaml").report
    reports = [as_json(simulated), as_json(stragglerwatch.analyze(REAL_RUN)), as_json(Report.from_dict(trace))]
    assert reports[0]["stragglers"] and reports[0]["log_events"] and reports[2]["whatif"], "what the table is held to"
    problems = report_problems(reports)
    assert not problems, "\n".join(problems)


def test_the_verdict_table_of_the_policies_is_the_verdict() -> None:
    """What an ``on_straggler`` action is told (``policy.verdict``, the report's ``actions[].verdict``),
    against its table in ``policies.md``, both ways."""
    from stragglerwatch.analysis.policy import verdict

    told = verdict({"rank": 3, "first_step": 10, "time_span": [1.0, 2.0], "cause": "compute"})
    rows = table(DOCS / "policies.md", "## Route around a bad node: `on_straggler`", "key")
    named = {k for _, cells in rows for k in keys_named(cells[0])}
    assert named == set(told), f"documented but not told: {sorted(named - set(told))}; " \
                               f"told but not documented: {sorted(set(told) - named)}"  # fmt: skip


# -- Prometheus --------------------------------------------------------------------------------------------------
def exporter_series(tmp_path: Path) -> set[str]:
    """The series names (as a scrape shows them) of every family the exporter's collectors yield: a rank's step
    figures with every optional family on, its host and GPU context (a fake NVML GPU: this machine has none)
    with every gauge the context collector declares, and the code sampler's."""
    from fake_nvml import Device, FakeNVML
    from synthetic_ranks import step_record

    from stragglerwatch.record.rundir import RunInfo
    from stragglerwatch.runtime.context import ctxmetrics
    from stragglerwatch.runtime.context.codemetrics import CodeCollector
    from stragglerwatch.runtime.context.codesampler import CodeSampler
    from stragglerwatch.runtime.context.gpuctx import GpuSampler
    from stragglerwatch.runtime.context.sampler import ContextSampler
    from stragglerwatch.runtime.output.exporter import RankCollector, RankMetrics

    metrics = RankMetrics()
    metrics.observe([step_record(0, 0, time.time(), work=4096.0)])
    acted = [{"rank": 1, "host": "node-1", "cause": "compute"}]
    rank = RankCollector(metrics, RunInfo("r", tmp_path, 0, 0, 2, "node-0"), errors=lambda: 0,
                         unavailable=lambda: ["a reason"], policy=lambda: ({"straggler": 1}, acted))  # fmt: skip
    context = ContextSampler(None, 0, open_gpu_sampler=lambda: None)
    context.gpu = GpuSampler(FakeNVML([Device(index=0, uuid="GPU-1", reasons=0x40, nvlinks=1)]), 0)
    context.sample_once()
    code = CodeSampler(None, 0, lambda: None)
    suffix = {"counter": "_total", "info": "_info"}
    families = [*rank.collect(), *ctxmetrics.ContextCollector(context, "r", 0, "node-0").collect(),
                *CodeCollector(code, "r", 0).collect()]  # fmt: skip
    names = {f.name + suffix.get(f.type, "") for f in families}
    # a gauge the host cannot read here (no /proc/pressure, say) is still one the collector serves elsewhere
    declared = [m for m, *_ in (*ctxmetrics.HOST, *ctxmetrics.GPU)]
    return names | {f"stragglerwatch_{m}" for m in declared}


def test_the_prometheus_tables_list_every_series_and_rule(tmp_path: Path) -> None:
    page = DOCS / "prometheus-grafana.md"
    served = exporter_series(tmp_path)
    problems, listed = [], set()
    for line, cells in table(page, "## Prometheus", "series"):
        names = {t.split("{")[0] for t in ticks(cells[0])}
        if not names:
            problems.append(f"{page.name}: a series row that names no series: {line[:80]}")
        problems += [f"{page.name}: the exporter serves no {n}: {line[:80]}" for n in sorted(names - served)]
        listed |= names
    problems += [f"{page.name}: {n} is missing from the series table" for n in sorted(served - listed)]
    rules = (ROOT / "stragglerwatch" / "presentation" / "data" / "stragglerwatch.rules.yml").read_text()
    shipped = set(re.findall(r"^\s*- (?:record|alert): (\S+)$", rules, re.M))
    assert len(shipped) >= 8, "the rules file's recording rules and alerts"
    documented = set()
    for line, cells in table(page, "## Prometheus", "rule"):
        names = set(ticks(cells[0]))
        kind = "recording" if all(":" in n for n in names) else "alert"
        if not names or cells[1] != kind:
            problems.append(f"{page.name}: a rule row must name recording rules or alerts, and say which: {line[:80]}")
        problems += [f"{page.name}: no shipped rule is named {n}: {line[:80]}" for n in sorted(names - shipped)]
        documented |= names
    problems += [f"{page.name}: the shipped rule {n} is missing from the rules table"
                 for n in sorted(shipped - documented)]  # fmt: skip
    assert not problems, "\n".join(problems)


# -- a real job: its report and its run dir ----------------------------------------------------------------------
def run_dir_patterns() -> list[re.Pattern[str]]:
    """The files ``docs/run-dir.md`` says a run dir holds, as patterns (a rank's number: any)."""
    text = (DOCS / "run-dir.md").read_text()
    block = text.split("## The files of a run dir", 1)[1].split("```text", 1)[1].split("```", 1)[0]
    names = re.findall(r"[\w<>.-]+\.(?:json|jsonl|arrows|parquet|txt|pkl|html)\b", block)
    return [re.compile(re.escape(n).replace("00000", r"\d{5}").replace(re.escape("<run>"), ".+") + r"(\.slurm)?")
            for n in names]  # fmt: skip


@pytest.mark.distributed
def test_a_real_hang_ended_by_the_policy_matches_the_docs(tmp_path: Path) -> None:
    """2 gloo ranks; rank 1 stalls for good at step 8; the hang policy ends the job (status 75), the watchdog
    having dumped Flight Recorder on both. Its report, with torchrun's log, has every key of a hang, an
    action, the dumps, the logs and the arrival order: each must be in the key table, and every file the
    ranks wrote in the run dir must be one the run-dir page lists."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(EXAMPLE),
           "--steps", "14", "--stall-rank", "1", "--stall-at-step", "8", "--stall-seconds", "40",
           "--watchdog-timeout", "2", "--pg-timeout", "30", "--run-dir", str(run)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_FR_BUFFER_SIZE": "200",
           "STRAGGLERWATCH_ON_HANG": "abort", "STRAGGLERWATCH_HANG_ABORT_S": "6"}  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0, "the hang policy ended the job"
    log = tmp_path / "torchrun.log"
    log.write_text(proc.stdout + proc.stderr)
    import stragglerwatch

    report = as_json(stragglerwatch.analyze(run, logs=[log]))
    assert report["hangs"] and report["actions"] and report["flight_recorder"]["groups"] and report["arrivals"]
    assert report["log_events"] and report["hang_verdict"]["evidence"], "what the table is held to"
    problems = report_problems([report], both_ways=False)  # the other kinds: the fast test's reports
    patterns = run_dir_patterns()
    problems += [f"run-dir.md: the run dir holds {p.name}, which the page does not list"
                 for p in sorted(run.iterdir()) if not any(r.fullmatch(p.name) for r in patterns)]  # fmt: skip
    assert not problems, "\n".join(problems)
