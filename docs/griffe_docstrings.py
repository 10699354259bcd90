"""A griffe extension for the docs site: the library's docstrings, read as the site needs them.

* The docstrings head their doctests ``Example:``; griffe's Google parser knows only
  ``Examples:`` and would render the session as prose (its ``[...]`` outputs even as links).
  Renamed, the session becomes a highlighted ``pycon`` block.
* Sphinx roles such as ``:class:`~amp_plugin.LossScaler``` would show as raw text; they become
  code spans (``LossScaler``, the last part where the target starts with ``~``).

Only the text griffe loaded changes; the source is not touched.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADER = re.compile(r"^(\s*)Example:[ \t]*$", re.M)
_ROLE = re.compile(r":(?:py:)?[a-z]+:`(~?)([^`<]+)`")


def _code_span(match: re.Match[str]) -> str:
    target = match.group(2).strip()
    return f"`{target.rsplit('.', 1)[-1] if match.group(1) else target}`"


class SiteDocstrings(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _HEADER.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(_code_span, text)
