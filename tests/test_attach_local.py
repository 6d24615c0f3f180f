"""attach() on a plain module in one process: no torch.distributed needed."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import stragglerwatch
from stragglerwatch.record.schema import PHASE_COLUMNS


class SlowData:
    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay

    def __iter__(self):
        for _ in range(self.n):
            time.sleep(self.delay)
            yield torch.randn(8, 16), torch.randn(8, 4)

    def __len__(self) -> int:
        return self.n


def train(model: nn.Module, opt: torch.optim.Optimizer, batches, evaluate: bool = False) -> None:
    for x, y in batches:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if evaluate:
            with torch.no_grad():
                model(x)


def hook_counts(model: nn.Module, opt: torch.optim.Optimizer) -> tuple[int, ...]:
    from torch.optim import optimizer as optim_mod

    return (
        "forward" in model.__dict__,
        len(model._forward_pre_hooks),
        len(model._forward_hooks),
        len(opt._optimizer_step_pre_hooks),
        len(opt._optimizer_step_post_hooks),
        len(optim_mod._global_optimizer_pre_hooks),
        len(optim_mod._global_optimizer_post_hooks),
    )


@pytest.mark.parametrize("explicit_optimizer", [True, False])
def test_plain_module_records_every_step_and_close_removes_hooks(tmp_path: Path, explicit_optimizer: bool) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hook_counts(model, opt)
    watch = stragglerwatch.attach(model, tmp_path / "run", optimizer=opt if explicit_optimizer else None)
    assert hook_counts(model, opt) != before
    train(model, opt, watch.wrap(SlowData(6, 0.02)), evaluate=True)
    assert watch.steps == 6
    watch.close()
    assert hook_counts(model, opt) == before, "close() must remove every hook"
    train(model, opt, SlowData(2, 0.0))  # training goes on, unrecorded
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["step"].tolist() == list(range(6))
    assert (df["micro_batches"] == 1).all(), "no_grad evaluation forwards are not training forwards"
    assert df["data_wait_s"].min() >= 0.018, "wrapped loader time is the data wait"
    assert (df["forward_s"] > 0).all() and (df["backward_s"] > 0).all() and (df["optimizer_s"] > 0).all()
    assert (df["allreduce_wait_s"] == 0).all() and df["bucket_index"].map(len).eq(0).all()
    assert (df[list(PHASE_COLUMNS)].sum(axis=1) - df["step_s"]).abs().max() < 1e-9
    # each evaluation (after a step's optimizer) lands in the next step, as eval, not busy time
    assert (df["eval_s"].iloc[1:] > 0).all() and df["eval_s"].iloc[0] == 0
    assert (df["busy_s"] - (df["step_s"] - df["eval_s"])).abs().max() < 1e-12
    assert (df["comm_wait_s"] == 0).all() and (df["collective_wait_s"] == 0).all()


def test_gap_before_forward_is_data_wait_without_wrap(tmp_path: Path) -> None:
    model = nn.Linear(16, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stragglerwatch.attach(model, tmp_path / "run", optimizer=opt) as watch:
        train(model, opt, SlowData(4, 0.015))
        assert re.match(r"Watch\(run='run-[0-9a-f]{6}', rank=0, steps=4, open\)", repr(watch)), repr(watch)
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["step"].tolist() == list(range(4))
    # step 0 starts at its first forward (nothing earlier is known); later steps wait ~15 ms
    assert df["data_wait_s"].iloc[1:].min() >= 0.013


def test_rank_0_says_where_the_run_goes_and_how_to_analyse_it(tmp_path: Path, capsys, caplog) -> None:
    """One line at attach (stderr, where the logger does not show INFO; the logger where it does)."""
    model = nn.Linear(4, 2)
    with stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0) as watch:
        pass
    err = [line for line in capsys.readouterr().err.splitlines() if "recording run" in line]
    assert err == [f"stragglerwatch: recording run {watch.info.run_id} (rank 0 of 1) to {tmp_path / 'run'}; "
                   f"analyse it with: stragglerwatch analyze {tmp_path / 'run'}"]
    with caplog.at_level("INFO", logger="stragglerwatch"), stragglerwatch.attach(model, tmp_path / "run2",
                                                                                  watchdog_timeout_s=0):
        pass
    assert not [line for line in capsys.readouterr().err.splitlines() if "recording run" in line]
    assert [r.getMessage() for r in caplog.records if "recording run" in r.getMessage()][0].endswith(
        f"stragglerwatch analyze {tmp_path / 'run2'}")


def test_disabled_is_a_no_op(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = hook_counts(model, opt)
    for watch in (
        stragglerwatch.attach(model, tmp_path / "a", enabled=False),
        (monkeypatch.setenv("STRAGGLERWATCH_DISABLE", "1"), stragglerwatch.attach(model, tmp_path / "b"))[1],
    ):
        assert not watch.enabled and hook_counts(model, opt) == before
        data = [1, 2]
        assert watch.wrap(data) is data
        watch.close()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_default_run_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRAGGLERWATCH_RUN_DIR", str(tmp_path / "from-env"))
    model = nn.Linear(4, 4)
    with stragglerwatch.attach(model) as watch:
        assert watch.run_dir == tmp_path / "from-env"
    assert (tmp_path / "from-env" / "run.json").exists()
    monkeypatch.delenv("STRAGGLERWATCH_RUN_DIR")
    monkeypatch.chdir(tmp_path)
    with stragglerwatch.attach(model) as watch:
        assert watch.run_dir.parent == Path("stragglerwatch-runs")
    assert (tmp_path / watch.run_dir / "rank-00000.json").exists()


class DeepSpeedEngine(nn.Module):
    """Named as DeepSpeed's engine, the module its training loop calls (DeepSpeed itself is not needed)."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def test_deepspeed_is_refused_in_one_line_and_training_goes_on_untouched(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    engine = DeepSpeedEngine(nn.Linear(16, 4))
    twin = DeepSpeedEngine(nn.Linear(16, 4))
    twin.load_state_dict(engine.state_dict())
    opt, twin_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (engine, twin))
    before = hook_counts(engine, opt)
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(3)]
    for given in (engine, torch.compile(engine)):  # refused also inside torch.compile's wrapper
        caplog.clear()
        with caplog.at_level("WARNING", logger="stragglerwatch"):
            watch = stragglerwatch.attach(given, tmp_path / "run", optimizer=opt)
        (line,) = [r.getMessage() for r in caplog.records if r.name == "stragglerwatch"]
        assert line.startswith("stragglerwatch: DeepSpeed (DeepSpeedEngine) is not supported: its ZeRO communication "
                               "is not timed") and "\n" not in line, line  # fmt: skip
        assert "training goes on unwatched" in line and "FSDP2 (fully_shard) or use DDP" in line
        assert not watch.enabled and watch.stats()["problems"] == {"attach": 1}
        assert hook_counts(engine, opt) == before, "nothing registered"
        assert watch.wrap(batches) is batches
        watch.close()
    train(engine, opt, batches)
    train(twin, twin_opt, batches)
    assert all(torch.equal(a, b) for a, b in zip(engine.parameters(), twin.parameters(), strict=True))
    assert not (tmp_path / "run").exists(), "a refused model leaves nothing behind"


def test_fsdp1_is_timed_on_the_cpu_and_unavailable_on_an_accelerator() -> None:
    """On an accelerator FSDP1 waits for its collectives on streams of its own, which no bracket times; its
    units may sit below a plain root (the real FSDP1 on the CPU: tests/test_frameworks_distributed.py)."""
    from stragglerwatch.runtime.capture.coverage import unseen_communication

    class FullyShardedDataParallel(nn.Module):  # the class name is what is checked: no process group needed
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

    model = nn.Sequential(nn.Linear(4, 4), FullyShardedDataParallel())
    assert unseen_communication(model, "cpu") is None
    reason = unseen_communication(model, "cuda")
    assert reason is not None and reason.startswith("FSDP1 (FullyShardedDataParallel) on cuda: its all-gathers")
    assert unseen_communication(nn.Sequential(nn.Linear(4, 4)), "cuda") is None
