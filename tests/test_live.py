"""A run followed as it grows (``live.LiveRun``): only new records are read, the verdict follows the
run, and once the run stops growing it is exactly ``analyze``'s."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stragglerwatch.analysis.live import LiveRun, distinct, recent, room
from stragglerwatch.analysis.report import analyze_run
from stragglerwatch.record.simulate import GrowingRun, Injection, SimConfig


def _same(live: LiveRun, run: Path) -> bool:
    return json.loads(json.dumps(live.analysis.report)) == json.loads(json.dumps(analyze_run(run).report))


def _flagged(live: LiveRun) -> list[tuple[int, str]]:
    return [(s["rank"], s["cause"]) for s in live.analysis.report["stragglers"]]


def test_a_growing_run_is_followed_and_settles_on_analyze(tmp_path):
    cfg = SimConfig(ranks=24, steps=900, seed=5, groups=2,
                    injections=[Injection(4, 0.2, 300, "data"), Injection(19, 0.25, 500, "compute", 750)])  # fmt: skip
    run = GrowingRun(tmp_path / "run", cfg)
    live = LiveRun(tmp_path / "run")
    assert not live.update()  # nothing written yet: no analysis, no error
    seen, read = [], []
    for upto in range(40, 901, 40):
        run.flush(upto)
        assert live.update()
        seen.append(_flagged(live))
        read.append(sum(f.offset for f in live.files.values()))
    assert live.restarts == 0  # every update read on from where the last stopped
    assert seen[5] == [] and (4, "data") in seen[9] and {(4, "data"), (19, "compute")} <= set(seen[-1])
    assert all(b > a for a, b in zip(read, read[1:], strict=False))
    assert not live.exact and live.update() and live.exact  # nothing new: it settles on the whole run
    assert _same(live, tmp_path / "run")
    assert not live.update()  # and stays put
    run.close()  # compacted into Parquet: the same records, nothing changes but the files
    live.update()
    assert _same(live, tmp_path / "run")


def test_late_ranks_a_restart_and_a_batch_cut_in_half(tmp_path):
    cfg = SimConfig(ranks=12, steps=400, seed=9, injections=[Injection(7, 0.3, 100, "optimizer")])
    out = tmp_path / "run"
    run = GrowingRun(out, cfg)
    live = LiveRun(out, hold_s=0.0)  # one rank's flush is followed at once (not held for the others')
    run.flush(60, ranks=range(6))  # half the ranks have flushed, the rest have not started
    live.update()
    assert live.analysis.report["ranks_seen"] == 6
    run.flush(200)
    live.update()
    assert live.analysis.report["ranks_seen"] == 12 and live.analysis.report["steps"] == 200
    # rank 3's stream gets a batch that is still being written: it is read once it is whole
    stream = out / "rank-00003.arrows"
    size = stream.stat().st_size
    run.flush(240, ranks=[3])
    whole = stream.read_bytes()
    stream.write_bytes(whole[: size + (len(whole) - size) // 2])
    live.update()
    assert live.analysis.report["ranks"][3]["steps"] == 200
    stream.write_bytes(whole)
    live.update()
    assert live.analysis.report["ranks"][3]["steps"] == 240
    # torchrun restarts the job: a new attempt's steps follow the old ones
    t = run.tables[0].slice(0, 30)
    t = t.set_column(t.schema.get_field_index("restart"), t.schema.field("restart"),
                     pa.array([1] * t.num_rows, type=pa.int32()))  # fmt: skip
    with pa.OSFile(str(out / "rank-00000.1.arrows"), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    live.update()
    assert [a["restart"] for a in live.analysis.report["attempts"]] == [0, 1]
    assert (7, "optimizer") in _flagged(live)
    live.update()
    assert live.exact and _same(live, out)


def test_a_flush_that_some_ranks_have_written_waits_for_the_others(tmp_path):
    """A poll in the middle of a flush (the ranks write it one after another) holds its rows back until every rank
    has written them, or ``hold_s`` has passed (a rank that stopped writing holds nothing back for longer)."""
    cfg = SimConfig(ranks=8, steps=400, seed=3, injections=[Injection(5, 0.3, 100, "compute")])
    run = GrowingRun(tmp_path / "run", cfg)
    live = LiveRun(tmp_path / "run", hold_s=30.0)
    run.flush(200)
    assert live.update() and live.analysis.report["steps"] == 200
    before = live.analysis
    run.flush(240, ranks=range(5))
    assert not live.update() and live.analysis is before and not live.exact  # read, held back
    assert not live.update()  # nothing new, the rest of the flush still to come: still held, not settled
    run.flush(240)
    assert live.update() and live.analysis.report["steps"] == 240
    assert [r["steps"] for r in live.analysis.report["ranks"]] == [240] * 8
    # a rank that stops writing: the others' rows are followed once the hold has passed
    live.hold_s = 0.2
    run.flush(280, ranks=range(1, 8))
    assert not live.update()
    time.sleep(0.25)
    assert live.update() and live.analysis.report["steps"] == 280
    assert live.analysis.report["ranks"][0]["steps"] == 240 and live.analysis.report["ranks"][1]["steps"] == 280
    # the next rows of those ranks, the rank still silent: held again, again at most ``hold_s``
    run.flush(300, ranks=range(1, 8))
    assert not live.update()
    time.sleep(0.25)
    assert live.update() and live.analysis.report["steps"] == 300
    run.flush(400)
    live.update()
    assert live.update() or live.exact
    assert live.exact and _same(live, tmp_path / "run")


def test_late_ranks_in_a_run_with_uneven_work(tmp_path):
    """The work model has a slope per rank: ranks that start late are fitted with the others, not adjusted
    with a model that never saw them."""
    cfg = SimConfig(ranks=12, steps=400, seed=9, tokens=4096, injections=[Injection(7, 0.3, 100, "optimizer")])
    run = GrowingRun(tmp_path / "run", cfg)
    live = LiveRun(tmp_path / "run")
    run.flush(60, ranks=range(6))
    assert live.update() and live.work is not None and len(live.work.model.slopes["busy_s"]) == 6
    run.flush(200)
    assert live.update() and live.analysis.report["ranks_seen"] == 12
    assert len(live.work.model.slopes["busy_s"]) == 12 and live.analysis.report["imbalance"] is not None
    assert (7, "optimizer") in _flagged(live)
    assert live.wait_for_fit(60)
    live.update()
    assert live.update() or live.exact
    assert live.exact and _same(live, tmp_path / "run")


def test_a_run_with_uneven_work_is_followed_not_analysed_again(tmp_path, monkeypatch):
    """Variable work on every step: the updates adjust new rows with the work model of the last fit (no
    analysis from scratch), fit it again as the run grows, report the imbalance as they go, and the settled
    run is analyze's, exactly."""
    from stragglerwatch.analysis import live as live_mod

    cfg = SimConfig(ranks=16, steps=600, seed=4, tokens=4096,
                    injections=[Injection(5, 0.2, 150, "compute"), Injection(12, 0.25, 250, "data")])  # fmt: skip
    run = GrowingRun(tmp_path / "run", cfg)
    live = LiveRun(tmp_path / "run", regrow=0.5, fit_in_background=False)  # every fit inside its update
    fits = []
    real_measure = live_mod.workfit.measure
    monkeypatch.setattr(live_mod.workfit, "measure", lambda *a: fits.append(1) or real_measure(*a))
    monkeypatch.setattr(live_mod, "detect", lambda *a, **k: (_ for _ in ()).throw(AssertionError("from scratch")))
    seen = []
    for upto in range(60, 601, 30):
        run.flush(upto)
        assert live.update() and not live.exact
        seen.append(_flagged(live))
        im = live.analysis.report["imbalance"]
        assert im is not None and im["unit"] == "tokens"
    assert 3 <= len(fits) <= 6  # fitted again as the run grew by half, not at every update
    assert {(5, "compute"), (12, "data")} <= set(seen[-1])
    assert live.analysis.report["imbalance"]["detected"]
    monkeypatch.undo()
    assert live.update() and live.exact  # nothing new: it settles on the whole run
    assert _same(live, tmp_path / "run")


def test_a_refit_runs_beside_the_updates_and_the_next_update_takes_it(tmp_path, monkeypatch):
    """Only the first work fit holds up an update: a later one runs on a thread while the updates go on with
    the last model, and the first update after it ended adjusts its new rows with the new one; the rows
    adjusted before keep their adjustment until the run settles, on analyze's report."""
    import threading

    import numpy as np

    from stragglerwatch.analysis import live as live_mod

    cfg = SimConfig(ranks=16, steps=400, seed=6, tokens=4096, injections=[Injection(9, 0.2, 120, "compute")])
    run = GrowingRun(tmp_path / "run", cfg)
    live = LiveRun(tmp_path / "run", regrow=0.5)
    run.flush(100)
    assert live.update() and live.work is not None and live.work.steps == 100  # the first fit, in the update
    release, where = threading.Event(), []
    real_measure = live_mod.workfit.measure

    def held(*a):
        where.append(threading.current_thread().name)
        release.wait(60)
        return real_measure(*a)

    monkeypatch.setattr(live_mod.workfit, "measure", held)
    run.flush(160)  # grown by half: a fit again, on its thread
    assert live.update()
    assert live.refit is not None and live.refit.thread is not None and live.refit.thread.is_alive()
    run.flush(190)
    assert live.update() and live.work.steps == 100, "the updates go on with the last model while it fits"
    before = {c: a[:190].copy() for c, a in live.work.adjusted.arrays.items()}
    assert live.analysis.report["imbalance"]["unit"] == "tokens"
    release.set()
    assert live.wait_for_fit(60)
    run.flush(220)
    assert live.update() and live.work.steps == 160 and live.refit is None, "the next update takes the new fit"
    assert where == ["stragglerwatch-workfit"]
    for c, a in before.items():
        np.testing.assert_array_equal(live.work.adjusted.arrays[c][:190], a, err_msg=c)
    assert live.analysis.report["imbalance"]["detected"] is not None
    monkeypatch.undo()
    run.flush(400)
    assert live.update() and (9, "compute") in _flagged(live)
    assert live.wait_for_fit(60)
    for _ in range(3):  # the fit begun at step 400 taken, then nothing new: settled
        live.update()
    assert live.exact and _same(live, tmp_path / "run")


def test_the_jitter_tax_is_projected_beside_the_updates_and_the_next_update_takes_it(tmp_path, monkeypatch):
    """The jitter tax resamples every healthy step (seconds at thousands of ranks): after the first report it is
    projected again on a thread while the updates go on showing the last one, from the inputs of the update
    that started it; the first update after it ended shows it; a failed one keeps the last; the settled run's
    is analyze's."""
    import threading

    from stragglerwatch.analysis import live as live_mod

    cfg = SimConfig(ranks=12, steps=400, seed=3, injections=[Injection(4, 0.3, 100)])
    run = GrowingRun(tmp_path / "run", cfg)
    live = LiveRun(tmp_path / "run", slow_every_s=0.0)
    run.flush(150)
    assert live.update()
    first = live.analysis.report["jitter_tax"]
    assert first is not None
    release, calls = threading.Event(), []
    real_work = live_mod.jitter_work

    def held(verdict, figures, meta):
        work, steps = real_work(verdict, figures, meta), len(verdict.steps)
        calls.append(threading.current_thread().name)

        def later():
            assert release.wait(60)
            if len(calls) == 2:
                raise RuntimeError("a projection that fails")
            return {**work(), "steps_seen": steps}

        return later

    monkeypatch.setattr(live_mod, "jitter_work", held)
    run.flush(200)
    assert live.update() and live.jitter_job is not None and live.jitter_job.thread.is_alive()
    run.flush(250)
    assert live.update() and live.analysis.report["jitter_tax"] == first, "the last one shown while it runs"
    release.set()
    live.jitter_job.thread.join(60)
    run.flush(300)
    assert live.update() and live.analysis.report["jitter_tax"]["steps_seen"] == 200, "taken by the next update"
    assert live.jitter_job is not None, "and the next one started (slow_every_s 0)"
    live.jitter_job.thread.join(60)
    run.flush(350)
    assert live.update() and live.analysis.report["jitter_tax"]["steps_seen"] == 200, "a failed one keeps the last"
    assert calls == ["MainThread"] * len(calls) and len(calls) >= 3
    monkeypatch.undo()
    if live.jitter_job is not None:
        live.jitter_job.thread.join(60)
    run.flush(400)
    live.update()
    for _ in range(3):
        live.update()
    assert live.exact and _same(live, tmp_path / "run")


def test_an_intermittent_straggler_is_followed_with_the_blocks_kept(tmp_path):
    """The block test of intermittent stragglers looks at every whole block of the history; a followed run keeps
    the blocks' means and costs and makes again only those from the first changed row: at every update its
    flags are those of the test on the whole history, and it names the loader-starved rank."""
    import numpy as np

    from stragglerwatch.analysis import consistency as cons
    from stragglerwatch.analysis.intermittent import block_costs, block_means, intermittent_flags

    cfg = SimConfig(ranks=16, steps=900, seed=2, injections=[Injection(3, 1.0, 200, "data", period=4, duty=1)])
    run = GrowingRun(tmp_path / "run", cfg)
    live = LiveRun(tmp_path / "run")
    fired = False
    for upto in range(100, 901, 37):  # flushes that end inside blocks
        run.flush(upto)
        assert live.update()
        d, n = live.det.arrays, live.det.n
        means, top = live.blocks.arrays["means"][: n // 8], live.blocks.arrays["top"][: n // 8]
        for x in cons.floor_levels(live.sc):
            with np.errstate(invalid="ignore"):
                held = block_costs(d["costly"][:n]) > x.floors.step_fraction
                whole = intermittent_flags(n, block_means(d["e"][:n]), held, x.block_noise, x.floors, live.cfg,
                                           x.ranks)  # fmt: skip
                kept = intermittent_flags(n, means, top > x.floors.step_fraction, x.block_noise, x.floors, live.cfg,
                                          x.ranks)  # fmt: skip
            assert np.array_equal(kept, whole)
            fired |= bool(whole[:, 3].any())
    assert fired and (3, "data") in _flagged(live)


def test_a_run_between_two_flushes_is_not_analysed_whole(tmp_path):
    """The dashboard's source polls more often than a job flushes: an update that finds nothing new settles (an
    analysis of the whole run) only once the run has been quiet for ``settle_after_s`` and three of its usual
    gaps between flushes; until then it keeps the followed verdict."""
    import time

    cfg = SimConfig(ranks=8, steps=300, seed=3, injections=[Injection(2, 0.2, 100, "compute")])
    run = GrowingRun(tmp_path / "run", cfg)
    live = LiveRun(tmp_path / "run", settle_after_s=1.0)
    for upto in (100, 200, 300):  # a flush every 0.5 s or so: the usual gap
        run.flush(upto)
        assert live.update() and not live.exact
        time.sleep(0.5)
        assert not live.update() and not live.exact, "0.5 s after a flush: between two flushes, not settled"
    quiet = time.monotonic()
    while not live.update() and time.monotonic() - quiet < 20:  # the run has stopped: settled once quiet
        time.sleep(0.1)
    assert live.exact and _same(live, tmp_path / "run")
    assert time.monotonic() - quiet >= 1.0 - 0.5  # not before settle_after_s (less the 0.5 s already quiet)


def test_distinct_values_are_numpys_whatever_their_spread() -> None:
    rng = np.random.default_rng(3)
    cases = [np.zeros(0, dtype=np.int64), np.array([7]), np.arange(5, 105).repeat(40),  # one batch of steps
             rng.integers(-50, 50, 1000), np.array([0, 2**40, 5]),  # a range too wide for slots: sorted
             rng.integers(0, 4096, 5000).astype(np.int32)]  # fmt: skip
    for x in cases:
        got, want = distinct(x), np.unique(x)
        assert got.dtype == want.dtype and np.array_equal(got, want), x[:5]


def _resident_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="resident memory read from /proc")
def test_the_room_for_more_steps_costs_no_memory_until_written() -> None:
    # a followed run's arrays are column-major with room for thousands more steps: the room of every column
    # lies between the used rows of the next, so it must stay unbacked (numpy's huge pages would back it)
    before = _resident_mib()
    arr = room((16384, 4096), np.float64)  # 512 MiB of room
    assert arr.shape == (16384, 4096) and arr.dtype == np.float64 and arr.flags.f_contiguous and arr.flags.writeable
    arr[:100] = 1.5  # the first hundred steps of every rank
    grown = _resident_mib() - before
    assert grown < 64, f"{grown:.0f} MiB resident for 3.2 MiB written"
    assert float(arr[:100].sum()) == 1.5 * 100 * 4096
    small = room((10, 3), np.float32)  # a small array is numpy's own
    assert small.shape == (10, 3) and small.flags.f_contiguous and room((5,), bool).shape == (5,)


# -- a window of the last steps ------------------------------------------------------------------------------


@pytest.mark.parametrize("tokens", [0.0, 512.0])
def test_a_window_keeps_the_state_of_the_whole_history_at_its_first_row(tmp_path, tokens):
    """A followed run with a window holds its last steps only, and goes on from the rule's state at the row the
    window starts at: given the same job-wide scalars and work model (each made once here: ``regrow`` never
    reached), every row it holds has the excess, the rolling medians, the rule's flags and the intermittent
    test's blocks that the run followed whole has there (with work: times adjusted with the model's reference
    of the rows kept)."""
    slow = [Injection(6, 0.3, 900, "compute", 1500), Injection(11, 0.25, 2500, "data")]
    cfg = SimConfig(ranks=16, steps=3200, seed=4, tokens=tokens, injections=slow)
    run = GrowingRun(tmp_path / "run", cfg)
    windowed, whole = (LiveRun(tmp_path / "run", regrow=1e9, fit_in_background=False, window=window)
                       for window in (1024, None))  # fmt: skip
    slid = 0
    for upto in range(100, 3201, 100):
        run.flush(upto)
        assert windowed.update() and whole.update()
        n, k = windowed.data.n, windowed.dropped
        assert windowed.slide == 256 and n <= 1024 + 256 + 100 and k % 256 == 0 and k + n == whole.data.n
        assert np.array_equal(windowed.steps, whole.steps[k:])
        if tokens:
            assert windowed.work is not None and whole.work is not None
            assert np.array_equal(windowed.work.model.ref[:n], whole.work.model.ref[k : k + n], equal_nan=True)
        for name in ("e", "med", "level", "flags", "classic"):
            held, all_rows = windowed.det.arrays[name][:n], whole.det.arrays[name][k : k + n]
            assert np.array_equal(held, all_rows, equal_nan=held.dtype.kind == "f"), name
        for name in ("means", "top"):  # the intermittent test's whole blocks
            held, all_rows = windowed.blocks.arrays[name][: n // 8], whole.blocks.arrays[name][k // 8 : (k + n) // 8]
            assert np.array_equal(held, all_rows, equal_nan=True), name
        slid += k > 0
    assert slid and windowed.restarts == 0 and windowed.dropped >= 3200 - 1024 - 256
    report = windowed.analysis.report
    assert report["first_step"] == windowed.dropped and report["last_step"] == 3199
    # rank 6's stretch ended before the window: only rank 11's is the window's
    assert _flagged(windowed) == [(11, "data")] and (6, "compute") in _flagged(whole)


def test_a_long_run_opened_late_is_read_into_its_window_with_the_runs_numbering(tmp_path):
    """Each stream is cut to its last steps as it is read; the last step of each attempt is kept, so that the
    steps are numbered, and the attempts told, as ``analyze`` does on the whole run."""
    cfg = SimConfig(ranks=8, steps=3000, seed=1, tokens=512, injections=[Injection(2, 0.3, 2600, "compute")])
    out = tmp_path / "run"
    run = GrowingRun(out, cfg)
    run.flush(3000)
    t = run.tables[0].slice(0, 40)  # torchrun restarts the job: a new attempt's steps follow the old ones
    t = t.set_column(t.schema.get_field_index("restart"), t.schema.field("restart"),
                     pa.array([1] * t.num_rows, type=pa.int32()))  # fmt: skip
    with pa.OSFile(str(out / "rank-00000.1.arrows"), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t)
    live = LiveRun(out, window=1024)
    assert live.update()
    assert live.data.n <= 1024 + live.slide and live.restarts == 0
    whole = analyze_run(out).report
    report = live.analysis.report
    assert report["attempts"] == [{**a, **{k: report["attempts"][i][k] for k in ("job_seconds", "lost_seconds",
                                                                                 "lost_gpu_seconds")}}
                                  for i, a in enumerate(whole["attempts"])]  # fmt: skip
    spans = [(a["restart"], a["first_step"], a["last_step"]) for a in report["attempts"]]
    assert spans == [(0, 0, 2999), (1, 3000, 3039)]
    assert report["last_step"] == whole["last_step"] == 3039 and report["first_step"] > 3039 - 1024 - live.slide
    assert (2, "compute") in _flagged(live)


def test_recent_keeps_the_last_records_and_each_attempts_last_step() -> None:
    steps = [*range(10), *range(6)]  # attempt 0: steps 0-9 of ranks 0 and 1 (interleaved), attempt 1: 0-5
    table = pa.table(
        {
            "rank": pa.array([i % 2 for i in range(16)], pa.int32()),
            "step": pa.array(steps, pa.int64()),
            "restart": pa.array([0] * 10 + [1] * 6, pa.int32()),
            "attach": pa.array([0] * 16, pa.int32()),
        }
    )
    got = recent(table, 4)
    # the last 4 records (attempt 1's steps 2-5), and before them rank 0's and rank 1's last of each attempt
    assert list(zip(got["restart"].to_pylist(), got["rank"].to_pylist(), got["step"].to_pylist(), strict=True)) == [
        (0, 0, 8), (0, 1, 9), (1, 0, 0), (1, 1, 1), (1, 0, 2), (1, 1, 3), (1, 0, 4), (1, 1, 5)]  # fmt: skip
    assert recent(table, 16) is table
