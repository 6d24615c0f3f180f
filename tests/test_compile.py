"""torch.compile: a compiled DDP model attached after compile is timed outside compiled code, adds
no graph break, and sees DDP's buffer broadcast; a model compiled after attach, and compiled
autograd, take the "busy time unavailable" path instead of giving wrong numbers.

One rank in-process (gloo), the ``eager`` backend: graph breaks are Dynamo's, whatever the backend."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import stragglerwatch
from stragglerwatch.record.schema import PHASE_COLUMNS

dynamo = pytest.importorskip("torch._dynamo")


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def train(model: nn.Module, params, steps: int = 6) -> int:
    """Train ``steps`` steps; the graph breaks Dynamo counted on the way."""
    dynamo.reset()
    dynamo.utils.counters.clear()
    opt = torch.optim.SGD(params, lr=0.01)
    for _ in range(steps):
        model(torch.randn(8, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return sum(dynamo.utils.counters["graph_break"].values())


def test_attached_after_compile(one_rank_group: None, tmp_path: Path) -> None:
    plain_ddp = DDP(bn_model())
    plain_breaks = train(torch.compile(plain_ddp, backend="eager"), plain_ddp.parameters())
    ddp = DDP(bn_model())
    compiled = torch.compile(ddp, backend="eager")
    watch = stragglerwatch.attach(compiled, tmp_path / "run", watchdog_timeout_s=0)
    breaks = train(compiled, ddp.parameters())
    assert watch.stats()["busy_unavailable"] == []
    watch.close()
    assert plain_breaks > 0, "the counter is read: Dynamo counts DDP's own graph breaks"
    assert breaks == plain_breaks, "attach adds no graph break"
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["step"].tolist() == list(range(6))
    assert (df[list(PHASE_COLUMNS)].sum(axis=1) - df["step_s"]).abs().max() < 1e-9
    assert (df["forward_s"] > 0).all() and (df["backward_s"] > 0).all()
    assert (df["allreduce_wait_s"] > 0).all(), "DDP's gradient all-reduce is still seen"
    assert (df["collective_wait_s"] > 0).all(), "the buffer broadcast runs eagerly and is seen"


def test_module_compile_in_place(one_rank_group: None, tmp_path: Path) -> None:
    ddp = DDP(bn_model())
    ddp.compile(backend="eager")
    with stragglerwatch.attach(ddp, tmp_path / "run", watchdog_timeout_s=0) as watch:
        train(ddp, ddp.parameters(), steps=4)
        assert watch.stats()["busy_unavailable"] == []
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["step"].tolist() == list(range(4)) and (df["forward_s"] > 0).all() and (df["allreduce_wait_s"] > 0).all()


def test_compiled_after_attach_is_unavailable(one_rank_group: None, tmp_path: Path) -> None:
    ddp = DDP(bn_model())
    with stragglerwatch.attach(ddp, tmp_path / "run", watchdog_timeout_s=0) as watch:
        breaks = train(torch.compile(ddp, backend="eager"), ddp.parameters())
        (reason,) = watch.stats()["busy_unavailable"]
    assert "attach after torch.compile" in reason
    plain_ddp = DDP(bn_model())
    assert breaks == train(torch.compile(plain_ddp, backend="eager"), plain_ddp.parameters()), "no graph break"


def test_compiled_autograd_is_unavailable(tmp_path: Path) -> None:
    model = bn_model()
    with stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0) as watch:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        with dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
            for _ in range(3):
                model(torch.randn(8, 8)).pow(2).mean().backward()
                opt.step()
        reasons = watch.stats()["busy_unavailable"]
    assert any("compiled autograd" in r for r in reasons), reasons
