"""How a staged analysis reaches the run's data: by step rows or by rank columns. Pure.

The analyses that need both every rank of a step and every step of a rank (the work fit, the imbalance
cost) are written as rounds: a *step round* calls a function on a slice of the steps with every rank
(``fn(values, rows, cols, *args)``, ``cols`` all ranks), a *rank round* on a slice of the ranks with every
step. A result of a step round depends only on its rows, one of a rank round only on its columns, and the
driver code between rounds combines them in order, so whatever the slices the results are the same.

:class:`Whole` runs a round on the whole run in one piece (the local engine, the live path);
``rayengine`` runs each slice as a Ray task over its step parts and rank blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

Values = dict[str, np.ndarray]


class Rounds(Protocol):
    """Runs a round over the slices of a run, and returns the slices' results in step or rank order."""

    def by_steps(self, fn: Callable[..., Any], *args: Any) -> list[Any]: ...

    def by_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]: ...


@dataclass
class Whole:
    """Every round on the whole of a steps x ranks ``values`` at once."""

    values: Values

    def _all(self) -> tuple[slice, slice]:
        s, r = self.values["busy_s"].shape
        return slice(0, s), slice(0, r)

    def by_steps(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return [fn(self.values, *self._all(), *args)]

    def by_ranks(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        return [fn(self.values, *self._all(), *args)]


def joined(parts: list[Any]) -> Any:
    """The slices' results as one: their arrays (per step, or per rank, first) concatenated, dicts and tuples
    of them element by element. Rounds return per-step or per-rank arrays, never sums over their slice: the
    driver sums the whole array, so that no figure depends on where the slices were cut."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: joined([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(joined([p[i] for p in parts]) for i in range(len(first)))
    return np.concatenate(parts)


# Sums whose order of additions is fixed by the row (or column) alone, whatever slice of the run holds it:
# numpy adds a contiguous row pairwise, and a non-contiguous one element by element, so a round's sums are
# taken over contiguous copies.


def rowsum(x: np.ndarray) -> np.ndarray:
    """Per row (step), the sum of ``x``."""
    return np.ascontiguousarray(x).sum(axis=1)


def colsum(x: np.ndarray) -> np.ndarray:
    """Per column (rank), the sum of ``x``."""
    return np.asfortranarray(x).sum(axis=0)


def nanmean_rows(x: np.ndarray) -> np.ndarray:
    """Per row, the mean of the finite values (NaN where there are none)."""
    c = np.ascontiguousarray(x)
    n = np.isfinite(c).sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, np.nansum(c, axis=1) / np.maximum(n, 1), np.nan)


def nanvar_rows(x: np.ndarray) -> np.ndarray:
    """Per row, the variance of the finite values (NaN where there are none)."""
    d = x - nanmean_rows(x)[:, None]
    return nanmean_rows(d * d)


def nanvar_cols(x: np.ndarray) -> np.ndarray:
    """Per column, the variance of the finite values (NaN where there are none)."""
    return nanvar_rows(np.ascontiguousarray(x.T))
