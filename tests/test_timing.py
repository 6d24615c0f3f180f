"""The step anatomy arithmetic on hand-made marks (host seconds)."""

from __future__ import annotations

import math
import random

import pytest

from stragglerwatch.record.schema import PHASE_COLUMNS, StepRecord, records_to_batch
from stragglerwatch.runtime.capture.intervals import _carve_python, _carve_regions, _carve_sweep, carve
from stragglerwatch.runtime.capture.timing import StepMarks, anatomy, gaps


def marks(**kw: object) -> StepMarks:
    """Marks of step 3 starting at 10.0; ``opt_start`` opens the one optimizer step, which ends with the step."""
    m = StepMarks(step=kw.pop("step", 3), start=10.0, host_start=10.0, data_from_gap=kw.pop("gap", True))
    opt_start = kw.pop("opt_start", None)
    for k, v in kw.items():
        setattr(m, k, v)
    if opt_start is not None:
        m.opt = [[opt_start, m.end]]
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
    assert r.comm_wait_s == r.allreduce_wait_s and r.collective_wait_s == 0.0 and r.eval_s == 0.0
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
    m = marks(gap=False, data=[(10.005, 10.008)], fwd_start=[10.008], fwd_end=[10.01], opt_start=10.02, end=10.02)
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


def test_collectives_are_carved_out_of_the_phase_they_sit_in() -> None:
    # forward 10.000-10.030 holds DDP's buffer broadcast 10.001-10.021; backward 10.030-10.060 holds a
    # SyncBatchNorm all-reduce 10.040-10.050; the loop all-reduces its loss 10.075-10.085 after the optimizer
    m = marks(
        fwd_start=[10.0],
        fwd_end=[10.030],
        bwd_start=[10.030],
        bwd_end=[10.060],
        sync=[(10.060, 10.065)],
        comm=[(10.001, 10.021), (10.040, 10.050), (10.075, 10.085)],
        opt=[[10.066, 10.070]],
        end=10.090,
    )
    r = anatomy(m, 0, 0.0)
    assert r.forward_s == pytest.approx(0.010) and r.backward_s == pytest.approx(0.020)
    assert r.allreduce_wait_s == pytest.approx(0.005) and r.collective_wait_s == pytest.approx(0.040)
    assert r.comm_wait_s == pytest.approx(0.045) and r.optimizer_s == pytest.approx(0.004)
    assert r.other_s == pytest.approx(0.001 + 0.005 + 0.005)
    assert r.busy_s == pytest.approx(r.step_s - 0.045) and phase_sum(r) == pytest.approx(r.step_s)


def test_barrier_and_evaluation_in_the_gap_are_not_data() -> None:
    # no wrapped loader: the gap 10.000-10.100 before the first training forward holds an evaluation
    # pass 10.005-10.060 and a barrier 10.065-10.090; the rest of the gap is data
    m = marks(evals=[[10.005, 10.060]], comm=[(10.065, 10.090)], fwd_start=[10.1], fwd_end=[10.11], end=10.12)
    r = anatomy(m, 0, 0.0)
    assert r.eval_s == pytest.approx(0.055) and r.collective_wait_s == pytest.approx(0.025)
    assert r.data_wait_s == pytest.approx(0.1 - 0.055 - 0.025)
    assert r.busy_s == pytest.approx(r.step_s - 0.055 - 0.025) and phase_sum(r) == pytest.approx(r.step_s)


def test_closure_forward_backward_inside_the_optimizer_and_several_optimizers() -> None:
    # optimizer.step(closure) 10.010-10.050 runs forward 10.012-10.020 and backward 10.020-10.040;
    # a second optimizer steps 10.050-10.058; an unfinished evaluation (end None) is ignored
    m = marks(
        fwd_start=[10.012],
        fwd_end=[10.020],
        bwd_start=[10.020],
        bwd_end=[10.040],
        opt=[[10.010, 10.050], [10.050, 10.058]],
        evals=[[10.059, None]],
        end=10.060,
    )
    r = anatomy(m, 0, 0.0)
    assert r.forward_s == pytest.approx(0.008) and r.backward_s == pytest.approx(0.020)
    assert r.optimizer_s == pytest.approx(0.040 - 0.028 + 0.008)
    assert r.data_wait_s == pytest.approx(0.010), "the gap ends where the optimizer (holding the forward) began"
    assert r.eval_s == 0.0 and phase_sum(r) == pytest.approx(r.step_s)


def test_carve_gives_each_instant_to_the_first_layer() -> None:
    sec = carve([("a", [(0, 2), (1, 3)]), ("b", [(2, 5), (4, 6)]), ("c", [(-1, 10)])], 0.0, 8.0)
    assert sec == pytest.approx({"a": 3.0, "b": 3.0, "c": 2.0})
    assert carve([("a", [(5, 4)])], 0.0, 1.0) == {}


def test_split_moves_the_marks_after_the_cut_into_the_next_step() -> None:
    m = marks(fwd_start=[10.0], fwd_end=[10.01], opt=[[10.02, 10.03]])
    cut = m.lengths()
    m.fwd_start.append(10.05)
    m.fwd_end.append(10.06)
    m.comm.append((10.04, 10.045))
    tail = m.split(cut, 10.03, 10.03)
    assert (m.end, m.fwd_start, m.comm) == (10.03, [10.0], [])
    assert (tail.step, tail.start, tail.fwd_start, tail.fwd_end) == (4, 10.03, [10.05], [10.06])
    assert tail.comm == [(10.04, 10.045)]


def test_untimed_time_is_named_by_where_it_lies() -> None:
    # a fetch between forward and backward (10.015-10.030, unmarked), clipping and logging between the
    # end of the all-reduce wait and the optimizer (10.050-10.053), the gap before the forward is data
    m = marks(fwd_start=[10.005], fwd_end=[10.015], bwd_start=[10.030], bwd_end=[10.040], sync=[(10.040, 10.050)],
              opt_start=10.053, end=10.055)  # fmt: skip
    r = anatomy(m, rank=0, wall_anchor=0.0)
    assert r.gap_before_forward_s == pytest.approx(0.005)
    assert r.gap_forward_backward_s == pytest.approx(0.015)
    assert r.gap_backward_optimizer_s == pytest.approx(0.003)
    assert r.gap_after_optimizer_s == 0.0
    assert r.data_wait_s == pytest.approx(0.005), "without a timed fetch the gap before the forward is data"
    assert r.other_s == pytest.approx(0.018), "the rest of the untimed time is other, wherever it lies"
    assert phase_sum(r) == pytest.approx(r.step_s)


def test_a_marked_fetch_between_forward_and_backward_is_data() -> None:
    m = marks(gap=False, fwd_start=[10.005], fwd_end=[10.015], data=[(10.016, 10.029)], bwd_start=[10.030],
              bwd_end=[10.040], opt_start=10.045, end=10.050)  # fmt: skip
    r = anatomy(m, rank=0, wall_anchor=0.0)
    assert r.data_wait_s == pytest.approx(0.013)
    assert r.gap_forward_backward_s == pytest.approx(0.002), "only what the marked fetch did not cover"
    assert r.gap_before_forward_s == pytest.approx(0.005), "no longer data: a fetch is marked"
    assert r.gap_backward_optimizer_s == pytest.approx(0.005)
    assert r.other_s == pytest.approx(0.012)
    assert phase_sum(r) == pytest.approx(r.step_s)


def test_marked_fetch_outranks_the_forward_it_sits_in_but_not_a_collective() -> None:
    m = marks(gap=False, fwd_start=[10.0], fwd_end=[10.030], data=[(10.005, 10.020)], comm=[(10.010, 10.015)],
              opt_start=10.030, end=10.040)  # fmt: skip
    r = anatomy(m, rank=0, wall_anchor=0.0)
    assert r.collective_wait_s == pytest.approx(0.005)
    assert r.data_wait_s == pytest.approx(0.010)
    assert r.forward_s == pytest.approx(0.015)


def test_gaps_under_accumulation_and_after_the_optimizer() -> None:
    # two micro-batches; the second's fetch gap (10.025-10.030) lies before its forward; a second optimizer's
    # step follows 5 ms after the first's (after the optimizer) and ends the step
    m = marks(gap=False, fwd_start=[10.0, 10.030], fwd_end=[10.010, 10.040], bwd_start=[10.010, 10.040],
              bwd_end=[10.025, 10.055], end=10.070)  # fmt: skip
    m.opt = [[10.055, 10.060], [10.065, 10.070]]
    r = anatomy(m, rank=0, wall_anchor=0.0)
    assert r.gap_before_forward_s == pytest.approx(0.005)
    assert r.gap_after_optimizer_s == pytest.approx(0.005)
    assert r.gap_forward_backward_s == 0.0 and r.gap_backward_optimizer_s == 0.0


def _random_layers(rng: random.Random) -> list[tuple[str, list[tuple[float, float]]]]:
    """Up to 8 layers of random intervals over about [0, 1]: overlapping, nested, touching, empty,
    reversed, out of bounds, repeated endpoints (a coarse grid makes ties common)."""
    def point() -> float:
        return rng.choice((rng.randint(-2, 22) / 20, rng.uniform(-0.1, 1.1)))

    labels = ["comm", "eval", "data", "forward", "backward", "optimizer", "data"]
    return [(label, [(point(), point()) for _ in range(rng.choice((0, 1, 2, 5, 40)))]) for label in labels]


@pytest.mark.parametrize("seed", range(100))
def test_the_sweep_and_the_python_carve_agree(seed: int) -> None:
    rng = random.Random(seed)
    layers = _random_layers(rng)
    timed = rng.randint(0, len(layers))
    py_sec, py_free = _carve_python(layers, timed, 0.0, 1.0)
    np_sec, np_free = _carve_sweep(layers, timed, 0.0, 1.0)
    assert py_sec.keys() == np_sec.keys()
    for label, seconds in py_sec.items():
        assert np_sec[label] == pytest.approx(seconds, abs=1e-12)
    assert len(np_free) == len(py_free)
    for (a, b, n), (c, d, o) in zip(np_free, py_free, strict=True):
        assert a == pytest.approx(c, abs=1e-12) and b == pytest.approx(d, abs=1e-12) and n == pytest.approx(o)
    assert sum(np_sec.values()) <= 1.0 + 1e-9


@pytest.mark.parametrize("seed", range(150))
def test_the_region_carve_agrees_with_the_python_carve(seed: int) -> None:
    """One layer of many sorted, disjoint intervals (collectives) among few others; the gaps named
    by random anchors: the bounded path gives every layer and every gap the same seconds."""
    rng = random.Random(seed)
    layers = _random_layers(rng)
    n = rng.choice((30, 80, 200))
    cuts = sorted(rng.uniform(-0.05, 1.05) for _ in range(2 * n))
    big = rng.randint(0, 2)
    layers[big] = ("comm", list(zip(cuts[::2], cuts[1::2], strict=True)))
    layers = [(label, iv[:3]) if k != big else (label, iv) for k, (label, iv) in enumerate(layers)]
    timed = rng.randint(big + 1, len(layers))
    ends = [t for k, (_, iv) in enumerate(layers[:timed]) if k != big for a, b in iv if a < b for t in (a, b)]
    anchors = sorted((rng.choice(ends), rng.choice("FfBbOo")) for _ in range(rng.randint(0, 4) if ends else 0))
    times = [t for t, _ in anchors]
    regions = _carve_regions(layers, big, timed, 0.0, 1.0, times)
    assert regions is not None, "anchors at the ends of timed intervals never lie inside an untimed stretch"
    py_sec, py_free = _carve_python(layers, timed, 0.0, 1.0)
    sec, free = regions
    assert sec.keys() == py_sec.keys()
    for label, seconds in py_sec.items():
        assert sec[label] == pytest.approx(seconds, abs=1e-9), label
    assert gaps(anchors, free) == pytest.approx(gaps(anchors, py_free), abs=1e-9)
    anywhere = sorted((rng.uniform(-0.1, 1.1), rng.choice("FfBbOo")) for _ in range(3))
    regions = _carve_regions(layers, big, timed, 0.0, 1.0, [t for t, _ in anywhere])
    if regions is not None:  # declined where an anchor lies inside an untimed stretch; else the same
        assert regions[0] == pytest.approx(py_sec, abs=1e-9)
        assert gaps(anywhere, regions[1]) == pytest.approx(gaps(anywhere, py_free), abs=1e-9)


def test_the_region_carve_declines_what_it_cannot_do_exactly() -> None:
    overlapping = [("comm", [(0.1, 0.3), (0.2, 0.4)] * 20), ("forward", [(0.0, 0.5)])]
    assert _carve_regions(overlapping, 0, 2, 0.0, 1.0, ()) is None
    comm = [(0.6 + i * 0.01, 0.605 + i * 0.01) for i in range(30)]
    layers = [("comm", comm), ("forward", [(0.0, 0.5)])]
    assert _carve_regions(layers, 0, 2, 0.0, 1.0, [0.55]) is None, "an open forward's start inside a gap"
    assert _carve_regions(layers, 0, 2, 0.0, 1.0, [0.5]) is not None


def test_a_step_with_hundreds_of_collectives_partitions_exactly() -> None:
    """FSDP's shape: hundreds of collectives inside forward and backward (the numpy sweep)."""
    comm = [(10.0 + 0.001 * i, 10.0 + 0.001 * i + 0.0004) for i in range(400)]
    m = marks(fwd_start=[10.0], fwd_end=[10.2], bwd_start=[10.2], bwd_end=[10.4], comm=comm,
              opt_start=10.41, end=10.42)  # fmt: skip
    r = anatomy(m, rank=0, wall_anchor=0.0)
    assert r.collective_wait_s == pytest.approx(0.16)
    assert r.forward_s == pytest.approx(0.2 - 0.08) and r.backward_s == pytest.approx(0.2 - 0.08)
    assert r.optimizer_s == pytest.approx(0.01)
    assert r.gap_backward_optimizer_s == pytest.approx(0.01)
    assert phase_sum(r) == pytest.approx(r.step_s)
