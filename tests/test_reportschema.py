"""The report's typed schema: every report the analysis writes reads back into it and out again unchanged."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from stragglerwatch.analysis.report import analyze_run
from stragglerwatch.analysis.reportschema import _FLAT, REPORT_SCHEMA, RankRow, Report, StragglerEntry, _plain
from stragglerwatch.evidence.traces import analyze_trace
from stragglerwatch.record.simulate import Injection, SimConfig, write_run

DATA = Path(__file__).parent / "data" / "whatif-traces"


def test_a_run_report_round_trips_through_its_types(tmp_path):
    cfg = SimConfig(ranks=16, steps=300, seed=4, injections=[Injection(9, 0.2, 80, "data")])
    run = write_run(tmp_path / "run", cfg)
    analysis = analyze_run(run)
    text = json.loads(json.dumps(analysis.report))
    typed = Report.from_dict(text)
    assert typed == analysis.typed and typed.to_dict() == text and list(typed.to_dict()) == list(text)
    assert isinstance(typed.stragglers[0], StragglerEntry) and typed.stragglers[0].rank == 9
    assert typed.ranks[9].flagged and typed.attempts and typed.attempts[0].first_step == 0 and not typed.extra


def test_a_trace_report_keeps_its_what_if_as_extra():
    analysis = analyze_trace(DATA / "trace-ST.parquet", DATA / "meta-ST.yaml")
    text = json.loads(json.dumps(analysis.report))
    typed = Report.from_dict(text)
    assert "attribution" in typed.extra and typed.to_dict() == text


def test_another_schema_is_refused():
    with pytest.raises(ValueError, match=REPORT_SCHEMA):
        Report.from_dict({"schema": "stragglerwatch-report/0"})


def test_a_rank_row_becomes_the_dict_of_its_fields_in_their_order():
    row = RankRow(rank=3, host="node-1", role=None, steps=12, step_ms=1.5, busy_ms=1.25, comm_wait_ms=None,
                  data_wait_ms=0.5, forward_ms=0.25, backward_ms=0.5, allreduce_wait_ms=None, collective_wait_ms=0.0,
                  eval_ms=None, optimizer_ms=0.125, other_ms=0.0, busy_vs_peers=1.0625, flagged=True)  # fmt: skip
    row.work, row.busy_per_work_us = 4096.0, 0.3
    plain = _plain([row])[0]
    assert plain == dataclasses.asdict(row) and list(plain) == [f.name for f in dataclasses.fields(RankRow)]
    assert plain is not row.__dict__
    # the copy of the attributes is the dict of the fields only for rows whose every field is a scalar
    scalars = {"int", "float", "str", "bool", "None"}
    for kind in _FLAT:
        for f in dataclasses.fields(kind):
            assert set(str(f.type).replace(" ", "").split("|")) <= scalars, (kind.__name__, f.name, f.type)
