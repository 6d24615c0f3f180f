"""How the command-line process takes memory from the kernel.

numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) for every array of 4 MiB or more.
Where the kernel then compacts memory at the page fault to find them (``transparent_hugepage/defrag`` set to
``always``, ``madvise`` or ``defer+madvise``, the first two common defaults) and memory is fragmented, every
fresh large array stalls in the kernel, and an analysis makes hundreds of them (each a few tens of MB: a column of
steps x ranks). Measured on ``analyze`` of 1,024 ranks x 10,000 steps with work recorded, in turns: 12.2 s with
numpy's huge pages (7.2 s of it system time), 9.9 s without (2.7 s); docs/accuracy-overhead.md.

Only the command-line process (``analyze``, ``dashboard``, ...) turns them off, where the kernel stalls for them:
inside a training process (``attach``, the policy thread) numpy's settings stay the user's.
"""

from __future__ import annotations

from pathlib import Path

DEFRAG = Path("/sys/kernel/mm/transparent_hugepage/defrag")
#: The defrag settings under which a fault in an madvised region compacts memory on the spot.
STALLS = frozenset({"always", "madvise", "defer+madvise"})


def selected(text: str) -> str | None:
    """The setting a sysfs choice line selects (``"always defer [madvise] never"`` -> ``"madvise"``)."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


def avoid_compaction_stalls(defrag: Path = DEFRAG) -> bool:
    """Turn numpy's huge-page advice off where the kernel would stall on it; whether it did. Never raises: a
    kernel without the setting, or a numpy without the switch, leaves everything as it was."""
    try:
        if selected(defrag.read_text()) not in STALLS:
            return False
        try:
            from numpy._core import multiarray
        except ImportError:  # numpy 1.x
            from numpy.core import multiarray  # type: ignore[no-redef]
        switch = getattr(multiarray, "_set_madvise_hugepage", None)
        if switch is None:
            return False
        switch(False)
        return True
    except Exception:  # OSError (no such file), or a numpy that refuses: nothing is changed
        return False
