"""Warnings an analysis expects (numpy's "Mean of empty slice" on a step no rank measured), silenced
in a way threads can share. Imports nothing of ours.

``warnings.catch_warnings`` saves the process's filter list on entry and puts it back on exit: two
threads inside such blocks at once (the live path's work fit on a thread beside its updates, rounds run
on slices in threads) can each put back the other's filters, and leave the process with warnings
hidden or shown for good. :func:`ignoring` instead adds one filter per category while any caller is
inside, counted under a lock, and takes that filter out when the last one leaves; whatever else
changed the list meanwhile stays."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_inside: dict[type[Warning], int] = {}  # per category, how many callers are inside ignoring() now
_added: dict[type[Warning], tuple] = {}  # per category, the filter entry ignoring() added


@contextmanager
def ignoring(*categories: type[Warning]) -> Iterator[None]:
    """Ignore warnings of ``categories`` (default: ``RuntimeWarning``) while inside, in every thread."""
    categories = categories or (RuntimeWarning,)
    with _lock:
        for category in categories:
            _inside[category] = _inside.get(category, 0) + 1
            if _inside[category] == 1:
                warnings.filterwarnings("ignore", category=category)
                _added[category] = warnings.filters[0]
    try:
        yield
    finally:
        with _lock:
            for category in categories:
                _inside[category] -= 1
                if _inside[category] == 0:
                    entry = _added.pop(category)
                    for i, f in enumerate(warnings.filters):
                        if f is entry:
                            del warnings.filters[i]
                            # the interpreter caches what each warning site did per filter list version
                            getattr(warnings, "_filters_mutated", lambda: None)()
                            break
