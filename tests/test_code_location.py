"""Where in the code: the marker for fetches without a DataLoader, the code sampler's locations,
their stream, and the attribution of a straggler's excess to code locations against its peers."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from torch import nn

import stragglerwatch
from stragglerwatch.analysis.codeprofile import locate
from stragglerwatch.presentation.render import code_text, verdict_lines
from stragglerwatch.record.codelog import load_code
from stragglerwatch.runtime.context.codemetrics import CodeCollector
from stragglerwatch.runtime.context.codesampler import CodeSampler, Locator

HERE = Path(__file__).name


def _loop(watch: stragglerwatch.Watch, model: nn.Module, opt: torch.optim.Optimizer, fetch, steps: int) -> None:
    for _ in range(steps):
        out = model(torch.randn(8, 16)).square().mean()
        fetch()  # between forward and backward, as LLM scripts do
        out.backward()
        opt.step()
        opt.zero_grad()


def test_marked_fetch_between_forward_and_backward_is_data_wait(tmp_path: Path) -> None:
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, tmp_path / "run", code_sample_hz=0)

    def get_batch() -> torch.Tensor:
        time.sleep(0.01)
        return torch.randn(8, 16)

    marked = watch.data(get_batch)
    assert marked.__name__ == "get_batch"
    _loop(watch, model, opt, marked, 12)

    def block() -> None:
        with watch.data():
            time.sleep(0.01)

    _loop(watch, model, opt, block, 12)
    watch.close()
    df = stragglerwatch.load_run(tmp_path / "run")
    later = df[df["step"] >= 2]
    assert (later["data_wait_s"] > 0.009).all(), "the marked fetch's time is data wait"
    assert (later["data_wait_s"] < 0.05).all()
    assert (later["gap_forward_backward_s"] < 0.005).all(), "nothing of the fetch is left untimed"
    assert (later["other_s"] < 0.005).all()


def test_unmarked_fetch_is_other_between_forward_and_backward(tmp_path: Path) -> None:
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, tmp_path / "run", code_sample_hz=0)
    _loop(watch, model, opt, lambda: time.sleep(0.01), 10)
    watch.close()
    later = stragglerwatch.load_run(tmp_path / "run").query("step >= 2")
    assert (later["gap_forward_backward_s"] > 0.009).all()
    assert (later["other_s"] >= later["gap_forward_backward_s"] - 1e-9).all()
    assert (later["data_wait_s"] < 0.005).all()


def test_a_fetch_on_another_thread_is_not_the_steps_wait(tmp_path: Path) -> None:
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    watch = stragglerwatch.attach(model, tmp_path / "run", code_sample_hz=0)
    fetch = watch.data(lambda: time.sleep(0.02))

    def prefetch() -> None:
        thread = threading.Thread(target=fetch)
        thread.start()
        thread.join(timeout=5)

    _loop(watch, model, opt, prefetch, 6)
    watch.close()
    later = stragglerwatch.load_run(tmp_path / "run").query("step >= 1")
    assert (later["data_wait_s"] < 0.005).all(), "the prefetcher's fetch is not the training thread's wait"


def test_marker_on_an_inert_handle_and_refused_objects(tmp_path: Path) -> None:
    model = nn.Linear(16, 4)
    watch = stragglerwatch.attach(model, tmp_path / "run", enabled=False)

    def fetch() -> int:
        return 3

    assert watch.data(fetch) is fetch
    with watch.data():
        pass
    live = stragglerwatch.attach(model, tmp_path / "run2", code_sample_hz=0)
    try:
        with pytest.raises(TypeError, match="marks a fetch function"):
            live.data(42)
        loader = [torch.zeros(1)]
        assert list(live.data(loader)) == loader, "an iterable is wrapped like a loader"
    finally:
        live.close()


def _spin_in_slow_spot(stop: threading.Event) -> None:
    while not stop.is_set():
        slow_spot()


def slow_spot() -> None:
    time.sleep(0.002)
    # indented: json's pure-Python encoder, for longer than the interpreter's switch interval (5 ms), so
    # that the sampler (which runs when the thread lets go of the interpreter lock) sees it there
    json.dumps({"a": list(range(40_000))}, indent=1)


def test_locator_names_the_users_frame_and_the_library_leaf() -> None:
    stop = threading.Event()
    worker = threading.Thread(target=_spin_in_slow_spot, args=(stop,))
    worker.start()
    try:
        locator = Locator()
        seen = []
        for _ in range(200):
            frame = __import__("sys")._current_frames().get(worker.ident)
            found = locator.locate(frame)
            if found is not None:
                seen.append(found)
            time.sleep(0.001)
    finally:
        stop.set()
        worker.join(timeout=5)
    sites = {s for s, _, _ in seen}
    assert all(HERE in s for s in sites), sites
    assert any(s.endswith("slow_spot") for s in sites)
    sleeping = [(s, leaf, native) for s, leaf, native in seen if s.endswith("slow_spot") and leaf == s]
    assert sleeping and any(native for _, _, native in sleeping), "time.sleep is a call into native code"
    assert any("json" in leaf for _, leaf, _ in seen), "the leaf is the library frame the user's code called"


def test_a_stack_cut_while_it_is_read_is_no_sample_and_a_library_s_own_stack_is_one(tmp_path: Path) -> None:
    """The sampler reads another thread's frames while it holds the interpreter lock; if it lets go midway, the
    thread runs on, and a generator that returns meanwhile is unlinked from its caller: the stack read ends in a
    generator's frame, which no thread's stack does (CI once saw json's encoder named as the user's site). Such a
    stack is no sample. A stack of library code alone, down to the thread's start, still names its library site."""
    import os
    import queue

    walk = os.walk(tmp_path)
    next(walk)  # a stdlib generator, suspended: its frame has no caller, as a returned one has
    assert walk.gi_frame is not None and walk.gi_frame.f_back is None
    assert Locator().locate(walk.gi_frame) is None
    box: queue.Queue[int] = queue.Queue()
    waiter = threading.Thread(target=box.get)  # the thread runs stdlib code only, from its start
    waiter.start()
    try:
        deadline = time.monotonic() + 10
        found = None
        while found is None and time.monotonic() < deadline:
            frame = __import__("sys")._current_frames().get(waiter.ident)
            found = Locator().locate(frame) if frame is not None and frame.f_code.co_name == "wait" else None
            time.sleep(0.01)
    finally:
        box.put(1)
        waiter.join(timeout=5)
    assert found is not None and found[0].startswith("threading.py:") and found[0].endswith(" wait"), found


def test_sampler_counts_where_the_training_thread_is_and_writes_its_windows(tmp_path: Path) -> None:
    stop = threading.Event()
    worker = threading.Thread(target=_spin_in_slow_spot, args=(stop,))
    worker.start()
    step = [0]
    sampler = CodeSampler(tmp_path, 3, lambda: (worker.ident, step[0], "data_wait"), hz=100, window_s=0.2).start()
    try:
        time.sleep(0.6)
        step[0] = 7
        time.sleep(0.3)
    finally:
        sampler.close()
        stop.set()
        worker.join(timeout=5)
    assert sampler.samples >= 20 and sampler.errors == 0
    assert sampler.cost_s / sampler.samples < 0.01, "a sample costs microseconds, not milliseconds"
    assert (tmp_path / "code-00003.parquet").exists(), "compacted at close"
    code = load_code(tmp_path)
    assert set(code["rank"]) == {3} and set(code["phase"]) == {"data_wait"}
    assert code["step1"].max() == 7 and code["step0"].min() == 0
    per_window = code.groupby("t0")["samples"].sum()
    assert (per_window == code.groupby("t0")["total"].first()).all(), "a window's rows add up to its total"
    assert code.groupby("site")["samples"].sum().idxmax().endswith("slow_spot")
    top = sampler.top()
    assert top and top[0]["site"].endswith("slow_spot") and 0 < top[0]["share"] <= 1
    registry = CollectorRegistry()
    registry.register(CodeCollector(sampler, "r1", 3))
    text = generate_latest(registry).decode()
    assert 'stragglerwatch_code_samples_total{rank="3",run="r1"}' in text
    assert "stragglerwatch_code_site_share{" in text and "slow_spot" in text


def test_sampler_is_idle_while_no_step_runs(tmp_path: Path) -> None:
    sampler = CodeSampler(tmp_path, 0, lambda: None, hz=100, window_s=0.1).start()
    time.sleep(0.3)
    sampler.close()
    assert sampler.samples == 0 and not list(tmp_path.iterdir()), "nothing sampled, nothing written"


def _windows(rank: int, phase: str, shares: dict[str, float], t0: float = 100.0, n: int = 10,
             total: int = 40) -> list[dict]:  # fmt: skip
    rows = []
    for k in range(n):
        for site, share in shares.items():
            rows.append({"rank": rank, "t0": t0 + 2 * k, "t1": t0 + 2 * k + 2, "step0": 10 * k, "step1": 10 * k + 9,
                         "phase": phase, "site": site, "leaf": site, "native": True,
                         "samples": round(share * total), "total": total})  # fmt: skip
    return rows


STEP_TIMES = (np.arange(100), 100.0 + 0.2 * np.arange(100), 100.2 + 0.2 * np.arange(100))


def test_excess_is_attributed_to_the_site_that_holds_it() -> None:
    # rank 1 spends 25% of its time in get_batch, its peers 5%; the rest of the loop is alike
    rows = _windows(1, "data_wait", {"train.py:117 get_batch": 0.25}) + _windows(1, "forward", {"m.py:9 fwd": 0.5})
    for peer in (0, 2, 3):
        rows += _windows(peer, "data_wait", {"train.py:117 get_batch": 0.05})
        rows += _windows(peer, "forward", {"m.py:9 fwd": 0.5})
    code = pd.DataFrame(rows)
    s = {"rank": 1, "cause": "data", "first_step": 20, "last_step": None, "excess_ms": {"data": 40.0}}
    (found,) = locate(code, [s], STEP_TIMES)
    assert found["note"] is None
    (site,) = found["code"]
    assert site["site"] == "train.py:117 get_batch" and site["share"] == 1.0 and site["native"]
    assert site["excess_ms"] == pytest.approx(40.0, rel=0.05), "20% of a 200 ms step"
    text = code_text({**s, **found})
    assert "100% at train.py:117 get_batch (in native code)" in text and "40.0 ms/step" in text


def test_spread_excess_and_missing_samples_are_said() -> None:
    rows = []
    for rank in range(4):  # everyone alike: the straggler's excess is in no one place
        rows += _windows(rank, "forward", {"m.py:9 fwd": 0.5, "m.py:12 fwd": 0.3})
    s = {"rank": 1, "cause": "compute", "first_step": 20, "last_step": None, "excess_ms": {"compute": 30.0}}
    (spread,) = locate(pd.DataFrame(rows), [s], STEP_TIMES)
    assert spread["code"] == [] and "no code location stands out" in spread["note"]
    (none,) = locate(pd.DataFrame(columns=["rank"]), [s], STEP_TIMES)
    assert none["code"] == [] and "no code samples" in none["note"]
    few = pd.DataFrame(_windows(1, "forward", {"a.py:1 f": 0.5}, n=1, total=4) + _windows(0, "forward", {}, n=0))
    (thin,) = locate(few, [s], STEP_TIMES)
    assert thin["code"] == [] and thin["note"]
    report = {"stragglers": [{**s, "slowdown": 1.3, "lost_seconds": 2.0, "lost_gpu_seconds": 8.0, "code": [],
                              "code_note": spread["note"], "where": None, "hints": [], "context": []}],
              "busy_unavailable": [], "communication_bound": False, "job_slowdown": 1.1, "job_seconds": 10.0,
              "ideal_seconds": 9.0, "lost_seconds": 1.0, "lost_gpu_seconds": 4.0}  # fmt: skip
    assert any(line.strip().startswith("code: not located (no code location stands out") for line in
               verdict_lines(report))  # fmt: skip


def test_a_large_run_reads_the_stragglers_and_a_few_peers(tmp_path: Path) -> None:
    from stragglerwatch.analysis.codeprofile import MOST_PEERS, needed_ranks

    roles = {r: ("a" if r < 600 else "b") for r in range(1000)}
    wanted = needed_ranks([{"rank": 7}, {"rank": 9}], list(range(1000)), roles)
    assert {7, 9} <= set(wanted) and len(wanted) <= 2 + MOST_PEERS and all(roles[r] == "a" for r in wanted)
    assert max(wanted) > 300, "the peers spread over the role, not the first few"
    for rank in (0, 1, 2):
        sampler = CodeSampler(tmp_path, rank, lambda: (threading.get_ident(), 0, "forward"), hz=100, window_s=10)
        for _ in range(3):
            sampler.sample_once()
        sampler.close()
    assert set(load_code(tmp_path, [0, 2])["rank"]) == {0, 2}
    assert set(load_code(tmp_path)["rank"]) == {0, 1, 2}
