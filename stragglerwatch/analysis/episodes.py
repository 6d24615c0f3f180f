"""A straggler's episodes joined into spells: pure, without numpy or pandas, so that the policy, which runs in
the training process, can read a report's episodes as the detector writes them.

A report holds one entry per rank; each flagged stretch of that rank is an episode ``(first, last, detected)``
(``last`` None while it is still open). A *spell* is a run of episodes each at most ``gap`` steps after the
one before: a short pause (a stall, a gap in the data) makes no new one. A policy acts once per spell; the
benchmarks score each spell as a flag.
"""

from __future__ import annotations

from collections.abc import Sequence

Episode = tuple[int, "int | None", int]


def spells(episodes: Sequence[Sequence[int | None]], gap: int) -> list[Episode]:
    """``(first, last, detected)`` episodes (in step order) with those at most ``gap`` steps after the one
    before joined; each spell keeps its first episode's detection step."""
    out: list[Episode] = []
    for first, last, detected in episodes:
        if out and out[-1][1] is not None and int(first) - int(out[-1][1]) <= gap:  # type: ignore[arg-type]
            out[-1] = (out[-1][0], last, out[-1][2])
        else:
            out.append((int(first), last, int(detected)))  # type: ignore[arg-type]
    return out
