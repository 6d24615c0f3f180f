"""The framework integrations in one process: what they add to a trainer's logs must leave the
trainer's own flow as it was (its logging steps are where it gathers the loss across ranks)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")


class _Points(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g), "labels": torch.randn(2, generator=g)}


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        time.sleep(0.01)  # steps long enough for the step log to be written between logging steps
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out, labels), "logits": out}


def test_hf_callback_keeps_the_trainers_own_logs(tmp_path: Path) -> None:
    from stragglerwatch.integrations.transformers import StragglerWatchCallback

    callback = StragglerWatchCallback(tmp_path / "run", log_to_trainer=True, flush_interval_s=0.05,
                                      watchdog_timeout_s=0)  # fmt: skip
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, max_steps=24, logging_steps=4,
        learning_rate=0.01, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = transformers.Trainer(model=_Model(), args=args, train_dataset=_Points(), callbacks=[callback])
    trainer.train()
    assert callback.verdict is not None and callback.verdict.join(60)
    history = trainer.state.log_history
    logged = [h for h in history if "loss" in h]
    assert [h["step"] for h in logged] == [4, 8, 12, 16, 20, 24], "every logging step's own loss log"
    ours = [h for h in logged if "stragglerwatch/busy_share" in h]
    assert len(ours) >= 4 and all(0 < h["stragglerwatch/busy_share"] <= 1.0 for h in ours), history
    assert not any("stragglerwatch/busy_share" in h and "loss" not in h for h in history), "no log of our own"
    assert trainer.callback_handler.callbacks[0] is callback, "ahead of the reporting integrations"
