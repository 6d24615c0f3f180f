"""Why a straggler is slow: ``explain`` on hand-built context frames, and the report, text and HTML
that carry its findings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from stragglerwatch.analysis.explain import explain, span
from stragglerwatch.record.context import CONTEXT_SCHEMA, EMPTY, rows_to_batch

T0 = 1_700_000_000.0
STEPS = (np.arange(60), T0 + np.arange(60.0), T0 + np.arange(60.0) + 1.0)  # one step a second


def frame(ranks: int = 4, seconds: int = 60, where=None) -> pd.DataFrame:
    """Healthy context of ``ranks`` ranks on one host, one sample a second, a little noise; ``where(rank, t)``
    returns the fields that differ at that rank and second."""
    rng = np.random.default_rng(0)
    rows = []
    for t in range(1, seconds + 1):
        for r in range(ranks):
            row = {**EMPTY, "rank": r, "time": T0 + t, "interval_s": 1.0, "cpu_pressure": 0.6, "load1": 2.0,
                   "cpus": 2, "affinity_cpus": 1, "affinity": str(r % 2), "run_delay": 0.01 + 0.005 * rng.random(),
                   "invol_switches": 3 + 2 * rng.random(), "cpu_time": 0.9, "cores_busy": 0.95, "steal": 0.0,
                   "workers_cpu_time": 0.0, "gpu": r, "gpu_uuid": f"GPU-{r}", "sm_clock_mhz": 1980.0,
                   "sm_clock_max_mhz": 1980.0, "clock_reasons": 0, "temperature_c": 60.0 + rng.random(),
                   "power_limit_w": 700.0, "pcie_replays": float(t), "xid_events": 0}  # fmt: skip
            row.update(where(r, t) if where else {})
            rows.append(row)
    return pa.Table.from_batches([rows_to_batch(rows)]).to_pandas()


def flagged(rank: int, first: int = 20, last: int | None = 40) -> dict:
    return {"rank": rank, "first_step": first, "last_step": last}


def signals(found: list[dict]) -> list[str]:
    return [f["signal"] for f in found]


def test_cpu_contention_is_named_only_on_the_contended_rank() -> None:
    def contended(r: int, t: int) -> dict:  # rank 1 shares its core with a busy process from second 20
        return {"run_delay": 0.45, "invol_switches": 3100.0, "cores_busy": 1.0, "cpu_time": 0.5} if (
            r == 1 and t >= 20) else {}  # fmt: skip

    ctx = frame(where=contended)
    one, three = explain(ctx, [flagged(1), flagged(3)], STEPS)
    assert signals(one) == ["run_delay", "invol_switches", "others_cpu"]
    assert one[0]["text"] == ("its training thread waited for a CPU 45% of the time (peers 1%), 0.90 s per "
                              "CPU-second its process ran (peers 0.01 s)")  # fmt: skip
    assert one[1]["text"].startswith("3,100 involuntary context switches/s (peers 4/s), 6,200 per CPU-second its ")
    assert one[1]["value"] == 3100.0 and one[1]["peers"] < 6
    assert three == [], "a straggler whose context is like its peers' gets nothing"
    assert "cpu_pressure" not in signals(one), "the host's pressure is the same for all its ranks"
    assert explain(ctx, [flagged(1, 0, 15)], STEPS) == [[]], "before the contention: nothing"
    assert explain(ctx, [flagged(1, 25, None)], STEPS)[0], "still slow at the end: up to the last step"


def test_extra_work_is_no_cause() -> None:
    """Rank 1 runs 3.3x the CPU time of its peers (more work, the same sharing): per second it is
    switched out and waits for its CPU 3.3x as often, its vCPUs have more time stolen, its host's load
    and pressure carry its own threads, its GPU runs hotter at the same clock. None of it is a cause."""

    def busier(r: int, t: int) -> dict:
        share = 1.0 if r == 1 and t >= 20 else 0.3  # CPU-seconds per second its process ran
        return {"cpu_time": share, "run_delay": 0.2 * share, "invol_switches": 300.0 * share,
                "cores_busy": share + 0.05, "steal": 0.06 * share, "cpus": 1, "load1": 1.0 + 1.2 * share,
                "cpu_pressure": 0.1 + 0.2 * share, "temperature_c": 75.0 if r == 1 and t >= 20 else 62.0}  # fmt: skip

    ctx = frame(where=busier)
    assert explain(ctx, [flagged(1)], STEPS) == [[]]
    raw = {"run_delay": "run_delay", "invol_switches": "invol_switches", "steal": "steal", "load1": "load_per_cpu"}
    for column, name in raw.items():  # what the same run says when a signal's value is read per second instead
        hog = frame(where=lambda r, t, c=column: {**busier(r, t), **({c: 5 * busier(r, t)[c]} if r == 1 else {})})
        assert name in signals(explain(hog, [flagged(1)], STEPS)[0]), f"{column}: still named where it differs"


def test_a_rank_that_runs_in_short_bursts_is_not_contended() -> None:
    """A data straggler's training thread sleeps and wakes for each batch: it runs a tenth of its peers'
    CPU time, and the small wait of each wake-up makes its waits and switches per CPU-second large,
    while per second they are its peers'. That is no contention either."""
    bursty = frame(where=lambda r, t: {"cpu_time": 0.09, "cores_busy": 0.15} if r == 2 else {})
    assert explain(bursty, [flagged(2)], STEPS) == [[]]


def test_a_rank_that_hardly_ran_has_no_per_cpu_second_rates() -> None:
    waiting = frame(where=lambda r, t: {"cpu_time": 0.01, "cores_busy": 0.06, "invol_switches": 5.0,
                                        "run_delay": 0.005} if r == 2 else {})  # fmt: skip
    assert explain(waiting, [flagged(2)], STEPS) == [[]], "5 switches over 0.01 CPU-s is noise, not 500/CPU-s"


def test_healthy_or_tiny_differences_name_nothing() -> None:
    assert explain(frame(), [flagged(r) for r in range(4)], STEPS) == [[], [], [], []]
    small = {"run_delay": 0.09, "invol_switches": 30.0, "temperature_c": 66.0, "cpu_pressure": 0.65}
    tiny = frame(where=lambda r, t: small if r == 2 else {})
    assert explain(tiny, [flagged(2)], STEPS) == [[]], "below each signal's minimum difference"
    assert explain(frame().iloc[0:0], [flagged(1)], STEPS) == [[]], "no context"
    assert explain(frame(), [], STEPS) == []


def test_noisy_peers_raise_the_bar() -> None:
    spread = {0: 100.0, 2: 900.0, 3: 1700.0, 4: 500.0, 5: 1300.0}
    noisy = frame(ranks=6, where=lambda r, t: {"invol_switches": 2600.0 if r == 1 else spread[r]})
    assert explain(noisy, [flagged(1)], STEPS) == [[]], "within 4 robust deviations of peers this noisy"
    calm = frame(ranks=6, where=lambda r, t: {"invol_switches": 2600.0} if r == 1 else {})
    assert signals(explain(calm, [flagged(1)], STEPS)[0]) == ["invol_switches"]


def test_gpu_thermal_slowdown_and_clock() -> None:
    hot = frame(where=lambda r, t: {"clock_reasons": 0x40, "sm_clock_mhz": 1200.0, "temperature_c": 91.0}
                if r == 2 else {})  # fmt: skip
    (found,) = explain(hot, [flagged(2)], STEPS)
    assert signals(found) == ["gpu_hw_thermal_slowdown", "sm_clock", "temperature"]
    assert found[0]["text"] == "GPU thermal slowdown (hardware) in 100% of samples (peers 0%)"
    assert found[1]["text"] == "SM clock 1.20 GHz vs peers' 1.98 GHz"
    idle = frame(where=lambda r, t: {"clock_reasons": 0x1} if r == 2 else {})  # idle is not a slowdown
    assert explain(idle, [flagged(2)], STEPS) == [[]]
    warm = frame(where=lambda r, t: {"temperature_c": 91.0} if r == 2 else {})  # hot, at full clock: not slower
    assert explain(warm, [flagged(2)], STEPS) == [[]]
    assert explain(idle, [flagged(2)], STEPS) == [[]]


def test_error_counters_compare_their_increase() -> None:
    def degraded(r: int, t: int) -> dict:
        out = {"pcie_replays": float(t + (50 * (t - 20) if r == 3 and t > 20 else 0))}
        if r == 3 and t >= 30:
            out.update(xid_events=1, xid=79)
        return out

    (found,) = explain(frame(where=degraded), [flagged(3)], STEPS)
    assert signals(found) == ["xid", "pcie_replays"]
    assert found[0]["text"] == "1 XID error(s) reported (peers 0): last XID 79 (GPU has fallen off the bus)"
    assert found[1]["value"] == pytest.approx(22 + 50 * 22) and found[1]["peers"] == pytest.approx(22), "to t1 + 1 s"
    assert "degraded PCIe link" in found[1]["text"]


def test_span_of_steps() -> None:
    assert span(STEPS, 20, 40) == (T0 + 20, T0 + 41)
    assert span(STEPS, 20, None) == (T0 + 20, T0 + 60)
    assert span((np.zeros(0), np.zeros(0), np.zeros(0)), 0, None) is None


def sim_run_with_context(run: Path) -> pd.Series:
    """A simulated 4-rank run in which rank 1 is 1.5x as busy from step 150, with a context stream
    per rank in which rank 1's training thread waits for its CPU from then on; returns the step starts."""
    from stragglerwatch.record.simulate import Injection, SimConfig, write_run
    from stragglerwatch.record.steplog import load_run

    write_run(run, SimConfig(ranks=4, steps=400, injections=[Injection(1, 0.5, 150)]))
    starts = load_run(run, columns=["start_time"]).groupby("step")["start_time"].median()
    onset, t_first, t_last = float(starts.loc[150]), float(starts.iloc[0]), float(starts.iloc[-1])
    for r in range(4):
        rows = [{**EMPTY, "rank": r, "time": t, "interval_s": 1.0, "run_delay": 0.02, "invol_switches": 4.0,
                 "cpu_time": 0.5} for t in np.arange(t_first + 1, t_last + 1)]  # fmt: skip
        for row in rows:
            if r == 1 and row["time"] > onset:
                row.update(run_delay=0.55, invol_switches=1800.0, cpu_time=0.4)
        with pa.OSFile(str(run / f"context-{r:05d}.arrows"), "wb") as f, pa.ipc.new_stream(f, CONTEXT_SCHEMA) as w:
            w.write_batch(rows_to_batch(rows))
    return starts


def test_report_text_and_html_name_the_context(tmp_path: Path) -> None:
    from stragglerwatch.analysis.report import analyze_run
    from stragglerwatch.presentation.htmlreport import render_html
    from stragglerwatch.presentation.render import render_text

    run = tmp_path / "sim"
    starts = sim_run_with_context(run)
    analysis = analyze_run(run)
    (s,) = analysis.report["stragglers"]
    assert s["rank"] == 1 and signals(s["context"]) == ["run_delay", "invol_switches"]
    assert s["time_span"][0] == pytest.approx(float(starts.loc[s["first_step"]]), abs=1e-3)
    text = render_text(analysis.report)
    assert "\n    why: its training thread waited for a CPU 55% of the time (peers 2%), 1.38 s\n" in text
    assert (
        "why: its training thread waited for a CPU 55% of the time (peers 2%), 1.38 s per CPU-second its process "
        "ran (peers 0.04 s); 1,800 involuntary context switches/s (peers 4/s), 4,500 per CPU-second its process ran "
        "(peers 8) try: its training thread waits for its CPU: look for other processes on its CPUs"
        in " ".join(text.split())
    )
    html = render_html(analysis)
    assert "host and GPU context" in html and "waited for a CPU 55% of the time" in html
    assert "Host and GPU context: rank 1 vs its peers" in html
    from stragglerwatch.presentation.dashboard import Snapshot
    from stragglerwatch.presentation.dashboard.app import render

    figure = render(Snapshot(analysis), None)["context"]  # beside the busy time of the default rank: 1
    assert [t.name for t in figure.data[:2]] == ["peers median", "rank 1"] and figure.layout.shapes
    without = render(Snapshot(dataclasses.replace(analysis, context=None)), 0)["context"]  # an older run
    assert "no host or GPU context" in without.layout.annotations[0].text
