"""PyTorch Lightning: ``trainer = Trainer(..., callbacks=[StragglerWatch()])``.

Design: the callback attaches in ``on_train_start``, when the strategy has wrapped the model
(``trainer.strategy.model``: DDP around the LightningModule, or the module itself with FSDP2
applied in ``configure_model``, whose ``training_step``/``validation_step`` the strategy then
calls directly: those are timed as the forward passes). Lightning runs forward and backward inside
``optimizer.step(closure)``; the probes time them as forward and backward inside the optimizer
interval, so only the rest of the step is optimizer time. Accumulation
(``accumulate_grad_batches``) runs its first micro-batches under ``no_sync`` outside the
optimizer and the last inside it: one step of several micro-batches. Validation runs in eval
mode without grad: evaluation time, not work. Batch fetches are timed exactly through the
training epoch loop's fetch callbacks (Lightning's own profiler points), when this Lightning
version has them; else data wait is the gap before the first forward. Manual optimization runs
backward and the optimizer inside ``training_step``, which is inside the model's forward: the
signal is reported unavailable there rather than wrong.

With ``log_to_trainer=True`` the rank's busy share (busy over step time) is logged with ``pl_module.log`` every
``log_every_n_steps``, and at the end of fit rank 0 logs the job's verdict (stragglers, the worst
one's rank and time lost) to every logger of the Trainer, read from the run dir on a thread of its
own once every rank's log is complete (no barrier: the job does not wait for it;
``callback.verdict.join(timeout_s)`` does, and so does the interpreter's exit, at most 30 s).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stragglerwatch.integrations._common import LateVerdict
from stragglerwatch.runtime.config import Config
from stragglerwatch.runtime.watch import Watch, attach

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the standalone package
    try:
        from pytorch_lightning.callbacks import Callback  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError(
            "stragglerwatch.integrations.lightning needs Lightning: pip install 'stragglerwatch[lightning]'"
        ) from exc

MANUAL = ("Lightning manual optimization: backward and the optimizer run inside training_step, inside the "
          "model's forward, so the step's phases cannot be told apart")  # fmt: skip


class StragglerWatch(Callback):
    """Record every rank's step anatomy with stragglerwatch during ``trainer.fit``.

    ``run_dir`` and ``attach_options`` are those of :func:`stragglerwatch.attach` (e.g.
    ``prometheus_port=19400``, ``watchdog_timeout_s=120``). ``log_to_trainer`` also logs the
    rank's busy share and, at the end, the verdict to the Trainer's loggers."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        log_to_trainer: bool = False,
        **attach_options: Any,
    ) -> None:
        super().__init__()
        Config.resolve(environ={}, run_dir=run_dir, **attach_options)  # a mistake fails here, not at train start
        self.run_dir = run_dir
        self.log_to_trainer = log_to_trainer
        self.attach_options = attach_options
        self.watch: Watch | None = None
        self.verdict: LateVerdict | None = None  # rank 0's end-of-fit verdict, computed on a thread of its own

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.watch is not None and self.watch.enabled:
            return
        model = getattr(trainer.strategy, "model", None) or pl_module
        self.watch = attach(model, self.run_dir, **self.attach_options)
        epoch_loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
        if all(callable(getattr(epoch_loop, n, None)) for n in ("_on_before_fetch", "_on_after_fetch")):
            self.watch.time_data(epoch_loop, "_on_before_fetch", "_on_after_fetch")
        if model is pl_module:  # no wrapper (one device, FSDP2 through ModelParallelStrategy): the
            # strategy calls the steps themselves, not the module's forward
            for step in ("training_step", "validation_step"):
                self.watch.time_forward(pl_module, step, pl_module)
        if not getattr(pl_module, "automatic_optimization", True):
            self.watch.note_unavailable("manual_optimization", MANUAL)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.log_to_trainer or self.watch is None:
            return
        every = max(1, int(getattr(trainer, "log_every_n_steps", 50) or 1))
        latest = self.watch.latest()
        if latest is not None and trainer.global_step % every == 0:
            pl_module.log("stragglerwatch/busy_share", latest["busy_share"], on_step=True, on_epoch=False)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        watch, self.watch = self.watch, None
        if watch is None:
            return
        run_dir = watch.run_dir
        watch.close()
        if not self.log_to_trainer:
            return
        if trainer.global_rank != 0:
            return
        loggers, step = list(trainer.loggers), trainer.global_step

        def log(metrics: dict[str, float]) -> None:
            for logger in loggers:
                logger.log_metrics(metrics, step=step)
                logger.save()  # after fit: the trainer may have saved its last time already

        world = watch.info.world_size if watch.info else 1
        self.verdict = LateVerdict(Path(run_dir) if run_dir else None, world, watch.problems, log).start()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
