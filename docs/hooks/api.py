"""MkDocs hook: the API reference renders the docstrings' Sphinx roles (``:func:`fedkl.train```) as plain code.

mkdocstrings renders a docstring as Markdown, where a role stays literal text (``:func:`` before the code span);
this drops the role and a leading ``~`` (Sphinx's "last component only") from the pages under ``api/``."""

from __future__ import annotations

import re

ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc|obj|const):(<code>)~?")


def on_page_content(html: str, page, config, files) -> str:
    return ROLE.sub(r"\1", html) if page.file.src_uri.startswith("api/") else html
