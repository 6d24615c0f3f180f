"""The step anatomy arithmetic on hand-made marks (host seconds)."""

from __future__ import annotations

import math

import pytest

from stragglerwatch.schema import PHASE_COLUMNS, StepRecord, records_to_batch
from stragglerwatch.timing import StepMarks, anatomy


def marks(**kw: object) -> StepMarks:
    m = StepMarks(step=kw.pop("step", 3), start=10.0, host_start=10.0, data_from_gap=kw.pop("gap", True))
    for k, v in kw.items():
        setattr(m, k, v)
    return m


def phase_sum(r: StepRecord) -> float:
    return sum(getattr(r, c) for c in PHASE_COLUMNS)


def test_ddp_step_partitions_exactly() -> None:
    # data 10.000-10.005, fwd -10.015, loss, bwd 10.016-10.036, last all-reduce done 10.050, opt 10.051-10.055
    m = marks(
        fwd_start=[10.005],
        fwd_end=[10.015],
        bwd_start=[10.016],
        bwd_end=[10.036],
        ready=[(0, 10.030), (1, 10.035)],
        done=[(1, 10.050), (0, 10.040)],
        sync=[(10.036, 10.050)],
        opt_start=10.051,
        end=10.055,
    )
    r = anatomy(m, rank=2, wall_anchor=1000.0)
    assert r.rank == 2 and r.step == 3 and r.micro_batches == 1
    assert r.start_time == pytest.approx(1010.0)
    assert r.step_s == pytest.approx(0.055)
    assert r.data_wait_s == pytest.approx(0.005)
    assert r.forward_s == pytest.approx(0.010)
    assert r.backward_s == pytest.approx(0.020)
    assert r.allreduce_wait_s == pytest.approx(0.014)
    assert r.optimizer_s == pytest.approx(0.004)
    assert r.other_s == pytest.approx(0.002)  # loss 1 ms + finalize 1 ms
    assert phase_sum(r) == pytest.approx(r.step_s)
    assert r.busy_s == pytest.approx(r.step_s - r.allreduce_wait_s)
    assert r.bucket_index == [0, 1]
    assert r.bucket_ready_s == pytest.approx([0.030, 0.035])
    assert r.bucket_allreduce_s == pytest.approx([0.010, 0.015])


def test_overlapped_allreduce_is_no_wait() -> None:
    m = marks(
        fwd_start=[10.0],
        fwd_end=[10.01],
        bwd_start=[10.01],
        bwd_end=[10.03],
        ready=[(0, 10.02)],
        done=[(0, 10.025)],
        opt_start=10.03,
        end=10.031,
    )
    r = anatomy(m, 0, 0.0)
    assert r.allreduce_wait_s == 0.0
    assert r.busy_s == pytest.approx(r.step_s)


def test_wrapped_loader_time_replaces_gap() -> None:
    m = marks(gap=False, data_wait_s=0.003, fwd_start=[10.008], fwd_end=[10.01], opt_start=10.02, end=10.02)
    r = anatomy(m, 0, 0.0)
    assert r.data_wait_s == pytest.approx(0.003)
    assert r.other_s == pytest.approx(0.02 - 0.003 - 0.002)


def test_accumulation_sums_micro_batches() -> None:
    m = marks(
        fwd_start=[10.0, 10.1, 10.2],
        fwd_end=[10.01, 10.11, 10.21],
        bwd_start=[10.02, 10.12, 10.22],
        bwd_end=[10.05, 10.15, 10.25],
        ready=[(0, 10.24)],
        done=[(0, 10.27)],
        sync=[(10.25, 10.27)],
        opt_start=10.28,
        end=10.29,
    )
    r = anatomy(m, 0, 0.0)
    assert r.micro_batches == 3
    assert r.forward_s == pytest.approx(0.03)
    assert r.backward_s == pytest.approx(0.09)
    assert r.allreduce_wait_s == pytest.approx(0.02)  # only the last backward synchronised
    assert phase_sum(r) == pytest.approx(r.step_s)


def test_missing_allreduce_completion_is_nan_not_crash() -> None:
    m = marks(
        fwd_start=[10.0],
        fwd_end=[10.01],
        bwd_start=[10.01],
        bwd_end=[10.02],
        ready=[(0, 10.02)],
        done=[],
        opt_start=10.02,
        end=10.03,
    )
    r = anatomy(m, 0, 0.0)
    assert math.isnan(r.bucket_allreduce_s[0])
    assert r.allreduce_wait_s == 0.0


def test_step_without_forward_is_all_other() -> None:
    m = marks(opt_start=10.01, end=10.02)
    r = anatomy(m, 0, 0.0)
    assert (r.data_wait_s, r.forward_s, r.backward_s) == (0.0, 0.0, 0.0)
    assert r.optimizer_s == pytest.approx(0.01) and r.other_s == pytest.approx(0.01)


def test_records_to_batch_roundtrip() -> None:
    m = marks(fwd_start=[10.0], fwd_end=[10.01], opt_start=10.01, end=10.02)
    recs = [anatomy(m, 0, 0.0), anatomy(m, 1, 0.0)]
    batch = records_to_batch(recs)
    assert batch.num_rows == 2
    assert batch.column("rank").to_pylist() == [0, 1]
    assert batch.column("bucket_index").to_pylist() == [[], []]
    assert records_to_batch([]).num_rows == 0
