"""A griffe extension for the docs site: the library's docstrings, read as the site needs them.

* The docstrings head their doctests ``Example:``; griffe's Google parser knows only
  ``Examples:`` and would render the session as prose (its ``[...]`` outputs even as links).
  Renamed, the session becomes a highlighted ``pycon`` block.
* Sphinx roles such as ``:class:`~amp_plugin.LossScaler``` would show as raw text; they become
  code spans that link to the object's entry where the reference documents it (an optional
  autorefs link: a target outside the reference, ``torch.xxx`` say, stays plain code). A name
  is looked up in the class, the enclosing class, then the module of the docstring; ``~``
  shows the last part.
* A reST literal-block marker (a line ending ``::``) becomes a single colon.
* A name a module re-exports (``amp_plugin.autocast`` re-exports ``Fp32Modules``, say) is
  documented once, in its home module; the re-export is not shown again.

Only the text griffe loaded changes; the source is not touched.
"""

from __future__ import annotations

import re
from html import escape
from typing import Any

import griffe

_HEADER = re.compile(r"^(\s*)Example:[ \t]*$", re.M)
_ROLE = re.compile(r":(?:py:)?(?P<role>[a-z]+):`(?P<tilde>~?)(?P<target>[^`<]+)`")
_LITERAL_MARKER = re.compile(r"(\S)::[ \t]*$", re.M)


def _identifier(role: str, target: str, obj: griffe.Object) -> str:
    """The full path a role's target names, seen from the docstring of ``obj``."""
    if role == "mod" or target.startswith("amp_plugin"):
        path = target
    else:
        head = target.split(".", 1)[0]
        scopes = [obj] if obj.is_class else []
        if obj.parent is not None and obj.parent.is_class:
            scopes.append(obj.parent)
        scopes.append(obj.module)
        path = next((f"{s.path}.{target}" for s in scopes if head in s.members), target)
    try:  # a re-export: name its home, where the entry is
        found = obj.modules_collection[path]
        return str(found.final_target.path if found.is_alias else found.path)
    except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
        return path


def _link(match: re.Match[str], obj: griffe.Object) -> str:
    target = match["target"].strip().removesuffix("()")
    shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
    identifier = escape(_identifier(match["role"], target, obj))
    return f'<autoref identifier="{identifier}" optional><code>{escape(shown)}</code></autoref>'


class SiteDocstrings(griffe.Extension):
    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:  # the tree is complete here
        if obj.docstring is None:
            return
        text = _HEADER.sub(r"\1Examples:", obj.docstring.value)
        text = _LITERAL_MARKER.sub(r"\1:", text)
        obj.docstring.value = _ROLE.sub(lambda m: _link(m, obj), text)

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        modules = [pkg]
        while modules:
            module = modules.pop()
            for member in module.members.values():
                if member.is_alias:
                    member.public = False
                elif member.is_module:
                    modules.append(member)
