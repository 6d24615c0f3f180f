"""Real gloo DDP jobs whose loops are written the way their authors' documentation teaches, as a
new user would write them, and instrumented only with ``watch = stragglerwatch.attach(model,
run_dir)`` after the DDP wrap (``tests/workers/real_loops.py``, which says more of each shape):

- ``nanogpt``: nanoGPT's loop, no DataLoader, ``get_batch`` on a ``np.memmap`` called between
  forward and backward, accumulation by toggling ``require_backward_grad_sync``, gradient clipping;
  with and without the ``watch.data(get_batch)`` marker;
- ``accum_toggle``: a DataLoader loop accumulating by toggling ``require_backward_grad_sync``;
- ``eval_ckpt``: evaluation through ``model.module`` under ``no_grad`` and a ``torch.save``
  checkpoint on rank 0 alone, every 10 steps from step 0 on;
- ``amp_cpu``: ``torch.autocast("cpu", dtype=torch.bfloat16)`` and a disabled ``GradScaler``;
- ``streaming``: an ``IterableDataset`` whose ``__iter__`` waits for each sample;
- ``workers``: a DataLoader with two workers that cannot keep up on the slow rank.

People write loops so because that is what nanoGPT, the PyTorch DDP, AMP and data-loading tutorials
show; a tool that only finds stragglers in its own example job finds none in theirs. Each job has one
straggler, a rank ~20 ms a step slower from step 10 on (a 10-30 ms step), and the report must name
exactly that rank, the cause, and (``where``/``code``, the code sampler at 50 Hz) the code location.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from conftest import ROOT, analyze_json, check_anatomy, launch, medians, only_straggler

import stragglerwatch

pytestmark = pytest.mark.distributed
REAL_LOOPS = ROOT / "tests" / "workers" / "real_loops.py"
WORKER_FILE = "real_loops.py"
CODE_HZ = 50  # attach(code_sample_hz=...): the stack sampler that feeds the report's `code`
STEPS = 50
MS = 1e-3


def run_shape(tmp_path: Path, nproc: int, shape: str, *args: str, steps: int = STEPS) -> tuple[Path, pd.DataFrame]:
    run = tmp_path / "run"
    launch(nproc, REAL_LOOPS, "--shape", shape, "--steps", str(steps), "--code-hz", str(CODE_HZ), *args,
             "--run-dir", str(run), "--work-dir", str(tmp_path / "work"), timeout_s=120)  # fmt: skip
    df = stragglerwatch.load_run(run)
    assert set(df["rank"]) == set(range(nproc)), "every rank logged"
    per_rank = df.groupby("rank")["step"].agg(list)
    assert per_rank.map(lambda s: s == list(range(steps))).all(), "one step per optimizer step, none merged or lost"
    check_anatomy(df)
    return run, df


def located(s: dict, function: str, where: str | None = None) -> None:
    """The straggler's place in the step (``where``) and in the code (``code``, best first; a site is
    ``path:line function``): the first site is in the worker script, in ``function``."""
    if where is not None:
        assert s["where"] == where, s
    assert s["code"], f"no code location: {s.get('code_note')}"
    site = s["code"][0]["site"]
    path, _, name = site.rpartition(" ")
    assert WORKER_FILE in path and name.endswith(function), s["code"]


def excess(med: pd.DataFrame, rank: int, column: str) -> float:
    """How much more of ``column`` the rank has a step than the most of its peers (seconds)."""
    return med.loc[rank, column] - med.drop(index=rank)[column].max()


#: The slow rank's get_batch sleeps this long a step in the nanoGPT loop. Its steps are 6-15 ms: at the
#: worker's default of 20 ms, another process on this 2-core machine offsets one rank by as much for a few
#: steps (measured: 7 ms for 10 steps beside one busy process, and a straggler's onset found at step 3, 6 or,
#: in one full-suite run, 21 instead of 10); at 40 ms the onset was step 10 in 8 of 8 such runs.
NANO_DELAY = 0.04


def test_nanogpt_marked_get_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """nanoGPT's loop with ``get_batch = watch.data(get_batch)``: a slow ``get_batch`` between forward and
    backward is data."""
    run, df = run_shape(tmp_path, 2, "nanogpt", "--mark", "--slow-rank", "1", "--delay", str(NANO_DELAY))
    assert (df["micro_batches"] == 2).all(), "two micro-steps a step, without no_sync()"
    s = only_straggler(analyze_json(run, capsys), 1, "data")
    med = medians(df)
    assert excess(med, 1, "data_wait_s") > 0.6 * NANO_DELAY
    assert med["other_s"].max() < 8 * MS, "the marked fetch between forward and backward is not other"
    located(s, "get_batch")


def test_nanogpt_unmarked_get_batch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same loop as nanoGPT ships it, no marker: the time is "other", placed between forward and backward,
    and the code names ``get_batch``."""
    run, df = run_shape(tmp_path, 2, "nanogpt", "--slow-rank", "1", "--delay", str(NANO_DELAY))
    assert (df["micro_batches"] == 2).all()
    s = only_straggler(analyze_json(run, capsys), 1, "other")
    assert excess(medians(df), 1, "other_s") > 0.6 * NANO_DELAY
    located(s, "get_batch", where="between forward and backward")


def test_accumulation_by_toggling_grad_sync(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A DataLoader loop accumulating two micro-batches by toggling ``require_backward_grad_sync``; a slow layer."""
    run, df = run_shape(tmp_path, 2, "accum_toggle", "--slow-rank", "0")
    assert (df["micro_batches"] == 2).all()
    s = only_straggler(analyze_json(run, capsys), 0, "compute")
    assert excess(medians(df), 0, "forward_s") > 12 * MS
    located(s, "slow_layer")


def test_eval_and_checkpoint_on_rank0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Rank 0 alone evaluates (``model.module``, ``no_grad``) and checkpoints every 10 steps, step 0 included;
    rank 1 is slow: only rank 1 is flagged."""
    run, df = run_shape(tmp_path, 3, "eval_ckpt", "--slow-rank", "1", "--eval-every", "10")
    assert (tmp_path / "work" / "ckpt.pt").is_file()
    s = only_straggler(analyze_json(run, capsys), 1, "compute")
    med = medians(df)
    assert excess(med, 1, "forward_s") > 12 * MS
    evals = df[df["step"].isin([10, 20, 30, 40])].set_index(["step", "rank"])["eval_s"]
    assert (evals.xs(0, level="rank") > 0).all(), "rank 0's evaluation is eval"
    assert (evals.drop(index=0, level="rank") == 0).all()
    assert (df["micro_batches"] == 1).all(), "evaluation forwards are not training micro-batches"
    located(s, "slow_layer")


def test_eval_and_checkpoint_on_rank0_healthy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The same job with nobody slowed: rank 0's evaluation and checkpoints do not make it a straggler."""
    run, _ = run_shape(tmp_path, 3, "eval_ckpt", "--eval-every", "10")
    r = analyze_json(run, capsys)
    assert r["stragglers"] == [] and r["busy_unavailable"] == []


def test_autocast_and_disabled_grad_scaler(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bf16 autocast on CPU with a disabled GradScaler (``scaler.step`` calls ``optimizer.step``)."""
    run, df = run_shape(tmp_path, 2, "amp_cpu", "--slow-rank", "1")
    assert (df["micro_batches"] == 1).all()
    s = only_straggler(analyze_json(run, capsys), 1, "compute")
    assert excess(medians(df), 1, "forward_s") > 12 * MS
    located(s, "slow_layer")


def test_streaming_iterable_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An IterableDataset waiting for each streamed sample in ``__iter__`` (``num_workers=0``)."""
    run, df = run_shape(tmp_path, 2, "streaming", "--slow-rank", "0")
    s = only_straggler(analyze_json(run, capsys), 0, "data")
    assert excess(medians(df), 0, "data_wait_s") > 12 * MS
    located(s, "__iter__")


def test_dataloader_workers_cannot_keep_up(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Two DataLoader workers whose reads are too slow on rank 1. The loader hands out the workers' batches
    in turn and the two finish theirs together, so rank 1 waits ~100 ms every other step and ~0 in between
    (the usual face of a worker-bound loader: with N workers, every N-th step); it is still the rank
    holding the job back, by data. Such a rank is flagged after 48 steps of it (6 blocks of 8 steps,
    ``intermittent.py``), hence a longer job, and its onset is known to a block: within 8 steps of the
    injection. With the 20 ms of the other shapes, two busy processes on the two cores blurred the
    pattern past detection (2 runs of 3); at 40 ms it holds (``--delay``)."""
    run, df = run_shape(tmp_path, 2, "workers", "--slow-rank", "1", "--delay", "0.04", steps=80)
    slow = df[(df["rank"] == 1) & (df["step"] >= 14)]["data_wait_s"]
    assert slow.mean() - df[df["rank"] == 0]["data_wait_s"].mean() > 12 * MS, "rank 1 waits for its workers"
    s = only_straggler(analyze_json(run, capsys), 1, "data", onset=(2, 18))
    located(s, "workers")  # the loop's `for x, y in loader`: the wait is in the loader's __next__
