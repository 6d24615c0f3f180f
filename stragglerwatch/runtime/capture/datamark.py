"""``Watch.data()``: mark where a loop without a ``DataLoader`` fetches its batches.

Many training scripts fetch with a function of their own (``get_batch`` slicing a memory-mapped
file), some of them between a micro-batch's forward and its backward, so that host I/O overlaps the
GPU's work. Time inside a marked fetch is data wait wherever it happens in the step: it is carved
out of the step like a collective (``timing.anatomy``), so a fetch between forward and backward is
data, not ``other``. Once a fetch is marked, only marked (or wrapped-loader) time is data wait: the
gap before the first forward is no longer taken for it.

Two shapes, both cheap (two clock reads, or two CUDA events, per fetch):

- a wrapper for a fetch function: ``get_batch = watch.data(get_batch)``;
- a context manager: ``with watch.data(): x, y = next(it)``.

A fetch on another thread than the training thread (a prefetcher) is not waited for by the step
and is not counted.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from stragglerwatch.runtime.capture.probes import StepProbe

F = TypeVar("F", bound=Callable[..., Any])


class DataMark:
    """A marked fetch: ``with watch.data(): ...`` (re-entrant; each ``with`` is one fetch)."""

    __slots__ = ("_probe", "_tokens")

    def __init__(self, probe: StepProbe | None):
        self._probe = probe
        self._tokens: list[Any] = []
        if probe is not None:
            probe.exact_data()

    def __enter__(self) -> DataMark:
        if self._probe is not None:
            self._tokens.append(self._probe.data_begin())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._probe is not None and self._tokens:
            self._probe.data_end(self._tokens.pop())


def mark_fetch(probe: StepProbe, fetch: F) -> F:
    """``fetch`` with every call timed as data wait."""
    probe.exact_data()

    @functools.wraps(fetch)
    def fetched(*args: Any, **kwargs: Any) -> Any:
        token = probe.data_begin()
        try:
            return fetch(*args, **kwargs)
        finally:
            probe.data_end(token)

    return fetched  # type: ignore[return-value]
