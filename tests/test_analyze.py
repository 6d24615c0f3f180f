"""``stragglerwatch analyze`` and ``simulate`` through the CLI, on real 4-rank gloo runs and simulated runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import EXAMPLE, analyze_json, launch

from stragglerwatch.cli.commands import main as cli


def check_contract(report: dict, world: int) -> None:
    for key in ("world_size", "steps", "job_slowdown", "lost_seconds", "stragglers", "hangs", "ranks"):
        assert key in report
    assert report["world_size"] == world and len(report["ranks"]) == world
    assert report["hangs"] == []
    for s in report["stragglers"]:
        assert {"rank", "cause", "slowdown", "first_step", "last_step", "lost_seconds"} <= set(s)


@pytest.mark.distributed
def test_real_compute_straggler(compute_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = analyze_json(compute_run, capsys)
    check_contract(report, 4)
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(2, "compute")]
    s = report["stragglers"][0]
    assert abs(s["first_step"] - 10) <= 10 and s["detected_step"] <= 10 + 30
    assert s["slowdown"] > 1.5 and s["lost_seconds"] > 0.3
    assert report["job_slowdown"] > 1.2
    assert [r["flagged"] for r in report["ranks"]] == [False, False, True, False]
    # the code sampler (on by default) names the injection: the slow autograd function's sleeps
    assert s["code"], s["code_note"]
    site = s["code"][0]["site"]
    assert "demo_job.py" in site and site.split()[-1] in ("forward", "backward"), s["code"]


@pytest.mark.distributed
def test_real_data_straggler(data_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = analyze_json(data_run, capsys)
    check_contract(report, 4)
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(1, "data")]
    (s,) = report["stragglers"]
    assert abs(s["first_step"] - 15) <= 10
    assert s["code"] and s["code"][0]["site"].endswith("__iter__"), s["code"]  # the slow loader's sleep
    assert "demo_job.py" in s["code"][0]["site"] and s["code"][0]["native"]


@pytest.mark.distributed
@pytest.mark.parametrize("cause", ["optimizer", "other"])
def test_real_host_side_stragglers(cause: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    launch(4, EXAMPLE, "--steps", "50", "--slow-rank", "3", "--delay", "0.02", "--cause", cause,
             "--from-step", "5", "--run-dir", str(run))  # fmt: skip
    report = analyze_json(run, capsys)
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(3, cause)]


@pytest.mark.distributed
def test_real_healthy_run_has_no_flag(healthy_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = analyze_json(healthy_run, capsys)
    check_contract(report, 4)
    assert report["stragglers"] == [] and report["group_imbalance"] == []


@pytest.mark.distributed
def test_text_and_html_reports(compute_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["analyze", str(compute_run)]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[2] == "1 straggler:" and "rank 2 is" in lines[3] and "compute" in text
    assert max(len(line) for line in lines) <= 80
    out = tmp_path / "r.html"
    assert cli(["analyze", str(compute_run), "--format", "html", "--out", str(out)]) == 0
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and "rank 2 is" in page
    assert "where in the code" in page and "demo_job.py" in page, "the straggler's code location"
    assert "code: of its extra" in text and "demo_job.py" in text
    # every rank trains on batches of one shape: the work (the input's elements) is recorded, equal on
    # every rank in every step, so the verdict says nothing of imbalance; the work table still shows it
    assert "imbalance" not in text.split("per rank (medians")[0]
    assert cli(["analyze", str(compute_run), "--format", "json"]) == 0
    imbalance = json.loads(capsys.readouterr().out)["imbalance"]
    assert imbalance["varies"] is False and imbalance["detected"] is False
    assert "work per rank (medians; work in elements per step" in text and "<th>elements/step</th>" in page
    assert page.count("Plotly.newPlot") == 6, ("heatmap, breakdown, busy band, the straggler's host context, the "
                                               "work per step and busy time against work")  # fmt: skip
    assert "<script src=" not in page, "self-contained: plotly.js inlined"


def test_simulate_then_analyze(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "sim"
    args = ["simulate", str(run), "--ranks", "48", "--steps", "300", "--straggler", "7:1.2:100:data",
            "--straggler", "30:1.12:50:optimizer:200", "--groups", "2"]  # fmt: skip
    assert cli(args) == 0
    truth = json.loads((run / "run.json").read_text())["simulation"]
    assert len(truth["injections"]) == 2
    report = analyze_json(run, capsys)
    check_contract(report, 48)
    got = {(s["rank"], s["cause"]) for s in report["stragglers"]}
    assert got == {(7, "data"), (30, "optimizer")}
    ended = next(s for s in report["stragglers"] if s["rank"] == 30)
    assert abs(ended["last_step"] - 199) <= 10
    assert {r["role"] for r in report["ranks"]} == {"group0", "group1"}


def test_one_entry_per_rank_with_its_episodes_and_brief_flags_as_details(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rank slow twice, 600 steps apart, is one straggler of two episodes, each detected after its own
    onset; a rank 8% slower for 90 steps of 2,000 (fixing it saves well under 0.5% of the job) is a brief
    flag in the details, in the JSON and the text."""
    run = tmp_path / "sim"
    args = ["simulate", str(run), "--ranks", "8", "--steps", "2000", "--straggler", "3:1.08:700:compute:790",
            "--straggler", "5:1.3:100:data:300", "--straggler", "5:1.3:900:data"]  # fmt: skip
    assert cli(args) == 0
    capsys.readouterr()
    report = analyze_json(run, capsys)
    (s,) = report["stragglers"]
    assert s["rank"] == 5 and s["cause"] == "data" and s["last_step"] is None and len(s["episode_spans"]) == 2
    (a, b, d1), (c, end, d2) = s["episodes"]
    assert abs(a - 100) <= 5 and abs(b - 300) <= 5 and 100 <= d1 <= 130 and abs(c - 900) <= 5 and end is None
    assert 900 <= d2 <= 930
    (m,) = report["minor"]
    assert m["rank"] == 3 and m["cause"] == "compute" and m["saves_seconds"] < 0.005 * report["job_seconds"]
    assert cli(["analyze", str(run)]) == 0
    text = capsys.readouterr().out
    assert "in 2 episodes (steps 100-" in text and "brief flags of negligible cost" in text and "rank 3 (" in text


def test_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["analyze", str(tmp_path / "missing")], "not a directory"),
        (["analyze", str(tmp_path)], "not a stragglerwatch run dir"),
        (["simulate", str(tmp_path / "x"), "--ranks", "4", "--steps", "10", "--straggler", "9:1.1"], "outside"),
        (["simulate", str(tmp_path / "x"), "--ranks", "4", "--steps", "10", "--straggler", "1:1.1:0:gpu"], "cause"),
        (["simulate", str(tmp_path / "x"), "--ranks", "4", "--steps", "10", "--straggler", "1:0.2"],
         "did you mean 1.2"),
        (["simulate", str(tmp_path / "x"), "--ranks", "0", "--steps", "10"], "at least 1"),
    ]
    for argv, needle in cases:
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("stragglerwatch") and "error:" in err[0] and needle in err[0], err
    for window, needle in (("100", "100 steps: a window holds at least 1024"), ("2k", "not a whole number of steps")):
        with pytest.raises(SystemExit) as exited:  # an option argparse refuses
            cli(["dashboard", str(tmp_path), "--window", window])
        err = capsys.readouterr().err.strip().splitlines()
        assert exited.value.code == 2 and len(err) == 1 and "error: argument --window" in err[0] and needle in err[0]


def test_empty_and_unreadable_runs(make_run, capsys: pytest.CaptureFixture[str]) -> None:
    run = make_run(2)
    assert cli(["analyze", str(run)]) == 2
    assert capsys.readouterr().err.strip().endswith("empty run (no step recorded yet)")
    bad = [run / f"rank-{r:05d}.{'arrows' if r % 2 else 'parquet'}" for r in range(6)]
    for f in bad:  # one line each, in file order (the files are read on several threads)
        f.write_bytes(b"garbage" if f.suffix == ".arrows" else b"PAR1 not really")
    assert cli(["analyze", str(run), "--format", "json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": ")[2] for line in err[:-1]] == [str(f) for f in bad], err
    assert all(line.startswith("stragglerwatch: warning:") for line in err[:-1]) and "empty run" in err[-1]


def test_schema_1_0_logs_stay_readable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A run written before comm_wait_s existed (tests/data/schema-1.0-run), as Parquet and as an Arrow stream."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    import stragglerwatch

    old = Path(__file__).parent / "data" / "schema-1.0-run"
    assert pq.read_schema(old / "rank-00000.parquet").metadata[b"stragglerwatch.schema_version"] == b"1.0"
    run = tmp_path / "run"
    shutil.copytree(old, run)
    table = pq.read_table(run / "rank-00001.parquet")  # rank 1 as a crashed rank leaves it: a stream
    with pa.OSFile(str(run / "rank-00001.arrows"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    (run / "rank-00001.parquet").unlink()
    df = stragglerwatch.load_run(run)
    assert not df.duplicated(["rank", "step"]).any() and len(df) == 80
    assert (df["comm_wait_s"] == df["allreduce_wait_s"]).all()
    assert (df["collective_wait_s"] == 0).all() and (df["eval_s"] == 0).all()
    report = analyze_json(run, capsys)
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(1, "compute")]
    assert report["busy_unavailable"] == []


def sim_analysis(run: Path, **config):
    """``analyze_run`` of a simulated 8-rank run (``config``: more of its ``SimConfig``)."""
    from stragglerwatch.analysis.report import analyze_run
    from stragglerwatch.record.simulate import SimConfig, write_run

    return analyze_run(write_run(run, SimConfig(ranks=8, steps=200, seed=1, **config)))


def test_text_report_shows_the_load_imbalance(tmp_path: Path) -> None:
    """A run whose ranks draw batches of unequal tokens: the cost, what work explains, what to try,
    and each rank's work and busy time per token, in 80 columns."""
    from stragglerwatch.presentation.render import render_text

    report = sim_analysis(tmp_path / "run", tokens=4096).report
    imb = report["imbalance"]
    assert imb["detected"] and imb["unit"] == "tokens" and report["stragglers"] == []
    text = render_text(report)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "load imbalance: ranks got unequal tokens in the same step (not a slow rank):" in lines
    flat = " ".join(text.split())
    assert (f"imbalance cost {imb['lost_seconds']:.1f} s, {imb['lost_gpu_seconds']:.0f} GPU-s (S {imb['slowdown']:.2f} "
            f"from imbalance alone), work size explains {imb['explained']:.0%} of the spread of busy time across "
            "ranks") in flat  # fmt: skip
    assert f"one more token costs a healthy rank {imb['seconds_per_unit'] * 1e6:.3g} µs" in flat
    assert sum(line.startswith("    try: ") for line in lines) == len(imb["hints"]) >= 1
    split = report["lost_split"]
    assert split["imbalance"] > 0 and split["stragglers"] == 0.0
    assert f"{split['imbalance']:.1f} s to unequal work" in flat and "to jitter" in flat
    head = lines.index("work per rank (medians; work in tokens per step, busy µs per token):")
    assert lines[head + 1].split() == ["rank", "work/step", "busy/token", "busy", "ms", "vs", "peers"]
    for row, line in zip(report["ranks"], lines[head + 2 :], strict=True):
        rank, work, per = line.split()[:3]
        assert int(rank) == row["rank"] and float(work.replace(",", "")) == pytest.approx(row["work"], abs=0.5)
        assert float(per) == pytest.approx(row["busy_per_work_us"], rel=0.01)


def test_text_report_of_each_imbalance_case(tmp_path: Path) -> None:
    """Not detected, a figure missing, the heaviest ranks: each as a line of its own."""
    from stragglerwatch.presentation.render import render_text, verdict_lines

    report = sim_analysis(tmp_path / "run", tokens=4096, token_mode="balanced").report
    assert report["imbalance"]["detected"] is False
    assert "work per step recorded (tokens): no load imbalance worth reporting (S 1.00x)." in verdict_lines(report)
    assert "load imbalance:" not in render_text(report) and "work per rank (medians" in render_text(report)
    noted = verdict_lines({**report, "imbalance": {**report["imbalance"], "note": "work recorded on one rank only"}})
    at = noted.index("work per step recorded (tokens): no load imbalance worth reporting (S 1.00x).")
    assert noted[at + 1] == "  note: work recorded on one rank only"
    made = {"unit": "tokens", "steps": 200, "detected": True, "lost_seconds": 12.34, "lost_gpu_seconds": 98.7,
            "slowdown": 1.08, "explained": 0.71, "seconds_per_unit": None, "work_spread": 0.24,
            "heaviest_ranks": [3, 5], "heaviest_share": 0.4, "phase_seconds_per_unit": {},
            "hints": ["pack sequences into a fixed token budget"], "note": None}  # fmt: skip
    lines = verdict_lines({**report, "imbalance": made})
    at = lines.index("load imbalance: ranks got unequal tokens in the same step (not a slow rank):")
    assert lines[at + 1 : at + 4] == [
        "  imbalance cost 12.3 s, 99 GPU-s (S 1.08 from imbalance alone), work size explains 71% of the spread of "
        "busy time across ranks",
        "    work: a step's heaviest rank has 24% more tokens than the mean (median over steps); heaviest most "
        "often: ranks 3, 5 (the first in 40% of the steps)",
        "    try: pack sequences into a fixed token budget",
    ]  # fmt: skip
    note = "busy time per token unknown: work recorded on one rank per group"
    missing = {**made, "lost_seconds": None, "lost_gpu_seconds": None, "slowdown": None, "work_spread": None,
               "heaviest_ranks": [], "note": note}  # fmt: skip
    lines = verdict_lines({**report, "imbalance": missing})
    at = lines.index("load imbalance: ranks got unequal tokens in the same step (not a slow rank):")
    assert lines[at + 1] == "  work size explains 71% of the spread of busy time across ranks"
    assert lines[at + 3] == f"    note: {note}"
    assert max(len(line) for line in render_text({**report, "imbalance": missing}).splitlines()) <= 80


def test_html_report_shows_the_load_imbalance(tmp_path: Path) -> None:
    from stragglerwatch.presentation.htmlreport import render_html

    analysis = sim_analysis(tmp_path / "run", tokens=4096)
    page = render_html(analysis)
    assert "<h2>Load imbalance</h2>" in page and "class='verdict'" in page, "an imbalance is no healthy run"
    imb = analysis.report["imbalance"]
    assert f"<td>{imb['explained']:.0%}</td>" in page and f"<li>{imb['hints'][0]}" in page.replace("&#x27;", "'")
    assert "Work per step (tokens), rank x step" in page and "Busy time vs work" in page
    assert page.count("Plotly.newPlot") == 4, "heatmap, breakdown, work per step and busy time vs work"
    assert "<th>tokens/step</th><th>busy µs/token</th>" in page
    balanced = render_html(sim_analysis(tmp_path / "balanced", tokens=4096, token_mode="balanced"))
    assert "no load imbalance worth reporting (S 1.00x)" in balanced and "class='verdict ok'" in balanced


def test_a_report_without_work_renders_as_before(tmp_path: Path) -> None:
    """No work recorded, or a report JSON written before work existed: no imbalance, no work columns."""
    import dataclasses

    from stragglerwatch.analysis.reportschema import Report
    from stragglerwatch.presentation.htmlreport import render_html
    from stragglerwatch.presentation.render import render_text

    analysis = sim_analysis(tmp_path / "run")
    report = analysis.report
    assert "imbalance" not in report and all(r["work"] is None for r in report["ranks"])
    old = json.loads(json.dumps(report))
    for row in old["ranks"]:
        del row["work"], row["busy_per_work_us"]
    assert Report.from_dict(old).imbalance is None, "an old report reads back"
    text = render_text(old)
    assert text == render_text(report)
    assert "imbalance" not in text and "work per" not in text and "work/step" not in text
    page = render_html(dataclasses.replace(analysis, report=old))
    assert "Load imbalance" not in page and "/step</th>" not in page and page.count("Plotly.newPlot") == 2


def test_python_api_is_the_commands_report_and_settings_are_checked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``stragglerwatch.analyze`` gives the command's report, typed, with its text and JSON; a setting out of
    range is one clear line from Python (ConfigError) and from the shell (exit 2)."""
    import stragglerwatch
    from stragglerwatch.record.simulate import Injection, SimConfig, write_run

    run = write_run(tmp_path / "run", SimConfig(ranks=8, steps=200, seed=1, injections=[Injection(3, 0.2, 60)]))
    report = stragglerwatch.analyze(run)
    assert [(s.rank, s.cause) for s in report.stragglers] == [(3, "compute")]
    assert cli(["analyze", str(run), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == report.to_dict()
    assert cli(["analyze", str(run)]) == 0
    assert capsys.readouterr().out.strip() == report.to_text().strip()
    assert "<html>" in report.to_html() and "rank 3" in report.to_text()
    # exit status: 0 whatever the report says, 1 for a finding asked for with --fail-on, 2 for bad input
    assert cli(["analyze", str(run), "--fail-on", "hang", "--fail-on", "imbalance"]) == 0
    assert cli(["analyze", str(run), "--fail-on", "straggler"]) == 1
    assert "stragglerwatch: --fail-on: straggler: rank 3 (compute, " in capsys.readouterr().err
    assert cli(["analyze", str(run), "--fail-on", "any", "--format", "json", "--out", str(tmp_path / "r.json")]) == 1
    assert "--fail-on: straggler: rank 3" in capsys.readouterr().err
    assert report.findings(["hang"]) == [] and len(report.findings()) == 1
    # one vocabulary: a slowdown is a ratio (1.06, "1.06x" or "6%"); a fraction is refused with a hint
    fixed = stragglerwatch.analyze(run, min_slowdown=1.06).to_dict()
    assert fixed["thresholds"]["min_slowdown"] == pytest.approx(1.06)
    assert stragglerwatch.analyze(run, min_slowdown="6%").to_dict() == fixed
    assert stragglerwatch.analyze(run, min_slowdown="1.06x").to_dict() == fixed
    for bad, needle in ((dict(min_slowdown=6), "min_slowdown=6 is out of range"),
                        (dict(min_slowdown=-1), "min_slowdown=-1 is out of range"),
                        (dict(min_slowdown=0.06), "did you mean 1.06"),
                        (dict(min_slowdown="six"), "is not a slowdown"),
                        (dict(tolerance=0.05), "did you mean 1.05"),
                        (dict(window=0), "window=0 is out of range"),
                        (dict(window=1.5), "window=1.5 is not an integer"),
                        (dict(windw=16), "unknown analysis setting(s) windw"),
                        (dict(address="auto"), "give engine='ray'")):  # fmt: skip
        with pytest.raises(stragglerwatch.ConfigError, match=re.escape(needle)):
            stragglerwatch.analyze(run, **bad)
    for argv, needle in ((["--min-slowdown", "6"], "min_slowdown='6' is out of range"),
                         (["--min-slowdown", "0.06"], "did you mean 1.06"),
                         (["--window", "0"], "window=0 is out of range"),
                         (["--address", "auto"], "--address does nothing without --engine ray"),
                         (["--meta", "m.yaml"], "--meta does nothing without an op-level trace file")):  # fmt: skip
        assert cli(["analyze", str(run), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("stragglerwatch") and "error:" in err[0] and needle in err[0], err


@pytest.mark.parametrize("tokens", [0.0, 4096.0])
def test_progress_counts_every_file_and_stage_and_ends_at_its_total(tmp_path: Path, tokens: float) -> None:
    """The progress bar of a long analysis moves through reading and every detection stage, never back,
    and ends full, whether the run recorded work (more stages) or not."""
    from stragglerwatch.analysis.detect import STAGES
    from stragglerwatch.analysis.report import analyze_run
    from stragglerwatch.record.simulate import Injection, SimConfig, write_run

    run = write_run(tmp_path / "run", SimConfig(ranks=6, steps=200, seed=2, tokens=tokens,
                                                injections=[Injection(4, 0.3, 50, "compute")]))  # fmt: skip
    seen: list[tuple[int, int]] = []
    analyze_run(run, progress=lambda done, total: seen.append((done, total)))
    totals = {t for _, t in seen}
    assert totals == {2 * 6 + len(STAGES) + 2}
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == totals.pop()
    assert len(seen) >= 2 * 6 + (len(STAGES) if tokens else 2)
