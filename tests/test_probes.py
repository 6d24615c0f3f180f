"""The probes in one process: output walking, the taps, step boundaries, and what cannot be seen.

A one-rank gloo process group is real DDP (buffer broadcast, Work.wait) without a second process."""

from __future__ import annotations

import collections
import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils import _pytree

import stragglerwatch
from stragglerwatch.cli.commands import main as cli
from stragglerwatch.record.schema import PHASE_COLUMNS
from stragglerwatch.runtime.capture.probes import _grad_tensors
from stragglerwatch.runtime.capture.taps import (
    ISSUE_METHODS,
    process_group_class,
    scaler_class,
    tap_collectives,
    tap_scaler,
    work_class,
)


def partitions(df) -> bool:
    return bool((df[list(PHASE_COLUMNS)].sum(axis=1) - df["step_s"]).abs().max() < 1e-9)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    extras: dict


class Pair:
    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a, b


_pytree.register_pytree_node(Pair, lambda p: ([p.a, p.b], None), lambda xs, _: Pair(*xs))


def test_grad_tensors_found_through_nested_containers_and_dataclasses() -> None:
    x = torch.ones(2, requires_grad=True)
    a, b, c, d = (x * k for k in range(1, 5))
    nt = collections.namedtuple("NT", "loss aux")(a, 3)
    found = _grad_tensors(Out(logits=b, extras={"nested": [nt, (c, "text", None)], "pair": Pair(d, torch.ones(1))}))
    assert {id(t) for t in found} == {id(a), id(b), id(c), id(d)}
    assert _grad_tensors({"a": a, "again": [a]}) == [a], "each tensor once"
    assert _grad_tensors((torch.ones(1), 1.0, "s")) == [], "nothing needs a gradient"
    assert len(_grad_tensors([x * 1 for _ in range(100)], most=8)) == 8


def test_taps_are_installed_once_and_restored() -> None:
    work, scaler, group = work_class(), scaler_class(), process_group_class()
    original_wait, original_step = work.__dict__["wait"], scaler.__dict__["step"]
    issue = [n for n in ISSUE_METHODS if n in group.__dict__]
    assert {"allreduce", "broadcast", "barrier", "send", "recv"} <= set(issue)
    original_issue = {n: group.__dict__[n] for n in issue}

    class Broken:
        def comm_begin(self):
            raise RuntimeError("a bug of ours")

        def comm_end(self, token):
            raise RuntimeError("a bug of ours")

        def issue_begin(self):
            raise RuntimeError("a bug of ours")

    from torch.distributed import _functional_collectives as funcol

    original_functional = funcol.wait_tensor
    first, second = tap_collectives(Broken()), tap_collectives(Broken())
    assert work.__dict__["wait"] is not original_wait and work.__dict__["wait"].__wrapped__ is original_wait
    assert all(group.__dict__[n].__wrapped__ is original_issue[n] for n in issue), "bracketed where issued too"
    assert funcol.wait_tensor.__wrapped__ is original_functional, "DTensor's waits are bracketed"
    t = torch.ones(2)
    assert funcol.wait_tensor(t) is not None, "a listener that raises never reaches the caller"
    first.remove()
    assert work.__dict__["wait"] is not original_wait, "still one listener"
    second.remove()
    second.remove()  # idempotent
    assert work.__dict__["wait"] is original_wait
    assert all(group.__dict__[n] is original_issue[n] for n in issue)
    assert funcol.wait_tensor is original_functional
    tap = tap_scaler(Broken())
    tap.remove()
    assert scaler.__dict__["step"] is original_step


def test_one_rank_ddp_collectives_eval_optimizers_and_scaler_skip(one_rank_group, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)))
    params = list(model.parameters())
    opts = [torch.optim.SGD(params[:2], lr=0.01), torch.optim.Adam(params[2:], lr=1e-3)]
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    work_wait = work_class().__dict__["wait"]
    watch = stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0)
    for step in range(8):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        scaler.scale(loss * (float("inf") if step == 4 else 1.0)).backward()
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad()
        logged = loss.detach().clone()
        dist.all_reduce(logged)  # the loop's own collectives
        dist.barrier()
        if step == 5:
            model.eval()
            with torch.no_grad():
                for _ in range(3):
                    model.module(torch.randn(8, 16))  # bypassing DDP, as one-rank evaluation does
            model.train()
    watch.close()
    assert work_class().__dict__["wait"] is work_wait, "close() removes the tap"
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["step"].tolist() == list(range(8)) and partitions(df) and (df["micro_batches"] == 1).all()
    assert (df["collective_wait_s"] > 0).all(), "buffer broadcast, loss all-reduce, barrier"
    assert df.loc[df["step"] == 4, "optimizer_s"].item() < df.loc[df["step"] != 4, "optimizer_s"].min()
    assert df.loc[df["step"] == 6, "eval_s"].item() > 0 and (df.loc[df["step"] != 6, "eval_s"] == 0).all()
    meta = json.loads((tmp_path / "run" / "rank-00000.json").read_text())
    assert "busy_unavailable" not in meta


def test_optimizer_given_ends_the_step_and_a_pending_step_is_kept_at_close(tmp_path: Path) -> None:
    model = nn.Linear(8, 2)
    first, second = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1)
    second.register_step_pre_hook(lambda *_: time.sleep(0.01))
    with stragglerwatch.attach(model, tmp_path / "given", optimizer=first, watchdog_timeout_s=0):
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            first.step()
            second.step()  # after the step's end: the next step's optimizer time, not its data wait
    df = stragglerwatch.load_run(tmp_path / "given")
    assert df["step"].tolist() == [0, 1, 2]
    assert (df["optimizer_s"].iloc[1:] >= 0.01).all() and (df["data_wait_s"] < 0.005).all()
    with stragglerwatch.attach(model, tmp_path / "one", watchdog_timeout_s=0):  # the end is learned: one step only
        model(torch.randn(4, 8)).sum().backward()
        first.step()
    assert stragglerwatch.load_run(tmp_path / "one")["step"].tolist() == [0]


def analyze_json(run: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert cli(["analyze", str(run), "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)


def said(caplog: pytest.LogCaptureFixture, text: str) -> int:
    """How many lines of the stragglerwatch logger contain ``text``."""
    return sum(text in r.getMessage() for r in caplog.records if r.name == "stragglerwatch")


def test_unseen_communication_in_a_multi_rank_job(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A plain module in a job of two ranks (rank 1 simulated by its absence): no collective is ever seen."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = caplog.at_level("WARNING", logger="stragglerwatch")
    with logged, stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0):
        for _ in range(12):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert said(caplog, "no collective was seen in 10 steps") == 1, "said once"
    r = analyze_json(tmp_path / "run", capsys)
    assert r["stragglers"] == [] and r["job_slowdown"] is None
    (unavailable,) = r["busy_unavailable"]
    assert unavailable["ranks"] == [0] and "not DistributedDataParallel" in unavailable["reason"]
    assert cli(["analyze", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    assert "busy time unavailable: a multi-rank job" in text and "no consistently slow rank" not in text


def test_ddp_output_without_gradient_is_busy_unavailable(
    one_rank_group, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Detached(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 2)
            self.loss: torch.Tensor | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.lin(x)
            self.loss = out.pow(2).mean()  # the loss leaves through an attribute
            return out.detach()

    model = DDP(Detached())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = caplog.at_level("WARNING", logger="stragglerwatch")
    with logged, stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0):
        for _ in range(3):
            model(torch.randn(4, 8))
            model.module.loss.backward()
            opt.step()
    assert said(caplog, "no tensor of the model's output needs a gradient") == 1
    meta = json.loads((tmp_path / "run" / "rank-00000.json").read_text())
    assert any("no tensor of the model's output needs a gradient" in r for r in meta["busy_unavailable"])


def test_comm_hook_conflict_is_one_clear_error(one_rank_group, tmp_path: Path) -> None:
    """A comm hook already registered (by the user, or by Accelerate's DistributedDataParallelKwargs)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    model = DDP(nn.Linear(8, 2))
    model.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
    with pytest.raises(stragglerwatch.AttachError) as err:
        stragglerwatch.attach(model, tmp_path / "refused", bucket_timings=True, watchdog_timeout_s=0)
    message = str(err.value)
    assert "\n" not in message and "Accelerate" in message and "Leave bucket_timings off" in message
    assert not (tmp_path / "refused").exists(), "a refused attach leaves nothing behind"
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0):  # the user's hook is left alone
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
    assert stragglerwatch.load_run(tmp_path / "run")["step"].tolist() == [0, 1, 2]


def test_an_issue_is_a_bracket_only_when_it_returns_no_work() -> None:
    """gloo (a ``Work``): the issue's bracket is dropped, the wait's kept; NCCL >= 2.8 (None): kept."""
    from stragglerwatch.runtime.capture.probes import StepProbe
    from stragglerwatch.runtime.capture.taps import _issue_wrapper, _wait_wrapper

    marks: list[tuple[float, float]] = []
    probe = StepProbe(marks.append)
    probe.on_forward_pre(nn.Linear(1, 1), (torch.ones(1, 1),), {})  # a step is open
    cur = probe._cur

    def issued(*args):
        return object()  # a Work

    def finished(*args):
        return None

    _issue_wrapper(issued, [probe])(None)
    assert cur.comm == [], "its wait will be bracketed where it happens"
    _wait_wrapper(lambda: None, [probe])()
    _issue_wrapper(finished, [probe])(None)
    assert len(cur.comm) == 2 and all(b >= a for a, b in cur.comm)
    assert probe.where[1] == "forward", "the phase the thread was in is restored"


def test_a_process_group_wrapped_after_attach_brings_the_call_brackets(one_rank_group, tmp_path: Path) -> None:
    """Another tool wraps ``ProcessGroup.allreduce`` after attach and waits through the untapped
    ``Work.wait`` itself: from the next step end on, ``torch.distributed``'s functions are bracketed."""
    group = dist.ProcessGroup
    raw_wait = dist.Work.__dict__["wait"]
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0, optimizer=opt)
    ours = group.__dict__["allreduce"]

    def theirs(self, *args, **kwargs):  # finishes the collective itself, as NCCL's C++ does, and returns None
        work = ours(self, *args, **kwargs)
        raw_wait(work)
        return None

    group.allreduce = theirs
    try:
        assert not hasattr(dist.all_reduce, "__stragglerwatch_listeners__")
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            dist.all_reduce(torch.ones(4))
            opt.step()
            opt.zero_grad()
        assert hasattr(dist.all_reduce, "__stragglerwatch_listeners__"), "bracketed where the loop calls it"
        assert watch.stats()["problems"].get("coverage") == 1, "said once"
    finally:
        group.allreduce = ours
        watch.close()
    assert not hasattr(dist.all_reduce, "__stragglerwatch_listeners__"), "removed at close"
    df = stragglerwatch.load_run(tmp_path / "run")
    assert (df[df["step"] >= 1]["collective_wait_s"] > 0).all(), "the collective is counted again"


def test_a_comm_hooks_own_work_is_communication_not_backward(one_rank_group, tmp_path: Path) -> None:
    """A DDP comm hook given to attach (``comm_hook=``) that works before its all-reduce (a compression, here
    30 ms of it): from the bucket ready to the collective issued, the stream runs the hook, and that time is
    the all-reduce's wait, not backward compute (on a GPU the hook's kernels run on the compute stream)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def compressing(seconds: float, bucket):  # type: ignore[no-untyped-def]
        time.sleep(seconds)
        return default_hooks.allreduce_hook(None, bucket)

    model = DDP(nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stragglerwatch.attach(model, tmp_path / "run", comm_hook=(0.03, compressing), watchdog_timeout_s=0):
        for _ in range(5):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    df = stragglerwatch.load_run(tmp_path / "run")
    assert len(df) == 5
    assert (df["allreduce_wait_s"] >= 0.025).all(), df["allreduce_wait_s"].tolist()
    assert (df["backward_s"] < 0.02).all(), df["backward_s"].tolist()
