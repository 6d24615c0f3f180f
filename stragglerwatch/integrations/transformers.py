"""Hugging Face Trainer: ``Trainer(..., callbacks=[StragglerWatchCallback()])``.

Design: the callback attaches in ``on_train_begin``, when the Trainer has prepared the model
with Accelerate. Callbacks are not given the Trainer, so the callback finds it as the caller of
the event (once), and attaches to ``trainer.model_wrapped``: the DDP model around
``trainer.model``, whose forward, buffer broadcast and gradient all-reduce are then timed as in
a plain loop. The Trainer steps an ``AcceleratedOptimizer`` whose ``step`` steps the real
optimizer (one step, counted once); with gradient accumulation the micro-batches before the
last run under ``no_sync`` and make one step; a mixed-precision step that the gradient scaler
skips is a step with no optimizer time. The batches of a step are fetched by
``trainer.get_batch_samples``, timed as data wait. Evaluation runs in eval mode without grad:
evaluation time, not work.

With ``log_to_trainer=True`` the rank's busy share (busy over step time) goes into the Trainer's own logs
(``stragglerwatch/busy_share``, at its ``logging_steps``): added to the log the Trainer makes, in
``on_log``, with our callback moved ahead of the reporting integrations so that they get it too. It
never calls ``trainer.log`` during training: that call ends in ``CallbackHandler.on_log``, which clears
``control.should_log``, and the Trainer then skips its own loss all-gather at that step; a rank whose
first step was not yet written would still gather, and the ranks' collectives would pair wrongly (on
gloo, an abort). The job's verdict is logged by the main process at the end
of training, from the run dir, on a thread of its own once every rank's log is complete (no
barrier: the job does not wait for it; ``callback.verdict.join(timeout_s)`` does, and so does the
interpreter's exit, at most 30 s).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from stragglerwatch.integrations._common import LateVerdict, find_caller_self
from stragglerwatch.runtime.config import Config
from stragglerwatch.runtime.watch import Watch, attach

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:
    raise ImportError(
        "stragglerwatch.integrations.transformers needs transformers: pip install 'stragglerwatch[transformers]'"
    ) from exc


class StragglerWatchCallback(TrainerCallback):
    """Record every rank's step anatomy with stragglerwatch during ``trainer.train()``.

    ``run_dir`` and ``attach_options`` are those of :func:`stragglerwatch.attach`;
    ``log_to_trainer`` also puts the busy share and the final verdict into the Trainer's logs."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str] | None = None,
        *,
        log_to_trainer: bool = False,
        **attach_options: Any,
    ) -> None:
        Config.resolve(environ={}, run_dir=run_dir, **attach_options)  # a mistake fails here, not at train start
        self.run_dir = run_dir
        self.log_to_trainer = log_to_trainer
        self.attach_options = attach_options
        self.watch: Watch | None = None
        self.verdict: LateVerdict | None = None  # rank 0's end-of-fit verdict, computed on a thread of its own
        self.trainer: Any = None
        self._pending: dict[str, float] | None = None  # this step's figures, for the log the Trainer makes

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if self.watch is not None and self.watch.enabled:
            return
        self.trainer = find_caller_self(Trainer)
        callbacks = getattr(getattr(self.trainer, "callback_handler", None), "callbacks", None)
        if self.log_to_trainer and isinstance(callbacks, list) and self in callbacks:
            callbacks.remove(self)  # ahead of the reporting integrations: they see what on_log adds
            callbacks.insert(0, self)
        wrapped = getattr(self.trainer, "model_wrapped", None)
        self.watch = attach(wrapped if wrapped is not None else model, self.run_dir, **self.attach_options)
        if self.trainer is not None and callable(getattr(self.trainer, "get_batch_samples", None)):
            self.watch.time_data(self.trainer, "get_batch_samples")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.log_to_trainer or self.watch is None or self.trainer is None:
            return
        every = args.logging_steps if args.logging_steps >= 1 else args.logging_steps * (state.max_steps or 0)
        if state.global_step % max(1, int(every)) == 0:
            latest = self.watch.latest()
            if latest is not None:  # goes into the log the Trainer makes now (on_log), on this rank alone
                self._pending = {"stragglerwatch/busy_share": round(latest["busy_share"], 4)}

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        pending, self._pending = self._pending, None
        if not pending or logs is None:
            return
        logs.update(pending)  # the reporting integrations after us get it
        history = getattr(state, "log_history", None)
        if history and isinstance(history[-1], dict) and history[-1].get("step") == state.global_step:
            history[-1].update(pending)  # the Trainer appended its copy of this log before calling on_log

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        watch, self.watch = self.watch, None
        if watch is None:
            return
        run_dir = watch.run_dir
        watch.close()
        trainer, self.trainer = self.trainer, None
        if not self.log_to_trainer or trainer is None:
            return
        if not state.is_world_process_zero:
            return
        world = watch.info.world_size if watch.info else 1
        self.verdict = LateVerdict(Path(run_dir) if run_dir else None, world, watch.problems,
                                   lambda metrics: _log_keeping_flags(trainer, metrics)).start()  # fmt: skip


def _log_keeping_flags(trainer: Any, metrics: dict[str, float]) -> None:
    """``trainer.log`` without touching the Trainer's flow: its ``on_log`` clears ``should_log``."""
    control = getattr(trainer, "control", None)
    flag = getattr(control, "should_log", None)
    trainer.log(metrics)
    if control is not None and flag is not None:
        control.should_log = flag
