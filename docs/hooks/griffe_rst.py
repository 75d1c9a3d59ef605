"""A griffe extension for the API reference: the docstrings' reST cross-references as Markdown code.

leank's docstrings name other objects Sphinx-style (``:class:`~leank_infer.decode.cache.LeanKCache```);
mkdocstrings renders Markdown, where that would show the role literally. This rewrites each role to a
code span of the name (the last part only with ``~``, as Sphinx does).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension

ROLE = re.compile(r":(?:class|func|meth|mod|data|attr|exc|obj):`(~?)([\w.]+)(?:\(\))?`")


def plain(text: str) -> str:
    return ROLE.sub(lambda m: f"`{m.group(2).rsplit('.', 1)[-1] if m.group(1) else m.group(2)}`", text)


class RstRoles(Extension):
    def on_object(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = plain(obj.docstring.value)
