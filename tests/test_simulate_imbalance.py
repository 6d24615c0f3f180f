"""The simulator's load-imbalance model (``SimConfig.tokens``): the work it records, its modes, the
true cost of the unequal work computed by hand, the stragglers' truth unchanged by it; and detection
on such runs: no rank flagged for drawing heavy batches, a straggler hidden in them still flagged,
the imbalance's cost within 15% of the true one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from stragglerwatch.analysis.detect import detect
from stragglerwatch.cli import main as cli
from stragglerwatch.record import simulate
from stragglerwatch.record.simulate import (
    PHASE_SHARES,
    Injection,
    SimConfig,
    draw_work,
    imbalance_truth,
    injected,
    simulate_arrays,
    to_frame,
    write_run,
)
from stragglerwatch.record.steplog import load_run

QUIET = {"noise": 0.0, "drift": 0.0, "spike_prob": 0.0}  # no noise: every figure can be worked out by hand
TOKENS = {"tokens": 4096.0, "token_cv": 0.25, "token_seqs": 8}
#: Two ranks, the second's sequences half as long again, every step alike: 800 and 1,200 tokens.
HAND = SimConfig(ranks=2, steps=3, tokens=800, token_seqs=1, token_cv=0.0, token_mode="static", heavy_rank=1,
                 heavy_share=0.5, **QUIET)  # fmt: skip


def test_work_column_is_the_tokens_each_rank_drew(tmp_path: Path) -> None:
    cfg = SimConfig(ranks=32, steps=500, seed=1, **TOKENS)
    work = simulate_arrays(cfg)["work"]
    assert work.shape == (500, 32) and (work >= 8).all() and np.array_equal(work, np.rint(work))
    assert work.mean() == pytest.approx(4096, rel=0.02)
    assert (work.std(axis=1) / work.mean(axis=1)).mean() == pytest.approx(0.25, rel=0.1)
    heaviest = np.bincount(work.argmax(axis=1), minlength=32)
    assert (heaviest > 0).all() and heaviest.max() < 0.1 * 500, "a different rank heaviest each step"
    frame = load_run(write_run(tmp_path / "run", SimConfig(ranks=4, steps=20, seed=1, **TOKENS)))
    assert (frame["work_unit"] == "tokens").all() and (frame["work"] > 0).all()
    assert (to_frame(cfg)["work_unit"] == "tokens").all()


def test_without_the_model_no_work_and_nothing_else_changes(tmp_path: Path) -> None:
    cfg = SimConfig(ranks=8, steps=50, seed=3, injections=[Injection(2, 0.2, 10)])
    arrays = simulate_arrays(cfg)
    assert "work" not in arrays and draw_work(cfg) is None and imbalance_truth(cfg) is None
    other = simulate_arrays(replace(cfg, token_mode="static", heavy_share=0.5, token_cv=0.9))
    assert all(np.array_equal(arrays[c], other[c]) for c in arrays), "the token options do nothing while tokens is 0"
    run = write_run(tmp_path / "run", cfg)
    frame = load_run(run)
    assert frame["work"].isna().all() and (frame["work_unit"] == "").all()
    sim = json.loads((run / "run.json").read_text())["simulation"]
    assert not {"tokens", "token_mode", "heavy_rank", "attn_share", "imbalance_truth"} & set(sim)


def test_token_model_leaves_the_other_draws_alone() -> None:
    cfg = SimConfig(ranks=8, steps=100, seed=4, offset=0.03, stall_every=20, **TOKENS)
    with_, without = simulate_arrays(cfg), simulate_arrays(replace(cfg, tokens=0.0))
    for col in ("data_wait_s", "optimizer_s", "other_s"):
        assert np.array_equal(with_[col], without[col]), col
    load = draw_work(cfg)[1]  # type: ignore[index]
    for col in ("forward_s", "backward_s"):
        assert np.allclose(with_[col], without[col] * load), col


def test_balanced_gives_every_rank_the_same_work_each_step() -> None:
    cfg = SimConfig(ranks=16, steps=200, seed=2, token_mode="balanced", **TOKENS)
    work = simulate_arrays(cfg)["work"]
    assert (work == work[:, :1]).all(), "the same tokens on every rank of a step"
    assert work[:, 0].std() / work[:, 0].mean() == pytest.approx(0.25, rel=0.2), "varying across steps"
    truth = imbalance_truth(cfg)
    assert truth is not None and truth.lost_seconds == pytest.approx(0.0, abs=1e-9) and truth.slowdown == 1.0
    attention = imbalance_truth(replace(cfg, attn_share=0.5))  # the same tokens, not the same attention cost
    assert attention is not None and attention.lost_seconds > 0.1


def test_static_mode_makes_one_shard_heavier() -> None:
    cfg = SimConfig(ranks=16, steps=300, seed=5, token_mode="static", heavy_rank=11, heavy_share=0.2, **TOKENS)
    work = simulate_arrays(cfg)["work"]
    others = np.delete(work, 11, axis=1)
    assert work[:, 11].mean() / others.mean() == pytest.approx(1.2, rel=0.03)
    with pytest.raises(ValueError, match="heavy rank 16 outside"):
        simulate_arrays(replace(cfg, heavy_rank=16))
    with pytest.raises(ValueError, match="token mode"):
        simulate_arrays(replace(cfg, token_mode="packed"))


def test_true_cost_by_hand() -> None:
    # base 100 ms: 15 ms fixed phases, 85 ms forward + backward; 80% of that grows with the tokens.
    # rank 0: 800 tokens, load 0.2 + 0.8 * 1.0 = 1.0, busy 15 + 85 * 1.0 = 100 ms
    # rank 1: 1,200 tokens, load 0.2 + 0.8 * 1.5 = 1.4, busy 15 + 85 * 1.4 = 134 ms; step 134 + 10 = 144 ms
    # balanced: both at the mean load 1.2, busy 15 + 85 * 1.2 = 117 ms; step 127 ms; 17 ms lost a step
    arrays = simulate_arrays(HAND)
    assert np.allclose(arrays["work"], [[800, 1200]] * 3)
    assert np.allclose(arrays["busy_s"], [[0.100, 0.134]] * 3) and np.allclose(arrays["step_s"], 0.144)
    truth = imbalance_truth(HAND)
    assert truth is not None
    assert np.allclose(truth.balanced_step_s, 0.127) and truth.lost_seconds == pytest.approx(3 * 0.017)
    assert truth.slowdown == pytest.approx(0.144 / 0.127)
    # a compute straggler of 20% on the light rank: slower for the same work, its excess grows with it:
    # 20 ms x load 1.0 now (busy 120 ms: rank 1 still sets the step, 144 ms), 20 ms x 1.2 balanced
    # (busy 141 ms, step 151 ms): the imbalance hid the straggler, 7 ms a step *gained*
    compute = imbalance_truth(replace(HAND, injections=[Injection(0, 0.2)]))
    assert compute is not None and compute.lost_seconds == pytest.approx(-3 * 0.007)
    # a data straggler waits 20 ms whatever its batch: 120 ms now, 137 ms balanced (step 147 ms)
    data = imbalance_truth(replace(HAND, injections=[Injection(0, 0.2, cause="data")]))
    assert data is not None and data.lost_seconds == pytest.approx(-3 * 0.003)
    # two peer groups balance their own work: {0, 1} at load 1.2 (117 ms), {2, 3} at 1.0 (100 ms)
    groups = imbalance_truth(replace(HAND, ranks=4, groups=2))
    assert groups is not None and groups.lost_seconds == pytest.approx(3 * 0.017)
    # attention: all of the growing share quadratic in the lengths, rank 1's load 0.2 + 0.8 * 1.5^2 = 2.0
    attention = simulate_arrays(replace(HAND, attn_share=1.0))["busy_s"]
    assert np.allclose(attention, [[0.100, 0.015 + 0.085 * 2.0]] * 3)


def test_straggler_truth_unchanged_by_the_imbalance() -> None:
    injections = [Injection(3, 0.2, 40, "compute"), Injection(5, 0.1, 10, "data", 60)]
    cfg = SimConfig(ranks=8, steps=100, seed=6, injections=injections, **TOKENS, **QUIET)
    plain = replace(cfg, tokens=0.0)
    assert np.array_equal(injected(cfg), injected(plain))
    clean = replace(cfg, injections=[])
    with_, without = simulate_arrays(cfg), simulate_arrays(clean)
    base = cfg.step_ms / 1000
    load = draw_work(cfg)[1]  # type: ignore[index]
    compute = (with_["forward_s"] + with_["backward_s"] - without["forward_s"] - without["backward_s"])[:, 3]
    assert np.allclose(compute[40:], 0.2 * base * load[40:, 3]) and np.allclose(compute[:40], 0.0)
    data = (with_["data_wait_s"] - without["data_wait_s"])[:, 5]
    assert np.allclose(data[10:60], 0.1 * base) and np.allclose(np.delete(data, np.s_[10:60]), 0.0)
    for col in PHASE_SHARES:  # the other ranks untouched
        assert np.allclose(np.delete(with_[col] - without[col], [3, 5], axis=1), 0.0), col


def test_blocks_of_ranks_share_the_work_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simulate, "BLOCK_RECORDS", 8 * 3)  # 16 ranks x 3 steps: two blocks of 8 ranks
    cfg = replace(HAND, ranks=16, heavy_rank=12, ranks_per_host=4)
    assert len(simulate._rank_blocks(cfg)) == 2
    run = write_run(tmp_path / "static", cfg)
    work = load_run(run).pivot(index="step", columns="rank", values="work").to_numpy()
    assert np.allclose(np.delete(work, 12, axis=1), 800) and np.allclose(work[:, 12], 1200)
    # busy 134 ms on rank 12, 100 ms elsewhere; balanced, every rank at load 1 + 0.8 * 0.5 / 16 = 1.025
    truth = json.loads((run / "run.json").read_text())["simulation"]["imbalance_truth"]
    assert truth["lost_seconds"] == pytest.approx(3 * (0.134 - (0.015 + 0.085 * 1.025)))
    balanced = replace(cfg, token_mode="balanced", token_cv=0.3, token_seqs=4, seed=9)
    work = load_run(write_run(tmp_path / "balanced", balanced)).pivot(index="step", columns="rank", values="work")
    assert (work.to_numpy() == work.to_numpy()[:, :1]).all(), "the same tokens in every block"


def test_cli_options_and_the_true_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "sim"
    argv = ["simulate", str(run), "--ranks", "8", "--steps", "40", "--tokens", "2048", "--token-cv", "0.3",
            "--token-mode", "static", "--heavy-rank", "5", "--heavy-share", "0.3", "--attn-share", "0.2"]  # fmt: skip
    assert cli(argv) == 0
    err = capsys.readouterr().err
    sim = json.loads((run / "run.json").read_text())["simulation"]
    assert sim["tokens"] == 2048 and sim["token_mode"] == "static" and sim["heavy_rank"] == 5
    assert f"true imbalance cost: {sim['imbalance_truth']['lost_seconds']:.2f} s" in err
    cfg = SimConfig(ranks=8, steps=40, tokens=2048, token_cv=0.3, token_mode="static", heavy_rank=5,
                    heavy_share=0.3, attn_share=0.2)  # fmt: skip
    assert sim["imbalance_truth"]["lost_seconds"] == pytest.approx(imbalance_truth(cfg).lost_seconds)  # type: ignore[union-attr]
    assert cli(["simulate", str(tmp_path / "x"), "--ranks", "4", "--steps", "10", "--tokens", "100",
                "--token-mode", "static", "--heavy-rank", "4"]) == 2  # fmt: skip
    assert "heavy rank 4 outside" in capsys.readouterr().err
    # an option that would do nothing is refused, not ignored
    assert cli(["simulate", str(tmp_path / "y"), "--ranks", "4", "--steps", "10", "--tokens", "100",
                "--heavy-rank", "2"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip() == ("stragglerwatch simulate: error: --heavy-rank does nothing without "
                                               "--token-mode static")  # fmt: skip
    assert not (tmp_path / "y").exists()


# Detection on simulated runs: the targets of the imbalance rows of benchmarks/accuracy.py.


def run_case(seed: int, straggler: Injection | None = None, **kw: object) -> tuple:
    cfg = SimConfig(ranks=32, steps=300, seed=seed, noise=0.03, spike_prob=0.005,
                    injections=[straggler] if straggler else [], **{**TOKENS, **kw})  # type: ignore[arg-type]  # fmt: skip
    verdict = detect(to_frame(cfg))
    return verdict, imbalance_truth(cfg)


def cost_error(verdict, truth) -> float:  # noqa: ANN001
    return verdict.imbalance.lost_seconds / truth.lost_seconds - 1.0


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_variable_lengths_flag_no_rank(seed: int) -> None:
    verdict, truth = run_case(seed)
    assert verdict.stragglers == []
    assert verdict.imbalance is not None and verdict.imbalance.detected
    assert abs(cost_error(verdict, truth)) <= 0.15


@pytest.mark.parametrize(("seed", "cause"), [(4, "compute"), (5, "data"), (6, "compute")])
def test_straggler_hidden_in_the_imbalance_is_flagged(seed: int, cause: str) -> None:
    inj = Injection(7 + seed, 0.15, 80, cause)
    verdict, truth = run_case(seed, inj)
    assert [(s.rank, s.cause) for s in verdict.stragglers] == [(inj.rank, cause)]
    assert verdict.stragglers[0].detected_step >= inj.onset
    assert verdict.imbalance is not None and verdict.imbalance.detected
    assert abs(cost_error(verdict, truth)) <= 0.15


@pytest.mark.parametrize("seed", [7, 8])
def test_token_balanced_runs_show_no_imbalance(seed: int) -> None:
    verdict, _ = run_case(seed, token_mode="balanced")
    assert verdict.stragglers == [] and verdict.imbalance is not None and not verdict.imbalance.detected


@pytest.mark.parametrize("seed", [9, 10])
def test_static_heavy_shard_is_imbalance_not_a_straggler(seed: int) -> None:
    verdict, truth = run_case(seed, token_mode="static", token_cv=0.05, heavy_rank=seed, heavy_share=0.2)
    assert verdict.stragglers == []
    assert verdict.imbalance is not None and verdict.imbalance.detected
    assert abs(cost_error(verdict, truth)) <= 0.15
