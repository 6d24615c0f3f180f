"""Load imbalance told apart from stragglers (``analysis/imbalance.py`` through ``detect``), on
matrices whose truth is known: busy = (base + cost per token x tokens) x slowness + extra wait + noise."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from stragglerwatch.analysis.detect import MATRIX_COLUMNS, StepMatrix, detect
from stragglerwatch.analysis.imbalance import advice
from stragglerwatch.record.schema import GAP_COLUMNS

BASE, PER_TOKEN, TOKENS = 0.010, 2e-6, 4000.0


@dataclass
class Job:
    matrix: StepMatrix
    true_cost: float


def job(ranks: int = 4, steps: int = 300, *, slow: int = 1, factor: float = 1.0, extra_s: float = 0.0,
        onset: int = 100, spread: float = 0.3, noise: float = 0.02, balanced: bool = False,
        heavy: float = 1.0, spikes: int = 0, per_token: float = PER_TOKEN, seed: int = 0) -> Job:  # fmt: skip
    rng = np.random.default_rng(seed)
    w = TOKENS * rng.lognormal(0.0, spread, (steps, ranks))
    if balanced:
        w = np.repeat(w[:, :1], ranks, axis=1)
    w[:, 0] *= heavy  # a shard of longer sequences on rank 0
    k = np.ones((steps, ranks))
    k[onset:, slow] = factor
    extra = np.zeros((steps, ranks))
    extra[onset:, slow] = extra_s
    eps = rng.normal(0.0, noise * (BASE + PER_TOKEN * TOKENS), (steps, ranks))
    if spikes:
        eps[rng.integers(0, steps, spikes), rng.integers(0, ranks, spikes)] += 0.2
    compute = k * (BASE + per_token * w) + eps
    data = 0.001 + extra
    busy = compute + data
    even = k * (BASE + per_token * w.mean(axis=1, keepdims=True)) + eps + data
    comm = 0.004 + busy.max(axis=1, keepdims=True) - busy
    v = {c: np.zeros((steps, ranks)) for c in MATRIX_COLUMNS}
    v.update(forward_s=0.4 * compute, backward_s=0.6 * compute, data_wait_s=data, busy_s=busy, comm_wait_s=comm,
             allreduce_wait_s=comm, step_s=busy + comm, work=w)  # fmt: skip
    v.update({c: np.full((steps, ranks), np.nan) for c in (*GAP_COLUMNS, "work_elements")})
    cost = float((busy.max(axis=1) - even.max(axis=1)).sum())
    return Job(StepMatrix(np.arange(ranks), np.arange(steps), v, "tokens"), cost)


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heavy_batches_flag_no_rank_and_the_cost_is_the_true_one(ranks: int, seed: int) -> None:
    j = job(ranks, seed=seed)
    v = detect(j.matrix)
    assert v.stragglers == []
    im = v.imbalance
    assert im is not None and im.detected and im.unit == "tokens"
    assert im.lost_seconds == pytest.approx(j.true_cost, rel=0.05)
    assert im.seconds_per_unit == pytest.approx(PER_TOKEN, rel=0.05)
    assert im.explained > 0.9
    assert im.heaviest_ranks == []
    assert im.slowdown == pytest.approx(v.job_seconds / (v.job_seconds - im.lost_seconds))


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize(("factor", "extra_s", "cause"), [(1.3, 0.0, "compute"), (1.0, 0.004, "data")])
def test_a_straggler_hidden_in_imbalance_is_found(ranks: int, factor: float, extra_s: float, cause: str) -> None:
    j = job(ranks, factor=factor, extra_s=extra_s)
    v = detect(j.matrix)
    assert [(s.rank, s.cause) for s in v.stragglers] == [(1, cause)]
    assert abs(v.stragglers[0].first_step - 100) <= 5
    assert v.imbalance.lost_seconds == pytest.approx(j.true_cost, rel=0.15)


def test_without_the_adjustment_the_heaviest_ranks_would_be_blamed() -> None:
    """The same job with its work column removed: the imbalance is taken for slowness (a static heavy
    shard flags rank 0), which is what the work per step prevents."""
    j = job(4, heavy=1.5, spread=0.02)
    with_work = detect(j.matrix)
    assert with_work.stragglers == [] and with_work.imbalance.heaviest_ranks == [0]
    assert with_work.imbalance.heaviest_share == 1.0
    values = dict(j.matrix.values, work=np.full_like(j.matrix.values["work"], np.nan))
    blind = detect(StepMatrix(j.matrix.ranks, j.matrix.steps, values))
    assert blind.imbalance is None
    assert [s.rank for s in blind.stragglers] == [0]
    lines = advice(with_work.imbalance)
    assert any("rank(s) 0 drew the heaviest batch in 100% of the steps" in line for line in lines), lines


def test_token_balanced_work_is_no_imbalance() -> None:
    v = detect(job(4, balanced=True).matrix)
    assert v.stragglers == [] and not v.imbalance.detected
    assert v.imbalance.lost_seconds == pytest.approx(0.0, abs=1e-9)
    assert advice(v.imbalance) == []


def test_work_that_costs_nothing_is_no_imbalance() -> None:
    """Work recorded but time does not follow it (padded batches: the mask varies, the shape not)."""
    v = detect(job(4, per_token=0.0, noise=0.05).matrix)
    assert v.stragglers == [] and not v.imbalance.detected


def test_spikes_move_neither_the_slope_nor_the_flags() -> None:
    j = job(4, spikes=12, seed=3)
    v = detect(j.matrix)
    assert v.stragglers == []
    assert v.imbalance.seconds_per_unit == pytest.approx(PER_TOKEN, rel=0.05)


def test_advice_names_the_cost_and_the_remedies() -> None:
    im = detect(job(4).matrix).imbalance
    lines = advice(im)
    assert len(lines) == 1 and "token-balanced sampling" in lines[0] and "pack sequences" in lines[0]


def test_runs_without_work_have_no_imbalance_verdict() -> None:
    j = job(4)
    values = {c: a for c, a in j.matrix.values.items() if not c.startswith("work")}
    assert detect(StepMatrix(j.matrix.ranks, j.matrix.steps, values)).imbalance is None


def test_busy_time_following_the_padded_shape_fits_the_shape() -> None:
    """Dynamic padding: the compute runs over each batch padded to its longest sequence, so busy time
    follows the padded elements, not the mask's ones: the analysis fits the shape and says so."""
    rng = np.random.default_rng(5)
    steps, ranks, seqs = 300, 4, 8
    lens = rng.lognormal(np.log(200), 0.6, (steps, ranks, seqs))
    tokens, padded = lens.sum(axis=2), seqs * lens.max(axis=2)
    j = job(ranks, per_token=0.0)
    busy = j.matrix.values["busy_s"] + PER_TOKEN * padded
    values = dict(j.matrix.values, busy_s=busy, forward_s=j.matrix.values["forward_s"] + PER_TOKEN * padded,
                  work=tokens, work_elements=padded)  # fmt: skip
    values["step_s"] = busy + values["comm_wait_s"]
    im = detect(StepMatrix(j.matrix.ranks, j.matrix.steps, values, "tokens")).imbalance
    assert im.column == "work_elements" and im.unit == "padded tokens"
    assert im.seconds_per_unit == pytest.approx(PER_TOKEN, rel=0.05)
    assert any("padded shape" in line for line in advice(im))
    # where busy time follows the real tokens, the counted work is kept
    values = dict(values, busy_s=j.matrix.values["busy_s"] + PER_TOKEN * tokens)
    values["step_s"] = values["busy_s"] + values["comm_wait_s"]
    im = detect(StepMatrix(j.matrix.ranks, j.matrix.steps, values, "tokens")).imbalance
    assert im.column == "work" and im.unit == "tokens"


def test_a_slightly_heavier_shard_is_named_when_chance_cannot_explain_it() -> None:
    """One rank's sequences 20% longer among 8 ranks whose batches vary by 25%: it is not the heaviest
    every step, but far more often than 1 in 8."""
    im = detect(job(8, heavy=1.2, spread=0.25, seed=4).matrix).imbalance
    assert im.heaviest_ranks == [0] and im.heaviest_share > 0.25
    assert "rank(s) 0 drew the heaviest batch" in advice(im)[0]
    assert detect(job(8, seed=4).matrix).imbalance.heaviest_ranks == []


def test_the_second_pass_is_skipped_only_where_it_would_find_the_same() -> None:
    """Once a first pass flags a rank, the healthy slopes are taken again without it and the flags found again;
    where busy time's healthy slope came out the same (the flags read no other adjusted column) that second
    pass is skipped. Each verdict equals the one with the second pass forced, the phases' new adjustment in it."""
    import stragglerwatch.analysis.detect as d

    same = d.imb.same_busy
    outcomes = []
    for ranks, factor, extra_s, seed in ((8, 1.3, 0.0, 0), (9, 1.0, 0.004, 1), (4, 1.3, 0.0, 2), (9, 1.0, 0.004, 3)):
        j = job(ranks, factor=factor, extra_s=extra_s, seed=seed)
        told: list[bool] = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(d.imb, "same_busy", lambda a, b, told=told: told.append(same(a, b)) or told[-1])
            v = detect(j.matrix)
            mp.setattr(d.imb, "same_busy", lambda a, b: False)
            forced = detect(j.matrix)
        assert told, "the first pass flagged nobody: no second pass to skip"
        outcomes += told
        assert [s.to_dict() for s in v.stragglers] == [s.to_dict() for s in forced.stragglers]
        assert np.array_equal(v.flags, forced.flags) and v.thresholds == forced.thresholds
        assert v.imbalance == forced.imbalance and v.lost_seconds == forced.lost_seconds
    assert True in outcomes and False in outcomes, f"both a skipped and a second pass: {outcomes}"


@pytest.mark.parametrize("n_groups", [1, 3])
def test_each_rank_is_adjusted_to_its_groups_median_work_with_its_groups_slope(n_groups: int) -> None:
    from stragglerwatch.analysis.imbalance import ADJUSTED, WorkModel, adjust
    from stragglerwatch.analysis.stages import Groups

    rng = np.random.default_rng(5)
    steps, ranks = 40, 7
    groups = Groups.of(np.arange(ranks), {r: f"stage{r % n_groups}" for r in range(ranks)})
    values = {c: rng.uniform(0.01, 0.02, (steps, ranks)).astype(np.float32 if c != "busy_s" else np.float64)
              for c in ADJUSTED}  # fmt: skip
    values["busy_s"][3, 2] = np.nan
    values["work"] = rng.uniform(1000.0, 5000.0, (steps, ranks))
    ref = rng.uniform(2000.0, 3000.0, (steps, n_groups))
    healthy = {c: rng.uniform(1e-6, 3e-6, n_groups) for c in ADJUSTED}
    out = adjust(values, WorkModel({}, healthy, steps, ref), groups)
    for c in ADJUSTED:
        for r in range(ranks):
            g = groups.index[r]
            want = values[c][:, r].astype(np.float64) - healthy[c][g] * (values["work"][:, r] - ref[:, g])
            want = want if c == "busy_s" else np.maximum(want, 0.0)
            np.testing.assert_allclose(out[c][:, r], want, rtol=1e-12)
    assert np.isnan(out["busy_s"][3, 2]) and out["busy_s"].dtype == np.float64 and out["forward_s"].dtype == np.float64
