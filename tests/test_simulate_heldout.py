"""The simulator's held-out options (``benchmarks/heldout.py``): each does what it says in the arrays,
and with all of them off a simulation is what it was before they existed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from stragglerwatch.record import simulate
from stragglerwatch.record.simulate import (
    PHASE_SHARES,
    Injection,
    SimConfig,
    injected,
    simulate_arrays,
    two_mode,
    write_run,
)
from stragglerwatch.record.steplog import load_run

REAL = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "healthy-residuals.csv"
QUIET = {"noise": 0.0, "drift": 0.0, "spike_prob": 0.0}  # no noise: every difference is an injection

# Sums of every column, and four cells of busy_s, as simulated before the held-out options were added.
BEFORE = [
    (
        SimConfig(ranks=16, steps=300, seed=5, injections=[Injection(3, 0.2, 100, "data", 250), Injection(7, 0.1, 50)]),
        {"allreduce_wait_s": 125.51027268711671, "backward_s": 265.92322826712564, "busy_s": 487.35560219691286,
         "data_wait_s": 27.02778010984565, "forward_s": 145.0490336002503, "optimizer_s": 24.027780109845647,
         "other_s": 25.327780109845648, "step_s": 612.8658748840295},
        [0.09442361289904064, 0.1256411351194047, 0.0974997432670148, 0.11268180783409526],
    ),
    (
        SimConfig(ranks=16, steps=200, seed=2, offset=0.03, spike_tail=1.5, stall_every=50, host_noise=0.03,
                  rank_drift=0.02, drift_steps=400, bootstrap=str(REAL),
                  injections=[Injection(1, 0.15, 20, "optimizer")]),
        {"allreduce_wait_s": 237.8472896736145, "backward_s": 182.49282577748312, "busy_s": 338.00956322071056,
         "data_wait_s": 16.590256888862104, "forward_s": 99.5415413331726, "optimizer_s": 19.290256888862103,
         "other_s": 20.094682332330567, "step_s": 575.8568528943249},
        [0.08416757017523778, 0.15876829819360108, 0.19312877146974744, 0.09460828377228192],
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", range(len(BEFORE)))
def test_defaults_simulate_as_before(case: int) -> None:
    cfg, sums, cells = BEFORE[case]
    arrays = simulate_arrays(cfg)
    for col, total in sums.items():
        assert arrays[col].sum() == pytest.approx(total, rel=1e-9), col
    got = [arrays["busy_s"][s, r] for s, r in ((0, 0), (150, 3), (199, 1), (120, 7))]
    assert got == pytest.approx(cells, rel=1e-9)
    explicit = SimConfig(**{**cfg.__dict__, "bimodal_prob": 0.0, "host_drift": 0.0})
    assert all(np.array_equal(arrays[c], simulate_arrays(explicit)[c]) for c in arrays)


def test_run_json_as_before_unless_used(tmp_path: Path) -> None:
    plain = json.loads((write_run(tmp_path / "a", SimConfig(ranks=2, steps=5, injections=[Injection(1, 0.2)])) /
                        "run.json").read_text())["simulation"]  # fmt: skip
    assert not {"bimodal_prob", "bimodal_mag", "bimodal_hold", "host_drift", "host_drift_steps"} & set(plain)
    assert set(plain["injections"][0]) == {"rank", "slowdown", "onset", "cause", "end"}
    cfg = SimConfig(ranks=2, steps=5, host_drift=0.02, injections=[Injection(1, 0.2, period=4, duty=2)])
    used = json.loads((write_run(tmp_path / "b", cfg) / "run.json").read_text())["simulation"]
    assert used["host_drift"] == 0.02 and used["injections"][0]["period"] == 4 and "mix" not in used["injections"][0]


def excess(cfg: SimConfig) -> dict[str, np.ndarray]:
    """Per phase, steps x ranks of what the injections added (the same run without them subtracted)."""
    with_, without = simulate_arrays(cfg), simulate_arrays(SimConfig(**{**cfg.__dict__, "injections": []}))
    return {c: (with_[c] - without[c]) / (cfg.step_ms / 1000) for c in (*PHASE_SHARES, "busy_s")}


def test_mix_splits_the_excess_between_phases() -> None:
    inj = Injection(2, 0.2, 10, "data", mix={"data_wait_s": 3, "other_s": 2})
    cfg = SimConfig(ranks=4, steps=50, seed=1, injections=[inj])
    got = excess(cfg)
    assert np.allclose(got["data_wait_s"][10:, 2], 0.12) and np.allclose(got["other_s"][10:, 2], 0.08)
    for col in ("forward_s", "backward_s", "optimizer_s"):
        assert np.allclose(got[col], 0.0)
    assert np.allclose(got["busy_s"][:10], 0.0) and np.allclose(np.delete(got["busy_s"], 2, axis=1), 0.0)
    assert inj.main_cause() == "data" and Injection(0, 0.1, cause="data", mix={"data_wait_s": 1, "other_s": 2}
                                                     ).main_cause() == "other"  # fmt: skip
    fwd = Injection(0, 0.1, mix={"forward_s": 0.9, "backward_s": 0.1}).shares()
    assert fwd == pytest.approx({"forward_s": 0.9, "backward_s": 0.1})
    with pytest.raises(ValueError, match="mix"):
        simulate_arrays(SimConfig(ranks=2, steps=5, injections=[Injection(0, 0.1, mix={"gpu_s": 1.0})]))


def test_on_off_straggler_is_slow_only_in_its_duty() -> None:
    inj = Injection(1, 0.3, onset=40, end=300, period=60, duty=20)
    cfg = SimConfig(ranks=4, steps=320, seed=2, **QUIET, injections=[inj])
    busy = excess(cfg)["busy_s"][:, 1]
    steps = np.arange(320)
    on = (steps >= 40) & (steps < 300) & ((steps - 40) % 60 < 20)
    assert np.allclose(busy[on], 0.3) and np.allclose(busy[~on], 0.0)
    assert on.sum() == 5 * 20  # onsets 40, 100, 160, 220, 280
    assert np.array_equal(injected(cfg)[:, 1] > 0, on)


def test_moving_straggler_changes_rank_every_n_steps() -> None:
    inj = Injection(3, 0.25, onset=100, move_every=50, moves=(5, 9))
    cfg = SimConfig(ranks=12, steps=400, seed=3, **QUIET, injections=[inj])
    busy = excess(cfg)["busy_s"]
    slow = np.where(np.isclose(busy, 0.25).any(axis=1), np.argmax(busy, axis=1), -1)
    path = [3, 5, 9, 3, 5, 9]
    assert (slow[:100] == -1).all()
    for k, rank in enumerate(path):
        assert (slow[100 + 50 * k : 150 + 50 * k] == rank).all()
    assert np.allclose(np.sort(busy, axis=1)[:, :-1], 0.0), "one rank slow at a time"
    assert np.array_equal(injected(cfg) > 0, np.isclose(busy, 0.25))
    assert [p.rank for p in inj.expand(400)] == path and all(p.plain() for p in inj.expand(400))
    with pytest.raises(ValueError, match="outside"):
        simulate_arrays(SimConfig(ranks=6, steps=200, injections=[Injection(3, 0.2, moves=(8,), move_every=50)]))


def test_moving_straggler_across_blocks_of_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulate, "BLOCK_RECORDS", 8 * 100)  # 16 ranks x 100 steps: two blocks of 8 ranks
    cfg = SimConfig(ranks=16, steps=100, seed=4, **QUIET, ranks_per_host=4,
                    injections=[Injection(2, 0.4, onset=20, move_every=40, moves=(13,))])  # fmt: skip
    assert len(simulate._rank_blocks(cfg)) == 2
    frame = load_run(write_run(tmp_path / "run", cfg))
    busy = frame.pivot(index="step", columns="rank", values="busy_s").to_numpy()
    extra = busy / np.median(busy, axis=1, keepdims=True) - 1
    assert np.allclose(extra[20:60, 2], 0.4) and np.allclose(extra[60:100, 13], 0.4)
    assert np.allclose(extra[:20], 0.0) and np.allclose(np.delete(extra, [2, 13], axis=1), 0.0)


def test_two_mode_steps() -> None:
    cfg = SimConfig(ranks=64, steps=1000, seed=5, **QUIET, bimodal_prob=0.3, bimodal_mag=0.25)
    ratio = simulate_arrays(cfg)["busy_s"] / (cfg.step_ms / 1000)
    slow = np.isclose(ratio, 1.25)
    assert (slow | np.isclose(ratio, 1.0)).all(), "two modes, nothing between"
    assert slow.mean() == pytest.approx(0.3, abs=0.01)
    assert abs(np.corrcoef(slow[1:].ravel(), slow[:-1].ravel())[0, 1]) < 0.02, "independent steps"
    held = two_mode(np.random.default_rng(0), 20_000, 16, 0.2, 5)
    assert held.mean() == pytest.approx(0.2, abs=0.02)
    starts = (held[1:] & ~held[:-1]).sum()
    assert held[1:].sum() / starts == pytest.approx(5.0, rel=0.1), "slow runs last `hold` steps on average"


def test_host_drift_is_shared_by_a_host_and_changes_nothing_else() -> None:
    cfg = SimConfig(ranks=32, steps=3000, seed=6, ranks_per_host=4, host_drift=0.05, host_drift_steps=20)
    with_, without = simulate_arrays(cfg), simulate_arrays(SimConfig(**{**cfg.__dict__, "host_drift": 0.0}))
    factor = np.log(with_["busy_s"] / without["busy_s"]).reshape(3000, 8, 4)
    assert np.allclose(factor, factor[:, :, :1]), "the same factor for every rank of a host"
    assert factor[:, :, 0].std() == pytest.approx(0.05, rel=0.15)
    lag1 = np.corrcoef(factor[1:, :, 0].ravel(), factor[:-1, :, 0].ravel())[0, 1]
    assert lag1 == pytest.approx(np.exp(-1 / 20), abs=0.03), "mean-reverting over host_drift_steps"
    for col in PHASE_SHARES:
        assert np.allclose(with_[col] / without[col], np.exp(factor.reshape(3000, 32)))


def test_injected_truth_of_plain_injections() -> None:
    cfg = SimConfig(ranks=4, steps=30, injections=[Injection.parse("1:1.2:10::20"), Injection(1, 0.1, 15)])
    truth = injected(cfg)
    assert np.allclose(truth[10:15, 1], 0.2) and np.allclose(truth[15:20, 1], 0.3) and np.allclose(truth[20:, 1], 0.1)
    assert np.allclose(np.delete(truth, 1, axis=1), 0.0) and np.allclose(truth[:10], 0.0)
    assert all(i.plain() for i in cfg.injections)
