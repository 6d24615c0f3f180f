"""How a process of ours that analyses (the command line, the dashboard service) takes memory.

Two settings of the process stall an analysis on its memory, and both are turned off by :func:`for_analysis`:

- **Huge pages.** numpy asks the kernel for transparent huge pages (``madvise(MADV_HUGEPAGE)``) for every array
  of 4 MiB or more. Where the kernel then compacts memory at the page fault to find them
  (``transparent_hugepage/defrag`` set to ``always``, ``madvise`` or ``defer+madvise``, the first two common
  defaults) and memory is fragmented, every fresh large array stalls in the kernel, and an analysis makes
  hundreds of them (each a few tens of MB: a column of steps x ranks). Measured on ``analyze`` of 1,024 ranks x
  10,000 steps with work recorded, in turns: 12.2 s with numpy's huge pages (7.2 s of it system time), 9.9 s
  without (2.7 s); docs/accuracy-overhead.md.
- **Fast bins.** glibc's allocator keeps small freed blocks in "fast bins" and merges them all at the next
  request of a kilobyte or more. A followed run reads every rank's new batches at each update: thousands of
  Arrow objects, hundreds of thousands of small C++ blocks, freed together; the first array made after them
  paid for merging them all (about 55 ms of an update of 0.8 s at 4,096 ranks, in ``np.arange(4096)``). With
  no fast bins a freed block is merged as it is freed.

Only processes of ours turn them off: inside a training process (``attach``, the policy thread) numpy's and
the allocator's settings stay the user's.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from pathlib import Path

DEFRAG = Path("/sys/kernel/mm/transparent_hugepage/defrag")
#: The defrag settings under which a fault in an madvised region compacts memory on the spot.
STALLS = frozenset({"always", "madvise", "defer+madvise"})
#: glibc's ``mallopt`` parameter of the largest request served from the fast bins (0: none are).
M_MXFAST = 1


def selected(text: str) -> str | None:
    """The setting a sysfs choice line selects (``"always defer [madvise] never"`` -> ``"madvise"``)."""
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return None


@functools.lru_cache(maxsize=4)
def huge_pages_stall(defrag: Path = DEFRAG) -> bool:
    """Whether the kernel compacts memory at the page fault of a region advised for huge pages (read once)."""
    try:
        return selected(defrag.read_text()) in STALLS
    except OSError:
        return False


def avoid_compaction_stalls(defrag: Path = DEFRAG) -> bool:
    """Turn numpy's huge-page advice off where the kernel would stall on it; whether it did. Never raises: a
    kernel without the setting, or a numpy without the switch, leaves everything as it was."""
    try:
        if not huge_pages_stall(defrag):
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
    except Exception:  # a numpy that refuses: nothing is changed
        return False


def avoid_consolidation_stalls(libc: str | None = None) -> bool:
    """Turn glibc's fast bins off; whether it did. Never raises: another C library (musl, macOS) is left as
    it is. ``libc``: the C library's name where it is not glibc (tests)."""
    try:
        if (libc or platform.libc_ver()[0]) != "glibc":
            return False
        mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
        if mallopt is None:
            return False
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        return bool(mallopt(M_MXFAST, 0))
    except Exception:  # OSError (no symbols to load): nothing is changed
        return False


def for_analysis() -> dict[str, bool]:
    """Both settings, for a process of ours about to analyse; which were changed."""
    return {"huge_pages_off": avoid_compaction_stalls(), "fast_bins_off": avoid_consolidation_stalls()}
