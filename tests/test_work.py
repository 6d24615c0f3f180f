"""The work of each step (``work``, ``work_unit``): counted from what the training forwards receive,
summed over micro-batches, replaced by what the loop notes, never a GPU sync, and readable from old
logs; with the frameworks' forwards (Hugging Face's ``model(**inputs)``, Lightning's steps). And the
elements of the inputs' shapes (``work_elements``, padding included), which the loop's note leaves."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from fake_cuda import install
from torch import nn

import stragglerwatch
from stragglerwatch.analysis import runmatrix
from stragglerwatch.record.schema import STEP_SCHEMA
from stragglerwatch.record.steplog import most_common_unit, run_files, work_unit
from stragglerwatch.runtime.capture.devices import CaptureGate, CudaMarks
from stragglerwatch.runtime.capture.probes import StepProbe
from stragglerwatch.runtime.capture.shadows import time_as_forward
from stragglerwatch.runtime.capture.timing import StepMarks, anatomy, resolve_cuda
from stragglerwatch.runtime.capture.work import DeviceCounts, forward_work


class Tokens(nn.Module):
    """A language model's shape: token ids in, as a tensor, a mapping or keyword arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 8)

    def forward(self, input_ids=None, attention_mask=None, labels=None):  # noqa: ANN001, ANN201
        if isinstance(input_ids, dict):
            input_ids, attention_mask = input_ids["input_ids"], input_ids.get("attention_mask")
        out = self.emb(input_ids)
        if attention_mask is not None and attention_mask.dim() == 2 and not attention_mask.is_meta:  # not a 4-d bias
            out = out * attention_mask.unsqueeze(-1)
        return out.sum()


def probed(model: nn.Module) -> tuple[StepProbe, list[StepMarks]]:
    """A host probe on ``model``'s forward (as attach shadows it); steps ended by ``mark_step``."""
    done: list[StepMarks] = []
    probe = StepProbe(done.append)
    time_as_forward(model, "forward", model, probe)
    return probe, done


def records(done: list[StepMarks]) -> list[tuple[float, str]]:
    return [(r.work, r.work_unit) for r in (anatomy(m, 0, 0.0) for m in done)]


def elements(done: list[StepMarks]) -> list[float]:
    return [anatomy(m, 0, 0.0).work_elements for m in done]


def step(probe: StepProbe, call, micro: int = 1) -> None:  # noqa: ANN001
    for _ in range(micro):
        call().backward()
    probe.mark_step()


def ids_and_mask(ones: int, length: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 100, (2, length))
    mask = torch.zeros(2, length, dtype=torch.long)
    mask.view(-1)[:ones] = 1
    return ids, mask


def test_a_float_tensor_counts_elements_and_token_ids_count_tokens() -> None:
    lin = nn.Linear(8, 2)
    probe, done = probed(lin)
    step(probe, lambda: lin(torch.randn(4, 8)).sum())
    emb = Tokens()
    probe2, done2 = probed(emb)
    step(probe2, lambda: emb(torch.randint(0, 100, (3, 5))))
    assert records(done) == [(32.0, "elements")]
    assert records(done2) == [(15.0, "tokens")]
    assert elements(done) == [32.0] and elements(done2) == [15.0], "a tensor's shape is its work"


def test_a_padded_batch_counts_its_masks_ones_as_work_and_its_shape_as_elements() -> None:
    """Dynamic padding: each batch padded to its longest sequence, so the compute follows the shape."""
    model = Tokens()
    probe, done = probed(model)
    short, long = ids_and_mask(7, length=5), ids_and_mask(13, length=10)
    step(probe, lambda: model({"input_ids": short[0], "attention_mask": short[1]}))
    step(probe, lambda: model(input_ids=long[0], attention_mask=long[1]))  # model(**inputs)
    step(probe, lambda: model(long[0], attention_mask=long[1]))  # ids positional, the mask a keyword
    assert records(done) == [(7.0, "tokens"), (13.0, "tokens"), (13.0, "tokens")]
    assert elements(done) == [10.0, 20.0, 20.0]
    note = probe.note_work_shortfall
    assert forward_work(({"attention_mask": long[1]},), None, None, note) == (13.0, "tokens", 20.0), "the mask's shape"
    embeds = {"inputs_embeds": torch.randn(2, 3, 4), "attention_mask": torch.zeros(2, 1, 3, 3)}  # a 4-d bias
    assert forward_work((embeds,), None, None, note) == (24.0, "elements", 24.0), "the first tensor"


def test_a_mapping_counts_its_attention_masks_ones() -> None:
    model = Tokens()
    probe, done = probed(model)
    ids, mask = ids_and_mask(7)
    step(probe, lambda: model({"input_ids": ids, "attention_mask": mask}))
    step(probe, lambda: model({"input_ids": ids}))  # no mask: the ids' elements
    step(probe, lambda: model({"input_ids": ids, "attention_mask": torch.zeros(2, 1, 10, 10)}))  # a 4-d bias
    assert records(done) == [(7.0, "tokens"), (20.0, "tokens"), (20.0, "tokens")]


def test_keyword_arguments_are_the_mapping(tmp_path: Path) -> None:
    """Hugging Face's Trainer calls ``model(**inputs)``; a mask beside positional ids counts too."""
    model = Tokens()
    probe, done = probed(model)
    ids, mask = ids_and_mask(13)
    step(probe, lambda: model(input_ids=ids, attention_mask=mask, labels=ids))
    step(probe, lambda: model(ids, attention_mask=mask.bool()))
    assert records(done) == [(13.0, "tokens"), (13.0, "tokens")]


def test_micro_batches_are_summed_and_evaluation_forwards_are_not_work() -> None:
    model = Tokens()
    probe, done = probed(model)
    masks = [ids_and_mask(n) for n in (3, 9, 15)]
    it = iter(masks)

    def micro():  # noqa: ANN202
        ids, mask = next(it)
        return model(input_ids=ids, attention_mask=mask)

    step(probe, micro, micro=3)
    model(input_ids=masks[0][0], attention_mask=masks[0][1]).backward()
    with torch.no_grad():  # an evaluation pass inside the step, in training mode but without grad
        model(input_ids=torch.randint(0, 100, (8, 10)))
    model.eval()
    model(input_ids=torch.randint(0, 100, (8, 10)))
    model.train()
    probe.mark_step()
    assert records(done) == [(27.0, "tokens"), (3.0, "tokens")]
    assert [len(m.fwd_start) for m in done] == [3, 1]


def test_a_forward_that_raised_leaves_no_work_behind() -> None:
    lin = nn.Linear(8, 2)
    probe, done = probed(lin)
    with pytest.raises(RuntimeError):
        lin(torch.randn(4, 7))  # wrong shape: the forward raises after its start was marked
    step(probe, lambda: lin(torch.randn(2, 8)).sum())
    assert records(done) == [(16.0, "elements")]


def test_counting_what_cannot_be_counted_falls_back_to_elements_and_says_so_once() -> None:
    notes: list[tuple[str, str]] = []

    def note(key: str, reason: str) -> None:
        notes.append((key, reason))

    mask = torch.ones(2, 6, device="meta")  # neither the CPU nor CUDA: counting it would wait for a device
    ids = torch.ones(2, 6)
    assert forward_work((), {"input_ids": ids, "attention_mask": mask}, None, note) == (12.0, "tokens", 12.0)
    assert notes and "padding included" in notes[0][1]
    assert forward_work(None, None, None, note) is None, "no input at all (a probe driven by hand)"
    assert forward_work(("text", 3), {"flag": True}, None, note) is None
    assert forward_work(([torch.ones(3), torch.ones(5)], 0), None, None, note) == (3.0, "elements", 3.0), "Lightning's"
    model = Tokens()
    probe, done = probed(model)
    for _ in range(2):  # the mask is not used by the model: only counted (and not countable)
        step(probe, lambda: model(torch.randint(0, 100, (2, 6)), attention_mask=mask))
    assert records(done) == [(12.0, "tokens")] * 2
    assert probe.faults == 0 and list(probe.work_notes) == ["mask"] and probe.problems.counts == {"work-mask": 1}


def test_the_device_ring_reads_its_counts_and_nan_for_a_reused_slot() -> None:
    ring = DeviceCounts(slots=2, pinned=False)
    a = ring.count(torch.tensor([1, 0, 1, 1]))
    assert a.read() == 3.0
    b = ring.count(torch.zeros(3))
    ring.count(torch.ones(5))  # takes a's slot again
    assert math.isnan(a.read()) and b.read() == 0.0


def test_the_device_ring_never_counts_inside_a_graph_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = install(monkeypatch)
    gate = CaptureGate().install()
    try:
        ring = DeviceCounts(gate, slots=4, pinned=False)
        graph = torch.cuda.graphs.CUDAGraph()
        graph.capture_begin()
        with pytest.raises(RuntimeError, match="capture"):
            ring.count(torch.ones(3))
        graph.capture_end()
        assert ring.count(torch.ones(3)).read() == 3.0
        assert not gpu.invalidated
    finally:
        gate.remove()


def test_a_pending_device_count_is_read_once_the_steps_events_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path: the count travels with the step's events and is read when they have completed."""
    gpu = install(monkeypatch)
    marks = CudaMarks(CaptureGate())
    ring = DeviceCounts(slots=8, pinned=False)
    m = StepMarks(0, marks.mark(), 0.0)
    m.fwd_start.append(marks.mark())
    m.work.append((ring.count(torch.tensor([[1, 1, 0], [1, 0, 0]])), "tokens", 6.0))
    gpu.default.spin(40)  # the forward's kernels
    m.fwd_end.append(marks.mark())
    m.end = marks.mark()
    assert resolve_cuda(m) is None, "pending while the GPU has not reached the step's end"
    r = resolve_cuda(m, deadline=time.monotonic() + 2.0)
    assert r is not None and r.work == [(3.0, "tokens", 6.0)]
    rec = anatomy(r, 0, 0.0, "cuda")
    assert (rec.work, rec.work_unit, rec.work_elements) == (3.0, "tokens", 6.0)


def test_a_lost_count_or_mixed_units_make_the_step_unmeasured() -> None:
    m = StepMarks(0, 0.0, 0.0)
    m.end = 1.0
    m.work = [(4.0, "tokens", 8.0), (float("nan"), "tokens", 8.0)]
    assert math.isnan(anatomy(m, 0, 0.0).work) and anatomy(m, 0, 0.0).work_unit == ""
    assert anatomy(m, 0, 0.0).work_elements == 16.0, "the shapes are host metadata: never lost"
    m.work = [(4.0, "tokens", 4.0), (2.0, "elements", 2.0)]
    assert math.isnan(anatomy(m, 0, 0.0).work)
    m.work = [(float("nan"), "", float("nan"))] * 2
    assert math.isnan(anatomy(m, 0, 0.0).work_elements), "no forward's input counted"
    m.work = []
    rec = anatomy(m, 0, 0.0)
    assert math.isnan(rec.work) and math.isnan(rec.work_elements), "no training forward: not measured"


def train_tokens(model: nn.Module, opt: torch.optim.Optimizer, watch, lengths: list[int], noted=None) -> None:  # noqa: ANN001
    for i, n in enumerate(lengths):
        ids, mask = ids_and_mask(n)
        if noted is not None:
            for value in noted(i):
                if isinstance(value, tuple):
                    watch.note_work(*value)
                else:
                    watch.note_work(value)
        model(input_ids=ids, attention_mask=mask).backward()
        opt.step()
        opt.zero_grad()


def test_note_work_replaces_the_count_and_bad_values_are_ignored(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    model = Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    bad = [torch.tensor(3.0), -1, float("nan"), "12", True, None, (5, ""), (5, 7)]

    def noted(i: int) -> list:
        if i == 0:
            return [100]  # before the first step began: counts toward it
        if i == 1:
            return [(2, "samples"), (3, "samples")]
        if i == 2:
            return bad
        return []

    watch = stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0, context_interval_s=0,
                                  control_interval_s=0)  # fmt: skip
    with caplog.at_level("WARNING", logger="stragglerwatch"), watch:
        train_tokens(model, opt, watch, [4, 5, 6, 7], noted)
        assert watch.stats()["problems"]["note-work"] == len(bad)
    assert any("watch.note_work(Tensor, str) ignored" in r.getMessage() for r in caplog.records)
    watch.note_work(5)  # closed: nothing, no error
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["work"].tolist() == [100.0, 5.0, 6.0, 7.0]
    assert df["work_unit"].tolist() == ["tokens", "samples", "tokens", "tokens"]
    assert df["work_elements"].tolist() == [20.0] * 4, "the shapes' count, whatever the loop noted"
    assert work_unit(tmp_path / "run") == "tokens" == _units_read_with_the_values(tmp_path / "run")


def _units_read_with_the_values(run: Path) -> str | None:
    """The unit the analysis counts as it reads the values (``runmatrix.fill``), in one read of each file."""
    _, _, files = run_files(run)
    plan = runmatrix.plan([runmatrix.scan_file(f) for f in files])
    units: dict[str, int] = {}
    runmatrix.fill(files, plan, plan.ranks, units=units)
    return most_common_unit(units)


def test_the_run_dir_carries_work_and_a_1_3_log_reads_unmeasured(tmp_path: Path) -> None:
    model = Tokens()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    with stragglerwatch.attach(model, run, watchdog_timeout_s=0, context_interval_s=0, control_interval_s=0) as watch:
        train_tokens(model, opt, watch, [3, 8, 11])
    (log,) = run.glob("rank-*.parquet")
    table = pq.read_table(log)
    assert table.column("work").to_pylist() == [3.0, 8.0, 11.0]
    assert table.column("work_elements").to_pylist() == [20.0] * 3
    old = table.drop_columns(["work", "work_unit", "work_elements"])
    old = old.replace_schema_metadata({b"stragglerwatch.schema_version": b"1.3"})
    log.unlink()
    pq.write_table(old, run / "rank-00000.parquet")
    sink = pa.OSFile(str(run / "rank-00001.arrows"), "wb")  # a second rank's 1.3 stream
    with sink, pa.ipc.new_stream(sink, old.schema) as writer:
        writer.write_table(old.set_column(0, "rank", pa.array([1, 1, 1], pa.int32())))
    df = stragglerwatch.load_run(run)
    assert len(df) == 6 and df["work"].isna().all() and (df["work_unit"] == "").all()
    assert df["work_elements"].isna().all()
    assert list(df.columns)[-4:] == ["work", "work_unit", "work_elements", "world_size"]
    assert work_unit(run) is None and work_unit(tmp_path / "missing") is None
    assert _units_read_with_the_values(run) is None
    assert STEP_SCHEMA.metadata[b"stragglerwatch.schema_version"] == b"1.4"


def test_hugging_face_trainer_steps_carry_their_tokens(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from stragglerwatch.integrations.transformers import StragglerWatchCallback

    class Texts(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            mask = torch.zeros(10, dtype=torch.long)
            mask[: 2 + i % 8] = 1
            return {"input_ids": torch.randint(0, 100, (10,)), "attention_mask": mask, "labels": torch.zeros(1)}

    class Model(Tokens):
        def forward(self, input_ids=None, attention_mask=None, labels=None):  # noqa: ANN001, ANN201
            return {"loss": super().forward(input_ids, attention_mask)}

    callback = StragglerWatchCallback(tmp_path / "run", watchdog_timeout_s=0, context_interval_s=0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=4, learning_rate=0.01,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )  # fmt: skip
    data = Texts()
    trainer = transformers.Trainer(model=Model(), args=args, train_dataset=data, callbacks=[callback])
    trainer.train()
    df = stragglerwatch.load_run(tmp_path / "run")
    assert len(df) == 4 and (df["work_unit"] == "tokens").all()
    ones = sum(2 + i % 8 for i in range(len(data)))  # each sample once: the 4 steps are one epoch
    assert df["work"].sum() == ones, "the masks' ones of every sample, padding not counted"
    assert df["work_elements"].tolist() == [40.0] * 4, "4 samples of 10 token ids a step, padding counted"


def test_lightning_training_steps_carry_their_batchs_elements(tmp_path: Path) -> None:
    pl = pytest.importorskip("lightning.pytorch")
    from stragglerwatch.integrations.lightning import StragglerWatch

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 2)

        def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # noqa: ANN201
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.TensorDataset(torch.randn(24, 8), torch.randn(24, 2))
    loader = torch.utils.data.DataLoader(data, batch_size=6)
    callback = StragglerWatch(tmp_path / "run", watchdog_timeout_s=0, context_interval_s=0)
    trainer = pl.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])  # fmt: skip
    trainer.fit(Module(), loader)
    df = stragglerwatch.load_run(tmp_path / "run")
    assert len(df) == 4 and df["work"].tolist() == [48.0] * 4 and (df["work_unit"] == "elements").all()
    assert df["work_elements"].tolist() == [48.0] * 4


def test_ddp_counts_each_forward_once(one_rank_group, tmp_path: Path) -> None:
    """DDP's forward and its module's are both shadowed; the nested one is not counted again."""
    model = nn.parallel.DistributedDataParallel(Tokens())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with stragglerwatch.attach(model, tmp_path / "run", watchdog_timeout_s=0, context_interval_s=0,
                               control_interval_s=0) as watch:  # fmt: skip
        train_tokens(model, opt, watch, [4, 9, 17])
    df = stragglerwatch.load_run(tmp_path / "run")
    assert df["work"].tolist() == [4.0, 9.0, 17.0] and (df["work_unit"] == "tokens").all()
    assert df["work_elements"].tolist() == [20.0] * 3
