"""The command-line process turns numpy's huge-page advice off only where the kernel would stall on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from stragglerwatch.cli.memory import avoid_compaction_stalls, selected

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


def test_the_selected_setting_is_the_bracketed_word() -> None:
    assert selected("always defer defer+madvise [madvise] never\n") == "madvise"
    assert selected("[always] madvise never") == "always"
    assert selected("always madvise never") is None
    assert selected("") is None


@pytest.mark.parametrize(("setting", "stalls"), [("always", True), ("madvise", True), ("defer+madvise", True),
                                                 ("defer", False), ("never", False)])  # fmt: skip
def test_advice_is_off_only_where_a_fault_compacts_memory(tmp_path: Path, advice, setting: str, stalls: bool) -> None:
    words = ["always", "defer", "defer+madvise", "madvise", "never"]
    defrag = tmp_path / "defrag"
    defrag.write_text(" ".join(f"[{w}]" if w == setting else w for w in words) + "\n")
    assert avoid_compaction_stalls(defrag) is stalls
    assert advice() is not stalls


def test_a_kernel_without_the_setting_changes_nothing(tmp_path: Path, advice) -> None:
    assert avoid_compaction_stalls(tmp_path / "missing") is False
    assert avoid_compaction_stalls(tmp_path) is False  # a directory: unreadable as text
    assert advice() is True
