"""A process of ours turns numpy's huge-page advice off only where the kernel would stall on it, and glibc's fast
bins off on glibc only."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import pytest

from stragglerwatch._memory import avoid_compaction_stalls, avoid_consolidation_stalls, selected

try:
    from numpy._core import multiarray
except ImportError:  # numpy 1.x
    from numpy.core import multiarray  # type: ignore[no-redef]


@pytest.fixture
def advice():
    """numpy's huge-page advice, on for the test and put back after it."""
    before = multiarray._get_madvise_hugepage()
    multiarray._set_madvise_hugepage(True)
    yield multiarray._get_madvise_hugepage
    multiarray._set_madvise_hugepage(before)


def _defrag(tmp_path: Path, setting: str) -> Path:
    """A ``transparent_hugepage/defrag`` file selecting ``setting``."""
    words = ["always", "defer", "defer+madvise", "madvise", "never"]
    defrag = tmp_path / "defrag"
    defrag.write_text(" ".join(f"[{w}]" if w == setting else w for w in words) + "\n")
    return defrag


def test_the_selected_setting_is_the_bracketed_word() -> None:
    assert selected("always defer defer+madvise [madvise] never\n") == "madvise"
    assert selected("[always] madvise never") == "always"
    assert selected("always madvise never") is None
    assert selected("") is None


@pytest.mark.parametrize(("setting", "stalls"), [("always", True), ("madvise", True), ("defer+madvise", True),
                                                 ("defer", False), ("never", False)])  # fmt: skip
def test_advice_is_off_only_where_a_fault_compacts_memory(tmp_path: Path, advice, setting: str, stalls: bool) -> None:
    defrag = _defrag(tmp_path, setting)
    assert avoid_compaction_stalls(defrag) is stalls
    assert advice() is not stalls


def test_a_kernel_without_the_setting_changes_nothing(tmp_path: Path, advice) -> None:
    assert avoid_compaction_stalls(tmp_path / "missing") is False
    assert avoid_compaction_stalls(tmp_path) is False  # a directory: unreadable as text
    assert advice() is True


#: A child that frees many small blocks of glibc's and prints the bytes its fast bins then hold (``mallinfo2``'s
#: ``fsmblks``), after turning them off or not.
FREED_IN_FAST_BINS = """
import ctypes, sys
from stragglerwatch._memory import avoid_consolidation_stalls
if sys.argv[1] == "off":
    assert avoid_consolidation_stalls() and avoid_consolidation_stalls()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, (ctypes.c_size_t,), (ctypes.c_void_p,)
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
blocks = [libc.malloc(40) for _ in range(2000)]
keep = [libc.malloc(40) for _ in range(2000)]  # the heap's top stays used
for b in blocks:
    libc.free(b)
print(libc.mallinfo2().fsmblks)
"""


def _glibc() -> tuple[int, ...]:
    name, version = platform.libc_ver()
    return tuple(int(p) for p in version.split(".") if p.isdigit()) if name == "glibc" else ()


@pytest.mark.skipif(_glibc() < (2, 33),
                    reason="glibc's allocator (mallinfo2: 2.33 on)")  # fmt: skip
def test_fast_bins_go_off_in_a_glibc_process() -> None:
    held = {}
    for how in ("on", "off"):
        done = subprocess.run([sys.executable, "-c", FREED_IN_FAST_BINS, how], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        held[how] = int(done.stdout)
    assert held["on"] > 0 and held["off"] == 0, held


def test_another_c_library_is_left_as_it_is() -> None:
    assert avoid_consolidation_stalls("musl") is False


@pytest.mark.parametrize(("setting", "stalls"), [("always", True), ("madvise", True), ("defer+madvise", True),
                                                 ("defer", False), ("never", False)])  # fmt: skip
def test_a_window_s_copy_asks_for_huge_pages_only_where_they_come_without_a_stall(tmp_path: Path, setting: str,
                                                                                   stalls: bool) -> None:  # fmt: skip
    from stragglerwatch._memory import huge_pages_stall

    defrag = _defrag(tmp_path, setting)
    assert huge_pages_stall(defrag) is stalls
    assert huge_pages_stall(tmp_path / "missing") is False
