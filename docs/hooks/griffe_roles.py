"""A Griffe extension for the API reference: the docstrings use Sphinx's cross-reference roles
(:class:`~stragglerwatch.runtime.config.Config`, :func:`attach`, :meth:`Config.resolve`), which
Markdown would show as they are written. Each becomes inline code with the name Sphinx would show:
the last part when the target starts with ``~``, else the target as written."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|data|exc|obj|const|type):`([^`]+)`")


def _shown(match: re.Match[str]) -> str:
    target = match.group(1).strip()
    if "<" in target and target.endswith(">"):  # :class:`title <target>`
        return f"`{target[: target.index('<')].strip()}`"
    if target.startswith("~"):
        target = target[1:].rpartition(".")[2]
    return f"`{target.lstrip('.')}`"


class SphinxRoles(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_shown, obj.docstring.value)
