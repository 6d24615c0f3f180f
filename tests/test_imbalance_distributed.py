"""Real gloo DDP jobs whose ranks draw variable-length batches: load imbalance is not a straggler.

Each job runs ``tests/workers/varlen.py`` on 3 CPU ranks; its step cost follows the tokens each rank
drew (see the worker's docstring), and rank 0 writes the true per-step cost of the imbalance.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ROOT, launch

from stragglerwatch.analysis.report import analyze_run

pytestmark = pytest.mark.distributed
WORKER = ROOT / "tests" / "workers" / "varlen.py"
RANKS = 3


def _job(tmp_path: Path, *args: str) -> tuple[dict, float]:
    run, truth = tmp_path / "run", tmp_path / "truth.json"
    launch(RANKS, WORKER, "--run-dir", str(run), "--truth", str(truth), *args, timeout_s=240)
    return analyze_run(run).report, sum(json.loads(truth.read_text())["per_step_s"])


def _rows(report: dict) -> dict[int, dict]:
    return {row["rank"]: row for row in report["ranks"]}


def test_variable_lengths_are_imbalance_not_a_straggler(tmp_path: Path) -> None:
    report, true_cost = _job(tmp_path, "--steps", "60")
    im = report["imbalance"]
    assert report["stragglers"] == [], "no rank is flagged for drawing heavy batches"
    assert im["unit"] == "tokens" and im["detected"], im
    assert im["lost_seconds"] == pytest.approx(true_cost, rel=0.35), (im, true_cost)
    assert im["explained"] > 0.5
    assert im["heaviest_ranks"] == [], "a different rank is heaviest each step"
    assert any("token-balanced" in h for h in im["hints"]), im["hints"]
    rows = _rows(report)
    assert all(rows[r]["work"] > 0 and rows[r]["busy_per_work_us"] > 0 for r in rows)


def test_slow_rank_is_found_inside_the_imbalance(tmp_path: Path) -> None:
    report, true_cost = _job(tmp_path, "--steps", "70", "--slow-rank", "1", "--slowdown", "1.6")
    assert [s["rank"] for s in report["stragglers"]] == [1], report["stragglers"]
    assert report["stragglers"][0]["cause"] == "compute"
    im = report["imbalance"]
    assert im["detected"], im
    assert im["lost_seconds"] == pytest.approx(true_cost, rel=0.5), (im, true_cost)
    rows = _rows(report)
    peers = [rows[r]["busy_per_work_us"] for r in rows if r != 1]
    assert rows[1]["busy_per_work_us"] > 1.2 * max(peers), "slow per token against its peers"


def test_masked_batches_count_tokens_and_a_data_straggler_is_found(tmp_path: Path) -> None:
    report, _ = _job(tmp_path, "--steps", "70", "--mask", "--data-rank", "2", "--data-ms", "8")
    assert [(s["rank"], s["cause"]) for s in report["stragglers"]] == [(2, "data")], report["stragglers"]
    assert report["imbalance"]["unit"] == "tokens" and report["imbalance"]["detected"]


def test_token_balanced_job_reports_no_imbalance(tmp_path: Path) -> None:
    report, true_cost = _job(tmp_path, "--steps", "50", "--balanced")
    assert true_cost == 0.0
    im = report["imbalance"]
    assert im is not None and not im["detected"], im
    assert im["hints"] == []
    assert report["stragglers"] == []


def test_dynamic_padding_is_costed_by_the_padded_shape(tmp_path: Path) -> None:
    """Batches padded to their longest sequence, run over the padding: busy time follows the padded
    shape, not the mask's ones, and the analysis fits that and says so."""
    report, true_cost = _job(tmp_path, "--steps", "60", "--mask", "--pad-compute")
    im = report["imbalance"]
    assert report["stragglers"] == []
    assert im["unit"] == "padded tokens" and im["detected"], im
    assert im["lost_seconds"] == pytest.approx(true_cost, rel=0.35), (im, true_cost)
    assert any("padded shape" in h for h in im["hints"]), im["hints"]
