"""The steps x ranks arrays read from a run dir's files: every record in its cell, NaN in every cell without one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stragglerwatch.analysis import runmatrix
from stragglerwatch.record.simulate import rank_table
from stragglerwatch.record.steplog import RunDirWarning, run_files

STEPS = 10


def _table(rank: int, rows: list[int], rng: np.random.Generator) -> pa.Table:
    """Rank ``rank``'s records of the steps ``rows``, in that order, each value its own."""
    arrays = {c: rng.random((STEPS, 1)) for c in ("busy_s", "step_s", "forward_s", "data_wait_s")}
    whole = rank_table(arrays, rank, 0, np.arange(STEPS, dtype=np.float64))
    return whole.take(pa.array(rows))


def test_every_record_lands_in_its_cell_and_every_other_cell_is_nan(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    files = {
        "rank-00000.parquet": _table(0, list(range(STEPS)), rng),  # every step, in order
        "rank-00001.parquet": _table(1, list(range(3, STEPS)), rng),  # joined late: one run of steps
        "rank-00002.parquet": _table(2, [0, 1, 2, 5, 6, 7, 8, 9], rng),  # a gap: placed record by record
        "rank-00003.parquet": _table(3, list(range(STEPS))[::-1], rng),  # out of order
        "rank-00004.parquet": _table(4, [0, 1, 2], rng),  # left early
        # a rank in two files: one run of steps first, then records placed one by one
        "rank-00005.1.parquet": _table(5, list(range(6, STEPS)), rng),
        "rank-00005.parquet": _table(5, [2, 0, 1], rng),
    }
    for name, table in files.items():
        pq.write_table(table, tmp_path / name)
    with pytest.warns(RunDirWarning, match="world size taken from the ranks"):  # no run.json
        _, _, paths = run_files(tmp_path)
    plan = runmatrix.plan([runmatrix.scan_file(f) for f in paths])
    assert plan.ranks.tolist() == [0, 1, 2, 3, 4, 5] and plan.steps.tolist() == list(range(STEPS))
    got = runmatrix.fill(paths, plan, plan.ranks)
    for column in runmatrix.VALUE_COLUMNS:
        want = np.full((STEPS, 6), np.nan)
        for table in files.values():
            rank, step = table["rank"].to_numpy(), table["step"].to_numpy()
            want[step, rank] = table[column].to_numpy()
        assert np.array_equal(got[column], want.astype(got[column].dtype), equal_nan=True), column
    busy = got["busy_s"]
    assert np.isnan(busy[:3, 1]).all() and np.isnan(busy[3:5, 2]).all() and np.isnan(busy[3:, 4]).all()
    assert np.isnan(busy[3:6, 5]).all() and np.isfinite(busy[[0, 1, 2, 6, 7, 8, 9], 5]).all()
    assert np.isfinite(busy[:, [0, 3]]).all() and np.isfinite(busy[:3, 4]).all()
