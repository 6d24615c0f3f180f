"""Slowdowns in one vocabulary: a ratio of a rank's time to its peers' (``1.2``: 20 % slower, printed
``1.20x``), in settings, command-line options and reports alike. Given as a number, or as text: ``"1.2"``,
``"1.2x"`` or ``"20%"``. Imports nothing of ours: settings and options of every part read it."""

from __future__ import annotations

import math
from typing import Any


def parse_slowdown(name: str, value: Any, lo: float = 1.0, hi: float | None = None, *, inclusive: bool = False
                   ) -> float:  # fmt: skip
    """``value`` as a slowdown ratio above ``lo`` (or from it: ``inclusive``), at most ``hi``; ``ValueError``
    with a one-line message
    naming ``name``, the value and what is allowed. A fraction such as ``0.06`` is refused with a hint
    (it reads as "6 % of its peers' time"), not taken as 6 % slower."""
    ratio = _ratio(value)
    if ratio is None:
        raise ValueError(f"{name}={value!r} is not a slowdown: give a ratio to the peers' time such as 1.2, "
                         "'1.2x' or '20%'")  # fmt: skip
    bounds = f"{'from' if inclusive else 'above'} {lo:g}" + (f" and at most {hi:g}" if hi is not None else "")
    if ratio < lo or (ratio == lo and not inclusive) or (hi is not None and ratio > hi):
        hint = f" (did you mean {1 + ratio:g}, i.e. {ratio * 100:g}% slower?)" if 0 < ratio < 1 else ""
        raise ValueError(f"{name}={value!r} is out of range: a slowdown ratio {bounds}{hint}")
    return ratio


def _ratio(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        percent = text.endswith("%")
        text = text.rstrip("%x").strip() if percent or text.endswith("x") else text
        try:
            number = float(text)
        except ValueError:
            return None
        if percent:
            number = 1.0 + number / 100.0
    else:
        return None
    return number if math.isfinite(number) else None

